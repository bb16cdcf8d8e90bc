"""Prefix caching: the keys/values of every prompt prefix already computed, reused by later generations.

A chat, an agent or an editor sends its whole conversation (or file) again with every request. The keys and
values of a token depend only on the tokens before it (causal attention, positions by index), so a request whose
prompt starts with tokens some earlier generation already fed needs to compute only the tokens after that prefix.
:class:`PrefixCache` keeps them for any number of models (the target's and the draft model's caches alike), in
blocks of :attr:`PrefixCache.block` tokens found by a hash chain (as vLLM's automatic prefix caching does): a
block's key is its parent block and its own tokens, so a lookup walks the prompt block by block with one dict
access each and stops at the first block nobody computed. Blocks are whole: a prompt reuses its longest cached
prefix rounded down to a block (at most ``block - 1`` tokens are computed again).

Why blocks in a hash chain rather than a radix tree of tokens (SGLang's RadixAttention): a generation's cache here
is one contiguous buffer per layer (:class:`speculant.core.cache.SpecCache`, which the attention kernels read as
it is), so a reused prefix is *copied* into the new generation's cache either way, and a copy costs a few
microseconds per block (under 1% of computing those tokens on a CPU); at that price token-exact matching buys
little, and fixed blocks make the byte accounting and the eviction order simple. The copy is also what makes
sharing safe: a generation owns its cache, so evicting a block never touches a running generation, concurrent
requests sharing a system prompt each copy it, and a cancelled generation leaves only whole, consistent blocks.

What is stored: whole blocks of committed tokens, written by the owner of a cache as soon as they are complete
(the prompt after its prefill, then the answer as it is decoded), so a conversation's next turn finds the previous
answer too. What is evicted: the least recently used block, under a byte budget that the stored tensors never
exceed. A chain is touched from its last block back to its first, so a parent is always at least as recent as
its children and eviction takes leaves first (a block is never orphaned while its children stay).

Exactness: a reused key/value is the value that was computed for the same tokens at the same positions by the same
model. With speculant's quantized kernels a row's products do not depend on the other rows of its forward, and the
attention of a forward of at most 64 new tokens runs row by row: a prompt of that size computes the same bits with
or without reuse. A longer prefill's attention runs through torch's SDPA, and float weights through torch's dense
products, which may round a row differently in a forward of another size (as batching does); that can flip a
near-tie between two tokens, and nothing else.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .cache import SpecCache

__all__ = ["DEFAULT_BLOCK", "PrefixCache", "PrefixStats"]

DEFAULT_BLOCK = 16
"""Tokens per block (vLLM's default block size): at most this many minus one tokens of a cached prefix are
recomputed, and each block costs one dict entry and one copy per layer."""

_Key = tuple[int, tuple[int, ...]]  # (parent block's id, or the model's negative root id; the block's tokens)


@dataclass(eq=False)
class _Block:
    """One block's keys ``[L, H_kv, B, D_k]`` and values ``[L, H_kv, B, D_v]`` for one model."""

    id: int
    key: _Key
    keys: torch.Tensor  # [L, H_kv, B, D_k]
    values: torch.Tensor  # [L, H_kv, B, D_v]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class PrefixStats:
    """Counts since the cache was made: ``queried`` prompt tokens looked up, ``hit`` of them reused (the names of
    vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``), blocks ``stored`` and ``evicted``."""

    queried: int = 0
    hit: int = 0
    stored: int = 0
    evicted: int = 0
    per_model: dict[str, list[int]] = field(default_factory=dict)  # model label -> [queried, hit]


class PrefixCache:
    """Keys/values of token prefixes, per model, in blocks of ``block`` tokens, at most ``budget_bytes`` in all.

    ``restore(model, ids, cache)`` copies the longest cached prefix of ``ids`` into an empty cache and returns its
    length; ``store(model, ids, cache)`` keeps the whole blocks of ``ids`` that ``cache`` holds the keys/values of.
    Both are safe to call from several threads. ``budget_bytes`` 0 keeps nothing (every lookup misses)."""

    def __init__(self, budget_bytes: int, block: int = DEFAULT_BLOCK) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"the prefix cache's budget must be a number of bytes >= 0, got {budget_bytes!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"the prefix cache's block must be a positive number of tokens, got {block!r}")
        self.budget_bytes = budget_bytes
        self.block = block
        self.stats = PrefixStats()
        self._lock = threading.Lock()
        self._blocks: OrderedDict[_Key, _Block] = OrderedDict()  # least recently used first
        self._nbytes = 0
        self._peak = 0
        self._next_id = 0
        self._roots: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------------------------------------ reading

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held now."""
        return self._nbytes

    @property
    def peak_nbytes(self) -> int:
        """The most bytes ever held (never above :attr:`budget_bytes`)."""
        return self._peak

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def restore(self, model: torch.nn.Module, ids: Sequence[int], cache: SpecCache, count: bool = True) -> int:
        """Copy the keys/values of the longest cached prefix of ``ids`` (whole blocks) into ``cache``, which must
        be empty, and return that prefix's length (0: nothing reused). ``count``: add the lookup to :attr:`stats`
        (the target's prompt counts; a draft model's lookups are counted under its own label only)."""
        if cache.length:
            raise ValueError(f"restore needs an empty cache, got one holding {cache.length} tokens")
        with self._lock:
            chain = self._chain(model, ids)
            for block in reversed(chain):  # the last first: a parent stays at least as recent as its children
                self._blocks.move_to_end(block.key)
            self._count(model, len(ids), len(chain) * self.block, count)
        if not chain:
            return 0
        n = len(chain) * self.block
        first = chain[0]
        _, h_kv, _, d_k = first.keys.shape
        d_v = first.values.shape[3]
        for layer_index, layer in enumerate(cache.layers):
            k, v, start = layer.extend(n, h_kv, d_k, d_v, first.keys.dtype, first.keys.device)  # [1, H_kv, C, D]
            for j, block in enumerate(chain):
                at = start + j * self.block
                k[0, :, at: at + self.block] = block.keys[layer_index]  # [H_kv, B, D_k]
                v[0, :, at: at + self.block] = block.values[layer_index]  # [H_kv, B, D_v]
        return n

    def cached(self, model: torch.nn.Module, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` :meth:`restore` would reuse now (nothing is counted or touched)."""
        with self._lock:
            return len(self._chain(model, ids)) * self.block

    # ------------------------------------------------------------------------------------------------ writing

    def store(self, model: torch.nn.Module, ids: Sequence[int], cache: SpecCache) -> int:
        """Keep the whole blocks of ``ids`` whose keys/values ``cache``'s first ``len(ids)`` slots hold (slot ``i``
        is token ``ids[i]``); returns the tokens now covered (a multiple of the block, <= ``len(ids)``). Blocks
        already held are only touched; a block that does not fit the budget even after evicting every block but
        this chain's is not kept (nor are the blocks after it)."""
        b = self.block
        whole = min(len(ids), cache.length) // b * b
        if whole == 0 or self.budget_bytes == 0:
            return whole
        layers = cache.layers
        with self._lock:
            parent = self._root(model)
            chain: list[_Block] = []
            for i in range(0, whole, b):
                key = (parent, tuple(ids[i: i + b]))
                block = self._blocks.get(key)
                if block is None:
                    # stack copies: the block shares no memory with the cache
                    keys = torch.stack([layer.keys[0, :, i: i + b] for layer in layers])  # [L, H_kv, B, D_k]
                    values = torch.stack([layer.values[0, :, i: i + b] for layer in layers])  # [L, H_kv, B, D_v]
                    block = _Block(self._next_id, key, keys, values)
                    if not self._make_room(block.nbytes, keep=chain):
                        break
                    self._next_id += 1
                    self._blocks[key] = block
                    self._nbytes += block.nbytes
                    self._peak = max(self._peak, self._nbytes)
                    self.stats.stored += 1
                chain.append(block)
                parent = block.id
            for block in reversed(chain):
                self._blocks.move_to_end(block.key)
        return len(chain) * b

    def clear(self) -> None:
        """Drop every block."""
        with self._lock:
            self._blocks.clear()
            self._nbytes = 0

    # ------------------------------------------------------------------------------------------------ inside

    def _root(self, model: torch.nn.Module) -> int:
        """The model's root id (negative, distinct per model object): the parent key of its first blocks."""
        root = self._roots.get(model)
        if root is None:
            root = self._roots[model] = -1 - len(self._roots)
        return root

    def _chain(self, model: torch.nn.Module, ids: Sequence[int]) -> list[_Block]:
        """The cached blocks of ``ids``' longest cached prefix, in order (the lock held)."""
        chain: list[_Block] = []
        parent = self._root(model)
        b = self.block
        for i in range(0, len(ids) - b + 1, b):
            block = self._blocks.get((parent, tuple(ids[i: i + b])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _count(self, model: torch.nn.Module, queried: int, hit: int, count: bool) -> None:
        label = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        row = self.stats.per_model.setdefault(label, [0, 0])
        row[0] += queried
        row[1] += hit
        if count:
            self.stats.queried += queried
            self.stats.hit += hit

    def _make_room(self, nbytes: int, keep: list[_Block]) -> bool:
        """Evict least recently used blocks (never those of ``keep``, the chain being stored) until ``nbytes`` more
        fit the budget; False when they cannot."""
        if nbytes > self.budget_bytes:
            return False
        kept = {block.key for block in keep}
        while self._nbytes + nbytes > self.budget_bytes:
            victim = next((k for k in self._blocks if k not in kept), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, key: _Key) -> None:
        block = self._blocks.pop(key)
        self._nbytes -= block.nbytes
        self.stats.evicted += 1
