"""Shared test helpers."""

from __future__ import annotations

import numpy as np
from scipy import stats


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of ``counts`` against ``probs`` (same shape, any dims).

    Categories with probability 0 must never be observed (asserted). Categories whose expected count is below 5
    are pooled into one bin; if that bin is still below 5 it is merged into the smallest other bin, so that
    every bin the test sees has an expected count of at least 5 (the chi-square approximation needs it).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, f"observed impossible outcomes: {np.flatnonzero(impossible & (counts > 0))}"
    exp = probs * counts.sum()
    big = exp >= 5
    small = (~big) & (~impossible)
    obs_bins, exp_bins = list(counts[big]), list(exp[big])
    assert len(obs_bins) >= 2, "too few categories with an expected count >= 5 for a chi-square test"
    if small.any():
        o, e = counts[small].sum(), exp[small].sum()
        if e < 5:
            i = int(np.argmin(exp_bins))
            obs_bins[i] += o
            exp_bins[i] += e
        else:
            obs_bins.append(o)
            exp_bins.append(e)
    obs_bins, exp_bins = np.array(obs_bins), np.array(exp_bins)
    exp_bins *= obs_bins.sum() / exp_bins.sum()
    return float(stats.chisquare(obs_bins, exp_bins).pvalue)


def record_caches(monkeypatch, module, name: str) -> list:
    """Replace the cache class ``module.name`` with a subclass that records every instance; returns the list."""
    created: list = []
    base = getattr(module, name)

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(module, name, Recording)
    return created


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
"""A minimal ChatML-like template for the tiny test tokenizers (``<s>`` / ``</s>`` are their bos / eos)."""


def chat_model_pair(root, layers: int = 2, context: int = 256):
    """A tiny random target and its perturbed draft whose tokenizer has :data:`CHAT_TEMPLATE`; their dirs."""
    from speculant.testing import save_model_pair, tiny_tokenizer

    tok = tiny_tokenizer(vocab_size=300)
    tok.chat_template = CHAT_TEMPLATE
    target, draft = save_model_pair(root, tok, hidden=32, layers=layers, context=context, init_std=0.5)
    return str(target), str(draft)
