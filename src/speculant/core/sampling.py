"""Logits warping shared by target and draft, and seeded random generators.

The same :func:`warp` is applied to target and draft logits, so that ``q`` and ``p`` in the verifier are the
distributions plain sampling with these settings would use. Speculative sampling then reproduces plain sampling's
distribution exactly.
"""

from __future__ import annotations

import torch

from .types import SamplingParams

__all__ = ["warp", "make_generator", "nucleus", "sample", "sample_rows", "uniform"]


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into probabilities ``[..., V]`` (float32) after temperature, top-k and top-p.

    Greedy settings (temperature 0) give the one-hot of the argmax, so callers may treat them uniformly.
    Top-k keeps the k largest logits; top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches ``top_p`` (the token that crosses the threshold is kept), like transformers' warpers.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    top_p = params.top_p if params.top_p is not None and params.top_p < 1.0 else None
    if params.top_k is not None and params.top_k < vocab:
        values, order = torch.topk(logits, params.top_k, dim=-1)  # [..., k], sorted
        if not bool(((logits >= values[..., -1:]).sum(-1) > params.top_k).any()):
            # no tie at the k-th logit, so the k are the kept set: the rest of the work is on them alone
            if top_p is not None:
                values = values.masked_fill(~_kept_prefix(values.softmax(-1), top_p), float("-inf"))
            return torch.zeros_like(logits).scatter(-1, order, values.softmax(-1))
        logits = logits.masked_fill(logits < values[..., -1:], float("-inf"))  # ties kept
    if top_p is not None:
        logits = logits.masked_fill(~nucleus(logits, top_p), float("-inf"))
    return logits.softmax(-1)


def _kept_prefix(head: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the probabilities ``head [..., n]`` (sorted, descending) top-p keeps: those whose mass strictly
    before them is below ``top_p`` (summed in float64: a float32 running sum over thousands of small probabilities
    moved the cut by many tokens), the first always."""
    head = head.double()
    keep = (head.cumsum(-1) - head) < top_p
    keep[..., 0] = True
    return keep


def nucleus(logits: torch.Tensor, top_p: float, first: int = 64) -> torch.Tensor:
    """Top-p's kept tokens ``[..., V]`` (bool): the smallest prefix of the distribution sorted by probability
    whose mass reaches ``top_p`` (the token that crosses it kept; at least one token).

    Only the head of the order is sorted: the ``first`` most probable tokens (``torch.topk``), then 8 times as
    many while some row's head holds less than ``top_p`` (all of them once that passes a quarter of the
    vocabulary). A full sort of a 150k-token vocabulary costs tens of milliseconds per row on a small CPU
    (``benchmarks/sampler_cost.py`` measures it); a chat's nucleus is usually a few dozen tokens."""
    probs = logits.softmax(-1)  # [..., V]
    vocab = probs.shape[-1]
    k = min(first, vocab)
    while True:
        head, order = probs.topk(k, dim=-1)  # [..., k], sorted
        if k == vocab or bool((head.double().cumsum(-1)[..., -1] >= top_p).all()):  # the cut is inside
            break
        k = vocab if 8 * k > vocab // 4 else 8 * k  # past a quarter of it: one full sort
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, _kept_prefix(head, top_p))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device``, seeded with ``seed`` (or from entropy when ``seed`` is None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


_BLOCK = 1024
"""Tokens per block of :func:`sample`'s two-level draw (vocabularies over four blocks)."""


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a 1-D distribution ``[V]`` (non-negative, any positive total).

    On a CPU it inverts the cumulative distribution at one uniform draw, accumulated in float64: exact to double
    precision, and a token of probability 0 is never drawn. Over a large vocabulary in two levels: the blocks'
    sums, then the cumulative sum inside the drawn block only. ``torch.multinomial``, which it replaced there, draws
    V exponentials per token: over a 150k-token vocabulary an order of magnitude slower on a CPU
    (``benchmarks/sampler_cost.py`` measures both), several times per step of sampled speculation. On an accelerator
    ``torch.multinomial`` stays (one kernel, one wait)."""
    if probs.dim() != 1:
        raise ValueError(f"sample draws from one distribution [V], got shape {list(probs.shape)}")
    if probs.device.type != "cpu":
        return int(torch.multinomial(probs, 1, generator=generator))
    vocab = probs.shape[0]
    two_level = vocab > 4 * _BLOCK
    if two_level:
        whole = vocab - vocab % _BLOCK
        sums = probs[:whole].reshape(-1, _BLOCK).sum(-1, dtype=torch.float64)  # [V // BLOCK]
        if whole < vocab:
            sums = torch.cat([sums, probs[whole:].sum(dtype=torch.float64).reshape(1)])
        blocks = sums.cumsum(0)  # [B]
        total = float(blocks[-1])
    else:
        cdf = probs.double().cumsum(0)  # [V]
        total = float(cdf[-1])
    if not 0.0 < total < float("inf"):
        raise ValueError(f"cannot sample from a distribution whose total is {total}")
    u = torch.rand((1,), dtype=torch.float64, generator=generator) * total  # [1]
    start = 0
    if two_level:
        j = min(int(torch.searchsorted(blocks, u, right=True)), len(blocks) - 1)
        start = j * _BLOCK
        cdf = probs[start:start + _BLOCK].double().cumsum(0)  # [<= BLOCK]
        if j:
            u = u - blocks[j - 1]
    i = start + min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
    if float(probs[i]) <= 0.0:  # u rounded onto the very end: the last token with any probability before it
        i = int(torch.nonzero(probs[:i]).max())
    return i


def sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id from each row of ``probs [R, V]`` -> int64 ``[R]`` on ``probs``'s device (:func:`sample` on a
    CPU, one ``torch.multinomial`` for all rows elsewhere, with no wait for the host)."""
    if probs.device.type != "cpu":
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return torch.tensor([sample(row, generator) for row in probs], dtype=torch.long)


def uniform(generator: torch.Generator, device: torch.device | str = "cpu") -> float:
    """One draw from U[0, 1)."""
    return float(torch.rand((), generator=generator, device=device))
