"""A KV cache holding at most ``N`` tokens per layer, block-wise prefill, and eviction as the engine drives it.

:class:`BudgetCache` is a :class:`speculant.core.cache.SpecCache` whose layers also store, per cached token, its
ORIGINAL position (``[B, H_kv, T]``; never renumbered) and the attention it has accumulated (for H2O). Eviction
really compacts the keys/values (per KV head: heads may keep different tokens) into the front of the buffer, so
the live tensors shrink; the buffer itself never grows past its initial capacity when that is ``N + B``. After
an eviction the slot index is no longer the position, so every forward must pass explicit position ids:
:meth:`BudgetCache.position_ids` gives them. transformers builds the causal mask from slot counts
(``get_seq_length``), which stays correct because every cached token precedes every new one.

Block-wise prefill (KeyDiff, Park et al. 2025): feed the prompt in blocks of ``B``; each block attends to
``[cache <= N ; block]``, then the cache is evicted back to ``N``: peak KV is ``N + B`` tokens per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from ..core.cache import GrowingLayer, SpecCache, cache_kwarg
from .attention import QueryCapture, attention_probs
from .policies import ScoreContext, ScorePolicy

__all__ = ["STEP_ROOM", "BudgetCache", "BudgetLayer", "BudgetedKV", "Eviction", "evict", "fraction_budget", "observe",
           "observer_attention", "prefill_blockwise"]

STEP_ROOM = 64
"""Slots a budgeted cache keeps free beyond ``budget + block`` for one verification step's inputs (a draft tree of
up to this many nodes and its root); while decoding, verified tokens may use the part of the block beyond it."""


def fraction_budget(fraction: float, tokens: int) -> int:
    """Tokens per layer of a budget given as a ``fraction`` of a ``tokens``-long prompt (at least 1)."""
    return max(1, int(fraction * tokens))


class BudgetLayer(GrowingLayer):
    """A :class:`GrowingLayer` that also keeps original positions and accumulated attention per token."""

    appends_in_place = False  # update() records each token's position

    def __init__(self, capacity: int = 256) -> None:
        super().__init__(capacity)
        self.next_position = 0  # original position of the next appended token
        self.peak_nbytes = 0  # largest live keys+values bytes seen
        self._pos: torch.Tensor | None = None  # [B, H_kv, capacity] long
        self._acc: torch.Tensor | None = None  # [B, H_kv, capacity] float32

    def lazy_initialization(self, key_states, value_states) -> None:
        b, h = key_states.shape[:2]
        self._pos = torch.zeros((b, h, self.capacity), dtype=torch.long, device=key_states.device)
        self._acc = torch.zeros((b, h, self.capacity), dtype=torch.float32, device=key_states.device)
        super().lazy_initialization(key_states, value_states)

    def _refresh(self) -> None:
        super()._refresh()
        self.positions = self._pos[:, :, : self.length]  # [B, H_kv, T]
        self.accumulated = self._acc[:, :, : self.length]  # [B, H_kv, T]

    def _reserve(self, needed: int) -> None:
        super()._reserve(needed)
        cap = self._k.shape[2]
        if self._pos.shape[2] < cap:
            pos = self._pos.new_zeros((*self._pos.shape[:2], cap))
            acc = self._acc.new_zeros((*self._acc.shape[:2], cap))
            pos[..., : self.length] = self._pos[..., : self.length]
            acc[..., : self.length] = self._acc[..., : self.length]
            self._pos, self._acc = pos, acc

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self.length, key_states.shape[2]
        self._reserve(start + n)
        # provisional positions: exact for a chain; a tree's kept path is renumbered by keep()
        new_pos = torch.arange(self.next_position, self.next_position + n, device=self._pos.device)
        self._pos[..., start : start + n] = new_pos
        self._acc[..., start : start + n] = 0.0
        self.next_position += n
        out = super().update(key_states, value_states, *args, **kwargs)
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes())
        return out

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last slots; they must not have been evicted among (only appended, unverified tokens are)."""
        before = self.length
        super().crop(tokens_to_remove)
        self.next_position -= before - self.length

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep slots ``[0, start)`` then ``slots``: the engine's root + accepted tree path, which are consecutive
        tokens, so their positions are renumbered from the first appended slot's position."""
        if not self.is_initialized:
            return
        base = int(self._pos[0, 0, start]) if start < self.length else self.next_position
        self._acc[..., start : start + slots.numel()] = self._acc.index_select(2, slots)
        super().keep(start, slots)
        n = slots.numel()
        self._pos[..., start : start + n] = torch.arange(base, base + n, device=self._pos.device)
        self.next_position = base + n
        self._refresh()

    def reset(self) -> None:
        super().reset()
        self.next_position = 0

    def compact(self, index: torch.Tensor) -> None:
        """Keep per (batch, head) the slots ``index [B, H_kv, N]`` (ascending), moved to the front of the buffer."""
        n = index.shape[-1]
        idx = index.to(self._k.device)
        # gather copies first, so writing back into the overlapping front of the buffer is safe
        self._k[:, :, :n] = self.keys.gather(2, idx[..., None].expand(-1, -1, -1, self._k.shape[-1]))
        self._v[:, :, :n] = self.values.gather(2, idx[..., None].expand(-1, -1, -1, self._v.shape[-1]))
        self._pos[..., :n] = self.positions.gather(2, idx)
        self._acc[..., :n] = self.accumulated.gather(2, idx)
        self.length = n
        self._refresh()


