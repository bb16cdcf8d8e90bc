"""CAOTE (Goel et al. 2025, "CAOTE: KV Caching through Attention Output Error based Token Eviction").

A meta-method over any base score: normalise the base score to ``alpha`` (sum 1 per head), the attention output
is ``X = sum_i alpha_i v_i``; removing token ``j`` (and renormalising) changes it by
``alpha_j (v_j - X) / (1 - alpha_j)``, so the score is ``c_j = alpha_j / (1 - alpha_j) * |X - v_j|_2`` and the
smallest are evicted. FastCAOTE approximates ``X`` by the mean of the values.

``alpha`` is the inner policy's base score over *every* cached token, its pinned tokens included
(:meth:`speculant.kv.policies.ScorePolicy.parts`): for ``caote:h2o`` it is the normalised accumulated attention of
all tokens, the recent window's too, so ``X`` is the attention output the paper defines; the pinned tokens are then
kept whatever their CAOTE score. (Policies without a separate base, e.g. StreamingLLM's ``+inf`` sinks, give their
pinned tokens mass 0.)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..core.checks import warn_once
from .policies import ScoreContext, WrapperPolicy

__all__ = ["CAOTE", "caote_scores", "warn_nesting"]

_EPS = 1e-6


def caote_scores(alpha: torch.Tensor, values: torch.Tensor, fast: bool = False) -> torch.Tensor:
    """``alpha [B, H, T]`` (non-negative, sums to 1 over T), ``values [B, H, T, Dv]`` -> ``c [B, H, T]``."""
    alpha = alpha.float()
    v = values.float()
    x = v.mean(2, keepdim=True) if fast else (alpha.unsqueeze(-1) * v).sum(2, keepdim=True)  # [B, H, 1, Dv]
    return alpha / (1 - alpha).clamp_min(_EPS) * (x - v).norm(dim=-1)


@dataclass
class CAOTE(WrapperPolicy):
    """Wrapper: CAOTE (``fast=False``) or FastCAOTE (``fast=True``) on top of ``inner``'s scores.

    ``alpha`` is ``inner``'s base score (:meth:`ScorePolicy.parts`) normalised over all cached tokens, pinned ones
    included: an attention mass (``inner.mass_base``: H2O, TOVA, SnapKV, SpecKV) clamped at 0, any other score
    (KeyDiff, key norm) shifted to start at 0 per head; ``inner``'s pinned tokens stay pinned (score ``+inf``).
    """

    fast: bool = False

    @property
    def name(self) -> str:
        return f"{'fastcaote' if self.fast else 'caote'}:{self.inner.name}"

    def score(self, keys: torch.Tensor, values: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        base, pinned = self.inner.parts(keys, values, ctx)  # [B, H, T] each
        base = base.float().nan_to_num(0.0, posinf=0.0)
        # an attention mass is alpha as it is; any other base (KeyDiff's -cos, a key norm) is shifted so that its
        # lowest token gets 0: clamping a signed score at 0 would give most tokens the same alpha (on Qwen2.5 almost
        # every key has a positive cosine to the mean key, so -cos < 0) and evict among them at random
        mass = base.clamp_min(0.0) if self.inner.mass_base else base - base.amin(-1, keepdim=True)
        alpha = mass / mass.sum(-1, keepdim=True).clamp_min(_EPS)
        return caote_scores(alpha, values, self.fast).masked_fill(pinned, math.inf)


def warn_nesting(policy) -> None:
    """Warn (once) about a KV policy that wraps CAOTE in CAOTE (``caote:caote:h2o``, ``fastcaote:caote:...``):
    the outer CAOTE reads the inner one's eviction-error scores as attention weights, which is not what either
    method defines; one CAOTE level over the base policy is meant."""
    levels, node = 0, policy
    while node is not None:
        levels += isinstance(node, CAOTE)
        node = getattr(node, "inner", None)  # wrappers hold the wrapped policy in ``inner``
    if levels > 1:
        name = getattr(policy, "name", type(policy).__name__)
        warn_once(logging.getLogger(__name__),
                  f"KV policy {name!r} nests CAOTE {levels} times: the outer level reads CAOTE scores as attention "
                  "weights, which is not a meaningful policy; use one level over the base policy (e.g. caote:h2o)")
