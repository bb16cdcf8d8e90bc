"""Logits warping shared by target and draft, and seeded random generators.

The same :func:`warp` is applied to target and draft logits, so that ``q`` and ``p`` in the verifier are the
distributions plain sampling with these settings would use. Speculative sampling then reproduces plain sampling's
distribution exactly.
"""

from __future__ import annotations

import torch

from .types import SamplingParams

__all__ = ["warp", "make_generator", "sample", "uniform"]


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
    if params.top_k is not None and params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # mass strictly before each sorted token; drop a token when that mass already reaches top_p
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


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

    It inverts the cumulative distribution at one uniform draw, accumulated in float64: exact to double precision,
    and a token of probability 0 is never drawn. Over a large vocabulary in two levels (the blocks' sums, then the
    cumulative sum inside the drawn block only), so that no V-long float64 buffer is made: at 151,936 tokens it
    takes ~0.2 ms on one core of the 2-core AMD EPYC host, where ``torch.multinomial`` (which draws V exponentials)
    took ~5 ms, several times per step of sampled speculation."""
    vocab = probs.shape[-1]
    if vocab <= 4 * _BLOCK:
        start, cdf = 0, probs.double().cumsum(0)  # [V]
        u = torch.rand((1,), dtype=torch.float64, generator=generator, device=probs.device) * cdf[-1]
    else:
        whole = vocab - vocab % _BLOCK
        sums = probs[:whole].view(-1, _BLOCK).sum(-1, dtype=torch.float64)  # [V // BLOCK]
        if whole < vocab:
            sums = torch.cat([sums, probs[whole:].sum(dtype=torch.float64).reshape(1)])
        blocks = sums.cumsum(0)  # [B]
        u = torch.rand((1,), dtype=torch.float64, generator=generator, device=probs.device) * blocks[-1]
        j = min(int(torch.searchsorted(blocks, u, right=True)), len(blocks) - 1)
        start = j * _BLOCK
        cdf = probs[start:start + _BLOCK].double().cumsum(0)  # [<= BLOCK]
        if j:
            u = u - blocks[j - 1]
    total = float(cdf[-1]) if vocab <= 4 * _BLOCK else float(blocks[-1])
    if not 0.0 < total < float("inf"):
        raise ValueError(f"cannot sample from a distribution whose total is {total}")
    i = start + min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
    if float(probs[i]) <= 0.0:  # u rounded onto the very end: the last token with any probability before it
        i = int(torch.nonzero(probs[:i]).max())
    return i


def uniform(generator: torch.Generator, device: torch.device | str = "cpu") -> float:
    """One draw from U[0, 1)."""
    return float(torch.rand((), generator=generator, device=device))