class BudgetCache(SpecCache):
    """A :class:`SpecCache` whose layers remember original positions; shrink it with :func:`evict`.

    Give it ``capacity = budget + block`` (plus the largest draft tree when decoding) so that its buffers never
    grow: then the allocated KV memory is bounded as well as the live one.
    """

    def __init__(self, num_layers: int, capacity: int = 256) -> None:
        super().__init__(num_layers, capacity)
        self.layers = [BudgetLayer(capacity) for _ in range(num_layers)]

    @property
    def next_position(self) -> int:
        """Original position of the next token to append (= number of tokens ever committed)."""
        return self.layers[0].next_position if self.layers else 0

    def position_ids(self, n: int, device=None) -> torch.Tensor:
        """``[1, n]`` position ids for the next ``n`` input tokens (a chain)."""
        start = self.next_position
        return torch.arange(start, start + n, device=device).unsqueeze(0)

    def positions(self, layer: int = 0) -> torch.Tensor:
        """``[B, H_kv, T]`` original positions of the tokens cached in ``layer``."""
        return self.layers[layer].positions

    @property
    def peak_nbytes(self) -> int:
        """Largest live KV bytes seen (sum of per-layer peaks; all layers have the same lengths)."""
        return sum(layer.peak_nbytes for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """Bytes of the key/value buffers (live or not)."""
        return sum(
            layer._k.numel() * layer._k.element_size() + layer._v.numel() * layer._v.element_size()
            for layer in self.layers
            if layer.is_initialized
        )


@torch.no_grad()
def observe(cache: BudgetCache, capture: QueryCapture) -> dict[int, torch.Tensor]:
    """Attention ``[B, H_q, Q, T]`` of the captured queries per layer; adds it to each layer's accumulated
    attention (mean over the query heads of a KV head, summed over queries). Call once per forward."""
    attn = {}
    for i, layer in enumerate(cache.layers):
        q = capture.queries.get(i)
        if q is None or not layer.is_initialized:
            continue
        a = attention_probs(q, layer.keys, capture.scaling(i))  # [B, H_q, Q, T]
        b, t = a.shape[0], a.shape[-1]
        layer.accumulated += a.sum(2).reshape(b, layer.keys.shape[1], -1, t).mean(2)
        attn[i] = a
    return attn


def observer_attention(cache: BudgetCache, observers: dict[int, torch.Tensor],
                       capture: QueryCapture) -> dict[int, torch.Tensor]:
    """Attention ``[B, H_q, Q, T]`` per layer of ``observers`` (queries ``[B, H_q, Q, D]`` from positions after
    every cached token: a first pass's end of prompt) over the ``T`` cached keys (no causal mask)."""
    return {i: attention_probs(observers[i], layer.keys, capture.scaling(i), causal=False)
            for i, layer in enumerate(cache.layers) if i in observers and layer.is_initialized}


@torch.no_grad()
def evict(
    cache: BudgetCache,
    policy: ScorePolicy,
    budget: int,
    protect_last: int = 0,
    attn: dict[int, torch.Tensor] | None = None,
) -> int:
    """Shrink every layer to its ``budget`` best-scored tokens; return the number of tokens evicted per head.

    ``protect_last`` latest slots (unverified or just committed tokens) are never evicted. ``attn`` is what
    :func:`observe` returned for the latest forward; it is required when ``policy.needs_attention``.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if protect_last > budget:
        raise ValueError(f"cannot protect {protect_last} tokens within a budget of {budget}")
    if policy.needs_attention and attn is None:
        raise ValueError(f"policy {policy.name} needs attention: capture queries (kv.QueryCapture) and observe()")
    evicted = 0
    for i, layer in enumerate(cache.layers):
        t = layer.length
        if t <= budget:
            continue
        ctx = ScoreContext(layer.positions, accumulated=layer.accumulated, attn=(attn or {}).get(i), layer=i,
                           budget=budget)
        scores = policy.score(layer.keys, layer.values, ctx).float()  # [B, H_kv, T]
        if scores.shape != layer.positions.shape:
            raise ValueError(f"{policy.name} scored {tuple(scores.shape)}, expected {tuple(layer.positions.shape)}")
        if protect_last:
            scores = scores.clone()
            scores[..., t - protect_last :] = math.inf
        layer.compact(policy.select(scores, budget))
        evicted = t - budget
    return evicted


@torch.no_grad()
def prefill_blockwise(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: BudgetCache,
    policy: ScorePolicy,
    budget: int,
    block: int = 128,
    all_logits: bool = False,
    following: Sequence[int] = (),
    forward=None,
    hidden_out: list | None = None,
) -> torch.Tensor:
    """Feed ``input_ids [1, T]`` block by block, evicting to ``budget`` after each; return the last logits
    ``[1, V]`` (``all_logits``: every position's, ``[1, T, V]``).

    Each block of ``block`` tokens attends to the (≤ budget) cache plus itself, with position ids equal to the
    original positions; peak KV is ``budget + block`` tokens per layer. The cache may already hold tokens:
    feeding continues from :attr:`BudgetCache.next_position` (``block=1`` is token-by-token decoding).

    The policy's prefill hooks shape it (:class:`~speculant.kv.policies.ScorePolicy`): a block to be evicted is
    scored by the attention of the policy's observer queries where :meth:`~ScorePolicy.prefill_observers` gives
    some (SpecKV: the draft's provisional continuation of the last block, or of every block with ``every_block``;
    ``following`` are tokens known to come after ``input_ids``, the engine's root, which start it). When
    :meth:`~ScorePolicy.prefill_passes` is 2 (SnapKV or SpecKV with ``passes=2``, possibly inside wrappers) and the
    cache is empty and the prompt longer than the budget, a first pass over a scratch cache of the same size ends
    with the observation queries (the last block's window, then the policy's observers'), and the second pass
    scores every block but the last by their attention (:func:`observer_attention`); the scratch cache is released
    before the second pass fills ``cache``, so the peak stays one cache.
    ``forward``: a :class:`speculant.core.target_forward.TargetForward` to run the blocks through (the engine passes its
    own, the lean forward where it applies); None calls the model's own forward. ``hidden_out`` (with ``forward``): a
    list that receives each block's final-normed hidden states ``[1, T_block, H]``.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if hidden_out is not None and forward is None:
        raise ValueError("hidden_out needs forward (a speculant.core.target_forward.TargetForward)")
    observers = None
    if policy.prefill_passes() == 2 and cache.length == 0 and input_ids.shape[1] > budget:
        observers = {}
        scratch = BudgetCache(len(cache.layers), capacity=cache.layers[0].capacity)
        _prefill_pass(model, input_ids, scratch, policy, budget, block, False, following, forward, None,
                      queries_out=observers)
        del scratch
    return _prefill_pass(model, input_ids, cache, policy, budget, block, all_logits, following, forward,
                         hidden_out, observers=observers)


def _prefill_pass(model, input_ids, cache, policy, budget, block, all_logits, following, forward, hidden_out,
                  observers: dict[int, torch.Tensor] | None = None,
                  queries_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """One block-wise pass of :func:`prefill_blockwise`. ``observers``: queries that score every block but the
    last (a second pass); ``queries_out`` receives, at the last block, the queries of its observation window
    (followed by those of the policy's observers, :meth:`ScorePolicy.prefill_observers`), ``[B, H_q, Q, D]`` per
    layer (a first pass)."""
    keep = 0 if all_logits else 1
    logits = []
    total = input_ids.shape[1]
    for s in range(0, total, block):
        chunk = input_ids[:, s : s + block]
        pos = cache.position_ids(chunk.shape[1], device=chunk.device)
        # a two-pass prefill reads queries whatever the policy scores with (the first collects, the second observes)
        two_pass = observers is not None or queries_out is not None
        cap = QueryCapture(model, last=policy.queries) if policy.needs_attention or two_pass else None
        if forward is not None:
            out = forward(cache, input_ids=chunk, positions=pos, capture=cap, logits_to_keep=keep,
                          hidden_out=hidden_out)  # [1, T | 1, V]
        else:
            with cap if cap is not None else nullcontext():
                out = _block_forward(model, chunk, cache, pos, keep).logits
        attn = observe(cache, cap) if cap is not None else None
        last = s + block >= total
        look: dict[int, torch.Tensor] = {}
        if observers and not last:
            attn = observer_attention(cache, observers, cap)
        elif cache.length > budget:  # a policy's own observers (SpecKV's provisional answer) score this block
            prefix = input_ids[0, : s + chunk.shape[1]]  # [P] a view: most policies never read it
            attn = policy.prefill_observers(model, cache, prefix, following, last, queries_out=look) or attn
        if last and queries_out is not None:
            queries_out.update({i: torch.cat([q, look[i]], 2) if i in look else q for i, q in cap.queries.items()})
        evict(cache, policy, budget, attn=attn)
        logits.append(out if all_logits else out[:, -1])
    return torch.cat(logits, 1) if all_logits else logits[-1]


def _block_forward(model, chunk, cache, pos, keep):
    return model(input_ids=chunk, **cache_kwarg(model, cache), position_ids=pos, use_cache=True, logits_to_keep=keep)


class BudgetedKV:
    """One generation's budgeted target cache as the engine drives it (:class:`speculant.core.eviction.BudgetedKV`):
    a :class:`BudgetCache` of capacity ``budget + block + STEP_ROOM`` (prefill blocks and a draft tree of up to
    :data:`STEP_ROOM` nodes fit without growing), block-wise prefill, query capture for attention policies, and
    eviction while decoding.

    While decoding, verified tokens accumulate up to ``budget + block - STEP_ROOM`` tokens per layer and are then
    evicted back to ``budget`` in one go (with ``block <= STEP_ROOM``: after every step), instead of scoring every
    cached key and compacting the whole cache for each new token; the live cache, a step's inputs included, stays
    within ``budget + block`` tokens, the bound of the prefill. Attention policies still observe every step's queries (H2O's
    accumulated attention counts every token); TOVA and SnapKV score with the latest step's."""

    def __init__(self, policy: ScorePolicy, num_layers: int, budget: int, block: int) -> None:
        self.policy, self.budget, self.block = policy, budget, block
        self.slack = max(0, block - STEP_ROOM)  # verified tokens kept beyond the budget before evicting
        self.cache = BudgetCache(num_layers, capacity=budget + block + STEP_ROOM)

    @property
    def next_position(self) -> int:
        return self.cache.next_position

    @property
    def peak_nbytes(self) -> int:
        return self.cache.peak_nbytes

    def prefill(self, target, input_ids, following, forward, hidden_out) -> None:
        prefill_blockwise(target, input_ids, self.cache, self.policy, self.budget, self.block, following=following,
                          forward=forward, hidden_out=hidden_out)

    def capture(self, target) -> QueryCapture | None:
        return QueryCapture(target) if self.policy.needs_attention else None

    def after_step(self, capture: QueryCapture | None, rows: list[int]) -> None:
        attn = None
        if capture is not None:
            capture.keep_rows(rows)
            attn = observe(self.cache, capture)
        if self.cache.length > self.budget + self.slack:
            evict(self.cache, self.policy, self.budget, attn=attn)


class Eviction:
    """A score policy as the engine evicts with it (:class:`speculant.core.eviction.EvictionPolicy`): the policy
    scores the cached tokens, and every generation gets a fresh :class:`BudgetedKV` evicting with it.

    The policy itself never builds a cache; :func:`speculant.kv.registry.resolve_eviction` makes this pair from
    a policy name or object (``speculant.generate`` and :func:`speculant.load` call it), or wrap a policy
    directly to hand it to :func:`speculant.core.engine.generate`: ``kv_policy=Eviction(KeyDiff())``.
    """

    def __init__(self, policy: ScorePolicy) -> None:
        self.policy = policy

    def __repr__(self) -> str:
        return f"Eviction({self.policy!r})"

    def bind_draft(self, model: torch.nn.Module | None) -> None:
        """Hand the drafter's own model to the policy (SpecKV drafts with it; the others ignore it)."""
        self.policy.bind_draft(model)

    def budgeted(self, num_layers: int, budget: int, block: int) -> BudgetedKV:
        """A fresh budgeted cache of ``num_layers`` layers evicting with the policy (prefill blocks of ``block``)."""
        return BudgetedKV(self.policy, num_layers, budget, block)
