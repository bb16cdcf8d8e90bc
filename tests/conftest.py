"""Shared fixtures: one thread for tiny models, and the session's tiny tokenizers and saved model pairs (each is
trained or built once per session and shared by every module that uses it; a test that changes a model or its
directory works on a copy)."""

from __future__ import annotations

import os

# One thread in this process and in the commands tests start, unless the developer says otherwise: before torch
# is imported (torch reads it once), and ``--threads auto`` keeps it rather than sampling the CPU load per command.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import CODE_CONTEXT, MULTIBYTE, chat_model_pair
from speculant.tiny_models import save_model_pair, stdlib_texts, tiny_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (two stall badly on a busy 2-core machine): every module runs on one
    unless it sets another count itself; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def code_tokenizer():
    """A 300-token byte-level BPE of ``textwrap.py`` and :data:`MULTIBYTE` (no chat template). Shared: a test that
    sets an attribute on it restores it (``monkeypatch.setattr``)."""
    return tiny_tokenizer(stdlib_texts(["textwrap.py"]) + [MULTIBYTE], vocab_size=300)


@pytest.fixture(scope="session")
def code_models(tmp_path_factory, code_tokenizer):
    """The code pair as model directories: ``target``, its perturbed ``draft`` (agrees often, not always), a
    ``bad_draft`` whose tokenizer differs (same vocabulary size), the ``tok`` and the ``root`` holding the pair.
    Read-only: copy a directory before changing it."""
    tok = code_tokenizer
    other = tiny_tokenizer(["completely different corpus 0123456789 xyz " * 20, MULTIBYTE], vocab_size=300)
    assert len(other) == len(tok) == 300
    root = tmp_path_factory.mktemp("code-models")
    # init_std 0.5: well-separated logits (greedy decisions, not float noise); scale 0.02: partial acceptance
    target, draft = save_model_pair(root, tok, hidden=32, layers=2, context=CODE_CONTEXT, init_std=0.5,
                                    draft_scale=0.02)
    _, bad_draft = save_model_pair(tmp_path_factory.mktemp("mismatch"), tok, hidden=32, layers=2,
                                   context=CODE_CONTEXT, init_std=0.5, draft_scale=0.02, draft_tokenizer=other)
    return {"target": str(target), "draft": str(draft), "bad_draft": str(bad_draft), "tok": tok, "root": root}


@pytest.fixture(scope="session")
def chat_models(tmp_path_factory) -> tuple[str, str]:
    """The chat pair's directories ``(target, draft)``: :func:`helpers.chat_model_pair` with 2 layers and a context
    of 2,048 (long enough for MT-Bench prompts and long generations). Read-only: copy before changing."""
    return chat_model_pair(tmp_path_factory.mktemp("chat-models"), layers=2, context=2048)
