"""The KV-cache seam over transformers' ``Cache``: length, crop, keep(indices), bytes.

:class:`SpecCache` is a real transformers ``DynamicCache`` whose layers keep keys and values in a preallocated
buffer ``[B, H_kv, capacity, D]`` and expose views of its first ``length`` slots. Appending writes the new slots
in place (transformers' ``DynamicLayer`` concatenates, copying the whole cache every step); rolling back a
rejected draft moves a pointer; keeping the accepted path of a tree moves only the few kept slots.

:func:`cache_kwarg` names a cache the way a model's ``forward`` takes it (``cache`` from transformers 5.24 on,
``past_key_values`` before), and :func:`output_cache` reads it back from a model output or forward kwargs.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

__all__ = ["GrowingLayer", "SpecCache", "cache_kwarg", "output_cache"]


@functools.cache
def _cache_name(forward_owner: type) -> str:
    """The keyword ``forward_owner.forward`` takes the KV cache under."""
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def cache_kwarg(model: torch.nn.Module, cache: Cache | None) -> dict[str, Any]:
    """``{name: cache}`` for ``model(**..., **cache_kwarg(model, cache))``: transformers 5.24 renamed the forward
    argument ``past_key_values`` to ``cache`` (the old name still works there, with a deprecation warning)."""
    return {_cache_name(type(model)): cache}


def output_cache(found: dict[str, Any]) -> Cache | None:
    """The cache in a model output (a ``ModelOutput`` is a dict of its set fields) or in a forward's kwargs, under
    either name; looked up by key so that the old name's deprecation warning never fires."""
    for name in ("cache", "past_key_values"):
        if name in found.keys():
            return found[name]
    return None


class GrowingLayer(DynamicLayer):
    """One layer's keys/values in a buffer that grows geometrically; ``keys``/``values`` are views of its prefix."""

    def __init__(self, capacity: int = 256) -> None:
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self._k: torch.Tensor | None = None  # [B, H_kv, capacity, D_k]
        self._v: torch.Tensor | None = None  # [B, H_kv, capacity, D_v]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        self._k = key_states.new_empty((b, h, self.capacity, dk))
        self._v = value_states.new_empty((b, value_states.shape[1], self.capacity, value_states.shape[-1]))
        self.length = 0
        self.is_initialized = True
        self._refresh()

    def _refresh(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _reserve(self, needed: int) -> None:
        if needed <= self._k.shape[2]:
            return
        cap = max(needed, 2 * self._k.shape[2])
        k = self._k.new_empty((*self._k.shape[:2], cap, self._k.shape[3]))
        v = self._v.new_empty((*self._v.shape[:2], cap, self._v.shape[3]))
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v, self.capacity = k, v, cap

    appends_in_place = True
    """:meth:`extend` may stand for :meth:`update` (a subclass that tracks per-token state in ``update`` says False)."""

    def extend(self, t: int, heads: int, dim_k: int, dim_v: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append ``t`` slots for the caller to fill: ``(k, v, start)``, the buffers ``[B, H_kv, capacity, D]`` and
        the first new slot (slots ``start .. start + t - 1`` are the new ones, already counted in the length)."""
        if not self.is_initialized:
            self.lazy_initialization(torch.empty((1, heads, 0, dim_k), dtype=dtype, device=device),
                                     torch.empty((1, heads, 0, dim_v), dtype=dtype, device=device))
        start = self.length
        self._reserve(start + t)
        self.length = start + t
        self._refresh()
        return self._k, self._v, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` ``[B, H_kv, T, D]``; return all cached keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        self._reserve(end)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` slots (transformers 5 convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)
            self._refresh()

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep slots ``[0, start)`` and then the given slot indices (ascending, all >= start), compacted in place."""
        if not self.is_initialized:
            return
        n = slots.numel()
        # index-select first (a small copy), then write back: safe although source and target ranges overlap
        self._k[:, :, start : start + n] = self._k.index_select(2, slots)
        self._v[:, :, start : start + n] = self._v.index_select(2, slots)
        self.length = start + n
        self._refresh()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._refresh()

    def nbytes(self) -> int:
        """Bytes of the cached (live) keys and values."""
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class SpecCache(DynamicCache):
    """A transformers cache for speculative decoding: in-place append, O(1) rollback, in-place path compaction.

    Pass it as ``past_key_values``; it works wherever a ``DynamicCache`` does (all layers are full attention).
    """

    def __init__(self, num_layers: int, capacity: int = 256) -> None:
        Cache.__init__(self, layers=[GrowingLayer(capacity) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def crop(self, max_length: int) -> None:
        """Crop to ``max_length`` slots (negative: remove that many from the end)."""
        remove = max_length if max_length < 0 else max_length - self.length
        if remove > 0:
            raise ValueError(f"cannot crop a cache of {self.length} slots to {max_length}")
        for layer in self.layers:
            layer.crop(remove)

    def keep(self, start: int, slots: list[int]) -> None:
        """Keep the first ``start`` slots plus ``slots`` (ascending absolute indices >= start), drop the rest.

        When ``slots`` is the contiguous run ``start, start+1, ...`` this is a crop and moves no data.
        """
        n = len(slots)
        if n == 0 or slots[-1] - slots[0] == n - 1 and slots[0] == start:
            self.crop(start + n)
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.layers[0].device)
        for layer in self.layers:
            layer.keep(start, index)

    def nbytes(self) -> int:
        """Bytes held by live keys and values over all layers."""
        return sum(layer.nbytes() for layer in self.layers)
