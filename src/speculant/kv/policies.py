"""KV-cache eviction score policies: how much each cached token is worth keeping.

A policy is a small dataclass whose ``score(keys, values, ctx) -> [B, H_kv, T]`` rates every cached token of one
layer (higher = more worth keeping). Selection of the top ``N`` is written once, in :meth:`ScorePolicy.select`;
:func:`speculant.kv.budget.evict` applies it. Keys are cached *after* RoPE. Policies that read attention
probabilities set ``needs_attention`` and ``queries`` (how many of the latest queries they look at, 0 = all of
the latest forward); the budget code checks that flag in one place and fills ``ctx.attn``.

Every score is two parts, exposed by :meth:`ScorePolicy.parts`: a finite base score (for the attention policies
H2O, TOVA and SnapKV the attention mass each token received) and a boolean mask of *pinned* tokens the policy
always keeps (H2O's recent window, SnapKV's observation window, StreamingLLM's sinks, :class:`Protect`'s
window); ``score`` is the base with the pinned tokens set to ``+inf``. CAOTE reads the parts, so that its
attention distribution includes the pinned tokens' mass. :func:`pin_window` is the one place that pins sinks
and a recent window.

Wrappers (:class:`Protect` here, CAOTE in :mod:`speculant.kv.caote`) hold the wrapped policy in the field
``inner`` and forward the capability flags and the prefill hooks.

Prefill hooks (:meth:`ScorePolicy.bind_draft`, :meth:`~ScorePolicy.prefill_passes`,
:meth:`~ScorePolicy.prefill_observers`) let a policy ask for a draft model, a second prefill pass or extra
observer queries (SnapKV's two passes, SpecKV's provisional answer) without the cache or the engine testing its
type.

A policy only scores: it knows nothing of the budgeted cache. :class:`speculant.kv.budget.Eviction` pairs a
policy with one (what the engine evicts with), and :func:`speculant.kv.registry.resolve_eviction` builds that
pair from a name or a policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "H2O",
    "TOVA",
    "KeyDiff",
    "KeyNorm",
    "MassPolicy",
    "Protect",
    "RandomScore",
    "ScoreContext",
    "ScorePolicy",
    "SnapKV",
    "Streaming",
    "WrapperPolicy",
    "pin_window",
]


@dataclass
class ScoreContext:
    """What a policy may read besides keys and values, for one layer.

    positions:   ``[B, H_kv, T]`` original position of every cached token (never renumbered).
    accumulated: ``[B, H_kv, T]`` attention each token received from all queries observed so far (H2O), or None.
    attn:        ``[B, H_q, Q, T]`` attention probabilities of the latest ``Q`` queries (causal), or None.
    layer:       layer index (seeds :class:`RandomScore` per layer).
    budget:      the number of tokens per layer the eviction keeps (:func:`speculant.kv.budget.evict` sets it;
                 policies that split the budget, like H2O's recent window, read it), or None.
    """

    positions: torch.Tensor
    accumulated: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    layer: int = 0
    budget: int | None = None

    def per_kv_head(self, x: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """``[B, H_q, ...] -> [B, H_kv, ...]``: mean over the query heads sharing a KV head (GQA groups)."""
        b, hq = x.shape[:2]
        return x.reshape(b, kv_heads, hq // kv_heads, *x.shape[2:]).mean(2)

    def require_attn(self, who: str) -> torch.Tensor:
        if self.attn is None:
            raise ValueError(f"policy {who} needs attention probabilities: pass the queries (kv.QueryCapture)")
        return self.attn


class ScorePolicy:
    """Base of all policies. Subclasses are dataclasses implementing :meth:`score`."""

    needs_attention: bool = False
    queries: int = 0  # how many latest queries' attention the policy reads (0 = all of the latest forward)
    mass_base: bool = False  # the base score (parts) is an attention mass: non-negative, a token's share of attention

    @property
    def name(self) -> str:
        return type(self).__name__.lower()

    def score(self, keys: torch.Tensor, values: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        """``keys [B, H_kv, T, D]`` (after RoPE), ``values [B, H_kv, T, Dv]`` -> scores ``[B, H_kv, T]``."""
        raise NotImplementedError

    def parts(self, keys: torch.Tensor, values: torch.Tensor, ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base [B, H_kv, T] float, pinned [B, H_kv, T] bool)`` with ``score == base.masked_fill(pinned, inf)``.

        This default derives them from :meth:`score` (pinned = scored ``+inf``, whose base is then unknown and
        set to 0); :class:`MassPolicy` and :class:`Protect` return the real base of their pinned tokens."""
        s = self.score(keys, values, ctx).float()
        pinned = s == math.inf
        return s.masked_fill(pinned, 0.0), pinned

    # ---- prefill hooks: what block-wise prefill and the engine ask of a policy, instead of testing its type

    def bind_draft(self, model: torch.nn.Module | None) -> None:
        """Called before prefill with the drafter's own model (``Drafter.model``; None without one). A policy that
        drafts (SpecKV) keeps it unless it has a draft already, and raises a one-line ValueError when it has
        none; the default needs no draft and ignores it."""

    def prefill_passes(self) -> int:
        """How many block-wise passes prefill makes over a prompt longer than the budget: 1, or 2 for a policy
        whose first pass collects the end of the prompt's queries to score every earlier block in the second
        (SnapKV ``passes=2``; :func:`speculant.kv.budget.prefill_blockwise`)."""
        return 1

    def prefill_observers(self, model: torch.nn.Module, cache, prefix: torch.Tensor, following: Sequence[int],
                          last: bool, queries_out: dict[int, torch.Tensor] | None = None
                          ) -> dict[int, torch.Tensor] | None:
        """Attention ``[B, H_q, n, T]`` per layer of extra *observer* queries over ``cache`` (which holds the
        prompt read so far, ``prefix [P]``), used to score the block just prefilled instead of its own queries;
        None (the default) scores with the block's own. ``last``: the prompt's last block (``following`` are the
        tokens known to come after it). ``queries_out`` receives the observers' queries ``[B, H_q, n, D]`` per
        layer (a two-pass prefill adds them to the end-of-prompt window). SpecKV: its draft's provisional
        answer. The cache must be left as it was."""
        return None

    @staticmethod
    def select(scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Slots to keep: the ``budget`` highest scores per (batch, head), ascending slot order ``[B, H_kv, N]``.

        Ties are deterministic: a stable sort keeps the earlier slot. NaN scores count as lowest.
        """
        scores = torch.nan_to_num(scores.float(), nan=-math.inf)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :budget]
        return order.sort(dim=-1).values


class MassPolicy(ScorePolicy):
    """A policy defined by a base score (:meth:`mass`) and the tokens it always keeps (:meth:`pinned`)."""

    mass_base = True

    def mass(self, keys: torch.Tensor, values: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        """``[B, H_kv, T]`` finite base score (the attention mass for H2O, TOVA, SnapKV)."""
        raise NotImplementedError

    def pinned(self, ctx: ScoreContext) -> torch.Tensor:
        """``[B, H_kv, T]`` bool: tokens always kept (default: none)."""
        return torch.zeros_like(ctx.positions, dtype=torch.bool)

    def parts(self, keys, values, ctx):
        return self.mass(keys, values, ctx).float(), self.pinned(ctx)

    def score(self, keys, values, ctx):
        base, pinned = self.parts(keys, values, ctx)
        return base.masked_fill(pinned, math.inf)


def pin_window(positions: torch.Tensor, sinks: int = 0, recent: int = 0) -> torch.Tensor:
    """``positions [B, H_kv, T]`` -> bool ``[B, H_kv, T]``: the first ``sinks`` original positions and the ``recent``
    latest cached tokens (slots are in position order, so the most recent are the last slots)."""
    pinned = positions < sinks
    if recent > 0:
        pinned[..., -recent:] = True
    return pinned


def _broadcast_heads(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, H_kv, T]`` shaped like ``like [B, H_kv, T, D]``."""
    return x[:, None, :].expand(like.shape[0], like.shape[1], x.shape[-1])


@dataclass
class KeyDiff(ScorePolicy):
    """KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"): keep the most distinct keys.

    Per KV head, anchor ``mu = mean_i k_i/|k_i|`` (or the mean of raw keys with ``raw_mean``), score
    ``-cos(k_i, mu)``. Needs no attention weights, so the model keeps SDPA.
    """

    raw_mean: bool = False

    def score(self, keys, values, ctx):
        unit = F.normalize(keys.float(), dim=-1)  # [B, H, T, D]
        anchor = (keys.float() if self.raw_mean else unit).mean(dim=2, keepdim=True)  # [B, H, 1, D]
        return -(unit * F.normalize(anchor, dim=-1)).sum(-1)  # [B, H, T]


@dataclass
class Streaming(ScorePolicy):
    """StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"): keep the first
    ``sinks`` tokens (attention sinks) and the most recent ones."""

    sinks: int = 4

    def score(self, keys, values, ctx):
        pos = ctx.positions.float()  # later = higher
        return pos.masked_fill(pin_window(ctx.positions, self.sinks), math.inf)


@dataclass
class KeyNorm(ScorePolicy):
    """Key-norm eviction (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression"): keys with a LOW L2 norm tend to receive high attention, so low-norm keys are kept
    (score = -|k|)."""

    def score(self, keys, values, ctx):
        return -keys.float().norm(dim=-1)


@dataclass
class RandomScore(ScorePolicy):
    """Random eviction (a baseline): i.i.d. uniform scores from a generator seeded by ``seed`` and the layer."""

    seed: int = 0

    @property
    def name(self) -> str:
        return "random"

    def score(self, keys, values, ctx):
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + ctx.layer)
        return torch.rand(keys.shape[:3], generator=gen).to(keys.device)


@dataclass
class H2O(MassPolicy):
    """H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"): the budget is split between the most recent tokens
    and the heavy hitters, the older tokens with the largest attention accumulated over all queries so far (per
    KV head, mean over its query heads).

    The recent window is ``int(recent_fraction * budget)`` tokens (``ctx.budget``); the default 0.5 is the
    paper's equal split (its experiments keep e.g. 10% heavy hitters + 10% recent tokens for a 20% budget).
    A fresh token has had few queries to accumulate attention from, so without the window it would be evicted
    almost at once. ``recent_fraction=0`` (registry name ``h2o-acc``) ranks by accumulated attention alone.
    """

    needs_attention = True
    queries: int = 0
    recent_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.recent_fraction <= 1:
            raise ValueError(f"h2o recent_fraction must be in [0, 1], got {self.recent_fraction}")

    def mass(self, keys, values, ctx):
        if ctx.accumulated is None:
            raise ValueError("h2o needs accumulated attention: pass the queries (kv.QueryCapture)")
        return ctx.accumulated.float()

    def recent(self, budget: int | None) -> int:
        """Tokens of the recent window for a budget."""
        if self.recent_fraction == 0:
            return 0
        if budget is None:
            raise ValueError("h2o's recent window is a fraction of the budget: ScoreContext.budget is required")
        return int(self.recent_fraction * budget)

    def pinned(self, ctx):
        return pin_window(ctx.positions, recent=self.recent(ctx.budget))


@dataclass
class TOVA(MassPolicy):
    """TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"): keep the tokens the last query attends to
    most, averaged over all heads of the layer (so every KV head keeps the same tokens)."""

    needs_attention = True
    queries: int = 1

    def mass(self, keys, values, ctx):
        attn = ctx.require_attn("tova")  # [B, H_q, Q, T]
        return _broadcast_heads(attn[:, :, -1].float().mean(1), keys)


@dataclass
class SnapKV(MassPolicy):
    """SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): attention of the
    last ``window`` queries, summed, max-pooled over ``kernel`` neighbouring tokens (per KV head); the window's
    own tokens are always kept.

    SnapKV scores the prompt with its *end* (the question) in view. Under a strict budget, block-wise prefill
    (:func:`speculant.kv.budget.prefill_blockwise`) evicts from the blocks before the last with each block's own
    last queries, before the question has been read. ``passes=2`` prefills the prompt twice within the same
    budget: the first pass ends with the observation window's queries (post-RoPE, per layer), and the second pass
    scores every block before the last with their attention over the block's cache (they come from later
    positions, so they see every cached key): what the paper's end-of-prompt selection would see, at the peak
    memory of one budgeted cache and the cost of a second prefill."""

    needs_attention = True
    window: int = 16
    kernel: int = 5
    passes: int = 1

    def __post_init__(self) -> None:
        if self.passes not in (1, 2):
            raise ValueError(f"{self.name} passes must be 1 or 2, got {self.passes}")

    @property
    def queries(self) -> int:  # type: ignore[override]
        return self.window

    def prefill_passes(self) -> int:
        return self.passes

    def mass(self, keys, values, ctx):
        attn = ctx.require_attn("snapkv")  # [B, H_q, Q, T]
        votes = ctx.per_kv_head(attn.float().sum(2), keys.shape[1])  # [B, H_kv, T]
        b, h, t = votes.shape
        pooled = F.max_pool1d(votes.reshape(b * h, 1, t), self.kernel, stride=1, padding=self.kernel // 2)
        return pooled.reshape(b, h, -1)[..., :t]

    def pinned(self, ctx):
        return pin_window(ctx.positions, recent=ctx.require_attn("snapkv").shape[2])  # the observation window


@dataclass
class WrapperPolicy(ScorePolicy):
    """A policy built on another one, held in ``inner``: it needs what the inner policy needs, and its prefill
    hooks are the inner policy's."""

    inner: ScorePolicy

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        return self.inner.needs_attention

    @property
    def mass_base(self) -> bool:  # type: ignore[override]
        return self.inner.mass_base

    @property
    def queries(self) -> int:  # type: ignore[override]
        return self.inner.queries

    # the prefill hooks are the inner policy's (caote:speckv drafts, protect:snapkv:passes=2 prefills twice)
    def bind_draft(self, model):
        self.inner.bind_draft(model)

    def prefill_passes(self):
        return self.inner.prefill_passes()

    def prefill_observers(self, model, cache, prefix, following, last, queries_out=None):
        return self.inner.prefill_observers(model, cache, prefix, following, last, queries_out)


@dataclass
class Protect(WrapperPolicy):
    """Wrapper: always keep the first ``sinks`` positions and the ``recent`` latest cached tokens, rank the rest
    with ``inner`` (the sink/recent protection of StreamingLLM and H2O on top of any score)."""

    sinks: int = 4
    recent: int = 16

    @property
    def name(self) -> str:
        return f"protect:{self.inner.name}"

    def parts(self, keys, values, ctx):
        base, pinned = self.inner.parts(keys, values, ctx)
        return base, pinned | pin_window(ctx.positions, self.sinks, self.recent)

    def score(self, keys, values, ctx):
        base, pinned = self.parts(keys, values, ctx)
        return base.masked_fill(pinned, math.inf)
