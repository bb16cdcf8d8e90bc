"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (two stall badly on a busy 2-core machine); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
