"""Training a ConFu drafter (Qin, Goel, Gagrani et al. 2026): EAGLE-3's objective plus the target's contemplation.

The drafter is an EAGLE-3 drafter (:mod:`speculant.train.drafter.feature_train`: the target's tapped and final
states, training-time test over ``unroll`` passes, the distillation loss only) whose every row also reads a future
vector ``f`` (:mod:`speculant.drafters.confu`, :mod:`speculant.models.confu_contemplation`). What is learned: the drafter,
the soft prompt (key/value entries in each of the frozen target's layers), the contemplate embeddings and their
router, and the future input map. Gradients reach the soft prompt and the embeddings through the frozen target's
forward of the contemplate tokens.

Per sample (sequence ``s_0 .. s_{n-1}`` of the batch, after the prompt's earlier tokens ``prefix``):

1. the target reads ``prefix + sequence`` once without gradients (its keys and values, and its final states);
2. *anchor-token sampling*: an anchor at the prompt's last token (the first root at inference), then one at
   random in each window of ``window`` rows after it (in evaluation, a fixed draw), so an answer of ``n`` rows
   carries about ``n / window`` contemplate tokens, not ``n``; the prompt's rows read none (zeros), as at inference,
   where they are fed before the first verification;
3. the contemplate token of anchor ``a`` (embedding routed by the target's state at ``a - 1``, position
   ``a + 1``) attends to the sequence up to ``a``, to the soft prompt and to itself, exactly as in the
   verification forward (:class:`speculant.core.types.Probes`); its final state is ``f_a``;
4. *future-prediction replication*: the row of position ``t`` reads ``f_a`` of the latest anchor ``a <= t`` with
   ``t - a < window`` (zeros where there is none, as rows before the first contemplation do at inference); the
   unrolled pass ``d`` row that stands for a draft token whose chain started after row ``t`` reads that row's.

The loss is the distillation loss of every pass (KL-type by default: FKL / TVD / TVD++,
:mod:`speculant.train.losses`), as the paper trains with a KL loss only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...core.cache import cache_kwarg
from ...models.confu_contemplation import contemplation_of
from .feature_train import FeatureBatch, FeatureObjective

__all__ = ["ConFuBatch", "ConFuObjective", "contemplate_states"]


@dataclass
class ConFuBatch(FeatureBatch):
    prefixes: list[torch.Tensor] = field(default_factory=list)  # [s_b] per row: the prompt's tokens before column 0
    contexts: list[int] = field(default_factory=list)  # per row: prompt tokens in the row (its last: column c - 1)


def contemplate_states(target: torch.nn.Module, contemplation, ids: torch.Tensor, anchors: torch.Tensor,
                       grad: bool = True) -> torch.Tensor:
    """The future vectors ``f [K, H]`` of contemplate tokens at ``anchors [K]`` (indices into ``ids [L]``, one
    sequence): the frozen target reads ``ids`` (no gradients), then the contemplate tokens read it up to their
    anchor and the soft prompt (gradients to ``contemplation`` when ``grad``)."""
    from transformers import DynamicCache

    base = target.base_model
    length = ids.shape[0]
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        states = base(input_ids=ids[None], **cache_kwarg(base, cache), use_cache=True).last_hidden_state[0]  # [L, H]
    c = contemplation
    with torch.set_grad_enabled(grad):
        joined = DynamicCache(config=target.config)  # [sequence ; soft prompt], then the contemplate rows
        for i, layer in enumerate(cache.layers):
            keys = torch.cat([layer.keys, c.soft_keys[i][None].to(layer.keys.dtype)], 2)  # [1, H_kv, L + S, D]
            values = torch.cat([layer.values, c.soft_values[i][None].to(layer.values.dtype)], 2)
            joined.update(keys, values, i)
        before = anchors - 1  # routed by the state of the token before the anchor (the last known at inference)
        h = torch.where((before >= 0)[:, None], states[before.clamp_min(0)], states.new_zeros(()))  # [K, H]
        embeds = c.token_embeds(h if c.router is not None else None, anchors.shape[0])  # [K, H]
        k, soft = anchors.shape[0], c.soft_keys.shape[2]
        allowed = torch.cat([
            torch.arange(length)[None, :] <= anchors[:, None],  # the sequence up to the anchor
            torch.ones((k, soft), dtype=torch.bool),  # the soft prompt
            torch.eye(k, dtype=torch.bool),  # itself, not the other contemplate tokens
        ], 1)
        dtype = states.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        out = base(inputs_embeds=embeds[None].to(dtype), attention_mask=mask[None, None].to(ids.device),
                   position_ids=(anchors + 1)[None].to(ids.device), **cache_kwarg(base, joined), use_cache=True)
    return out.last_hidden_state[0]  # [K, H]


@dataclass
class ConFuObjective(FeatureObjective):
    """ConFu's objective (module docstring): ``target`` is the frozen target (float32), ``window`` the rows one
    contemplate token serves (future-prediction replication; also the spacing of the sampled anchors)."""

    target: torch.nn.Module | None = None
    window: int = 8

    def __post_init__(self) -> None:
        if self.target is None:
            raise ValueError("ConFuObjective needs the target: its contemplate tokens run through it")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        for p in self.target.parameters():  # frozen: gradients reach the soft prompt through it, not its weights
            p.requires_grad_(False)
        self._futures: torch.Tensor | None = None  # [B, T, H] during predict

    def batch(self, samples, kept_index: torch.Tensor, pad: int) -> ConFuBatch:
        base = super().batch(samples, kept_index, pad)
        fields = {k: getattr(base, k) for k in FeatureBatch.__dataclass_fields__}
        prefixes = [torch.from_numpy(s.prefix.astype("int64")) if getattr(s, "prefix", None) is not None
                    else torch.zeros(0, dtype=torch.long) for s in samples]
        return ConFuBatch(**fields, prefixes=prefixes, contexts=[len(s.context) for s in samples])

    def anchors(self, n: int, training: bool, row: int = 0, first: int = 0) -> torch.Tensor:
        """Anchors among ``n`` rows, ``[K]`` ascending: ``first`` (the prompt's last token: the first root at
        inference), then one per window of ``window`` rows after it (random in training; a fixed draw per ``row``
        otherwise)."""
        g = None if training else torch.Generator().manual_seed(1234 + row)
        starts = torch.arange(first + 1, n, self.window)
        widths = (n - starts).clamp(max=self.window)  # the last window may be shorter
        picks = starts + (torch.rand(starts.shape[0], generator=g) * widths).long()
        return torch.cat([torch.tensor([first]), picks]) if first < n else picks

    def futures(self, draft, batch: ConFuBatch, training: bool) -> torch.Tensor:
        """``[B, T, H]``: the future vector each real row reads (zeros where no anchor serves it)."""
        c = contemplation_of(draft)
        b, t = batch.input_ids.shape
        h = draft.config.hidden_size
        out = []
        for r in range(b):
            n = int(batch.mask[r].sum())
            prefix = batch.prefixes[r] if batch.prefixes else torch.zeros(0, dtype=torch.long)
            ids = torch.cat([prefix, batch.input_ids[r, :n]]).to(self.target.device)  # [s + n]
            first = batch.contexts[r] - 1 if batch.contexts else 0  # the prompt's rows read no future, as at inference
            anchors = self.anchors(n, training, r, first)  # batch columns
            s = prefix.shape[0]
            f = contemplate_states(self.target, c, ids, anchors + s, grad=training)  # [K, H]
            # row t reads the latest anchor a <= t with t - a < window: anchors are one per window, so a is in
            # t's window or the one before it
            serving = torch.full((t,), -1, dtype=torch.long)
            for j, a in enumerate(anchors.tolist()):
                serving[a: min(a + self.window, t)] = j
            out.append(torch.cat([f.new_zeros((1, h)), f])[serving + 1])  # [T, H]
        return torch.stack(out)

    def _extra(self, draft, depth: int, first: int, rows: int) -> torch.Tensor | None:
        """Pass ``depth``'s rows ``first .. first + rows - 1`` read the future vector of the row their chain
        started after (``p - depth``; zeros before column 0)."""
        f = self._futures
        if f is None:
            return None
        lo = first - depth
        if lo < 0:
            f = torch.cat([f.new_zeros((f.shape[0], -lo, f.shape[2])), f], 1)
            lo = 0
        return contemplation_of(draft).future_input(f[:, lo: lo + rows])  # [B, R, H]

    def predict(self, draft, batch: ConFuBatch, head: torch.Tensor, training: bool):
        self._futures = self.futures(draft, batch, training)
        try:
            return super().predict(draft, batch, head, training)
        finally:
            self._futures = None
