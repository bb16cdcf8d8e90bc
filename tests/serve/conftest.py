"""Fixtures of the server tests."""

from __future__ import annotations

import pytest

from helpers import chat_model_pair


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """A tiny chat target and its draft (2 layers, a context of 512): ``{"target": dir, "draft": dir}``."""
    target, draft = chat_model_pair(tmp_path_factory.mktemp("edges"), layers=2, context=512)
    return {"target": target, "draft": draft}
