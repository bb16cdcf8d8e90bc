"""Tree attention: the additive mask and position ids for a target forward over ``[root] + tree nodes``.

A node sees the whole cache, the root, its ancestors and itself; its position id is ``cache_len + depth`` (tree
attention as in SpecInfer, Miao et al. 2024). The mask lives in one buffer that is reused across steps: each step
writes only its ``Q x Q`` tree block and clears the previous one, so nothing of size ``Q x cache_len`` is
rebuilt. Blocks and depth vectors are memoised per tree shape (chains and static trees repeat every step).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .types import DraftTree

__all__ = ["TreeAttention", "ancestor_matrix"]


@lru_cache(maxsize=256)
def ancestor_matrix(parents: tuple[int, ...]) -> torch.Tensor:
    """``[Q, Q]`` bool, Q = N + 1: entry (i, j) is True when input j (0 = root, n + 1 = node n) is i itself or
    one of its ancestors, i.e. when query i may attend to key j."""
    q = len(parents) + 1
    vis = torch.zeros((q, q), dtype=torch.bool)
    vis[:, 0] = True
    for n, par in enumerate(parents):
        row = n + 1
        if par >= 0:
            vis[row] = vis[par + 1]
        vis[row, row] = True
    return vis


class TreeAttention:
    """Builds ``(attention_mask [1, 1, Q, L + Q], position_ids [1, Q])`` for a tree over a cache of length L."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._neg = torch.finfo(dtype).min
        self._buf: torch.Tensor | None = None  # [1, 1, Q_cap, L_cap], zeros except the last written block
        self._last: tuple[int, int] | None = None  # (Q, L) of the block written last
        self._blocks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def _block(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(tree.parents)
        hit = self._blocks.get(key)
        if hit is None:
            vis = ancestor_matrix(key)
            block = torch.zeros(vis.shape, dtype=self.dtype).masked_fill_(~vis, self._neg).to(self.device)
            offsets = torch.tensor([0] + tree.depths, dtype=torch.long, device=self.device)
            hit = (block, offsets)
            if len(self._blocks) < 1024:
                self._blocks[key] = hit
        return hit

    def build(self, tree: DraftTree, cache_len: int, soft: int = 0, soft_from: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mask and position ids for ``[root] + tree`` over a cache of ``cache_len`` tokens.

        ``soft``: key slots after the cache, before the new rows, that only rows ``soft_from ..`` see (probe rows
        reading ConFu's soft prompt, :class:`~speculant.core.types.Probes`); they take no position, so the mask is
        ``[1, 1, Q, L + S + Q]`` and the positions stay ``cache_len + depth``. Hidden in the reused buffer and
        cleared again by the next call, like the tree block."""
        block, offsets = self._block(tree)
        q = block.shape[0]
        past = cache_len + soft  # keys before the new rows
        need_q, need_l = q, past + q
        buf = self._buf
        if buf is None or buf.shape[2] < need_q or buf.shape[3] < need_l:
            cap_q = max(need_q, buf.shape[2] if buf is not None else 0)
            cap_l = max(need_l, 2 * (buf.shape[3] if buf is not None else 0), 256)
            buf = self._buf = torch.zeros((1, 1, cap_q, cap_l), dtype=self.dtype, device=self.device)
            self._last = None
        if self._last is not None:
            lq, ll, ls, lrows = self._last
            buf[0, 0, :lq, ll : ll + lq] = 0.0
            buf[0, 0, :lrows, ll - ls : ll] = 0.0
        buf[0, 0, :q, past : past + q] = block
        if soft:
            buf[0, 0, :soft_from, cache_len:past] = self._neg
        self._last = (q, past, soft, soft_from if soft else 0)
        return buf[:, :, :q, : past + q], (offsets + cache_len).unsqueeze(0)
