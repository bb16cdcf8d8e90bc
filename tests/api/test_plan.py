"""Resolving a method (speculant.plan): a bad method option fails in ``resolve`` before anything loads, and a draft
given to a method that drafts without one warns once."""

from __future__ import annotations

import json

import pytest

import speculant.core.checks
from speculant import cli

from helpers import chat_model_pair

PROMPT = "def add(a, b):\n    return a + b\n\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = chat_model_pair(tmp_path_factory.mktemp("edges"), layers=2)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = chat_model_pair(tmp_path_factory.mktemp("edges"), layers=2, context=512)
    return {"target": target, "draft": draft}


@pytest.mark.parametrize("method", ["ar", "lookup", "mask-probe"])
def test_a_draft_unused_by_the_method_warns_once(pair, capsys, monkeypatch, method):
    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    argv = ["generate", PROMPT, "--target", pair[0], "--draft", pair[1], "--method", method, "--max-new-tokens",
            "2", "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["token_ids"]
    assert err.splitlines() == [f"speculant: WARNING: method {method!r} drafts without a model: --draft is not used"]


def test_a_draft_the_method_uses_does_not_warn(pair, capsys, monkeypatch):
    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    argv = ["generate", PROMPT, "--target", pair[0], "--draft", pair[1], "--method", "chain:k=2",
            "--max-new-tokens", "2", "--json"]
    assert cli.main(argv) == 0 and capsys.readouterr().err == ""


def test_bad_method_option_fails_in_resolve_before_loading(models):
    import speculant  # resolve loads nothing: the drafter's own check runs on a stand-in
    for spec, needle in (("chain:k=0", "k must be an integer >= 1, got 0"),
                         ("specinfer:width=0", "width must be"), ("lookup:k=-1", "k must be")):
        with pytest.raises(ValueError, match=needle) as info:
            speculant.resolve(models["target"], models["draft"], spec)
        assert spec in str(info.value) and "\n" not in str(info.value)
    assert speculant.resolve(models["target"], models["draft"], "chain:k=2").method.options == {"k": 2}
