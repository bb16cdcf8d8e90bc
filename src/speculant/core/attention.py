"""Row-independent attention: a token's attention output is the same bits whether its forward holds one row or many.

Speculation is exact only if the target scores a token identically in plain decoding (a forward over one row) and
in verification (1 + k rows, a causal or a tree mask). Matrix kernels can be made row independent (speculant's
``q4`` is by construction, torch's int8/int4 ones loop over rows alike), but torch's SDPA is not: it takes other
code paths and reduction orders for one query than for several under a mask, and the last-bit differences, which
int8 activation quantization then amplifies, flipped real tokens of Qwen2.5-Coder-1.5B in q4 (3 of 4 requests
identical before this module). :func:`attend` computes every (head, row) alone over exactly the keys it may see
(masked keys skipped, never zeroed), in one fixed order:

* with speculant's compiled library (:func:`speculant.core.kernels.attend`, ``csrc/attend.cpp``): all rows in one
  call, float32 arithmetic, bfloat16 read and written directly (no upcast copy of the cache);
* without it (no compiler, ``SPECULANT_KERNELS=0``, float16): one SDPA call per row over that row's keys, with no
  mask, which is the very call plain decoding makes for its one row.

:class:`~speculant.core.llama_forward.LlamaForward` uses it for forwards of at most :data:`MAX_ROWS` new tokens
(decoding, verification, small prefills) and for every forward with a tree mask (verification of any size); longer
prefills keep SDPA's fast kernels (a prompt is prefilled the same way by
every method, so this choice never separates two methods).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels

__all__ = ["MAX_ROWS", "allowed_keys", "attend"]

MAX_ROWS = 64
"""Forwards of at most this many new tokens attend row by row (:func:`attend`); longer ones use SDPA."""


def allowed_keys(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The keys each row may see, bool ``[T, S]``, from a boolean or additive ``[1, 1, T, S]`` mask (additive: 0
    where seen, a large negative value where not, as :class:`~speculant.core.tree.TreeAttention` builds it); None
    for None (causal over ``[cache ; new rows]``). An additive mask with other values is a ValueError: a bias on
    the scores is not a set of keys."""
    if mask is None:
        return None
    m = mask[0, 0]
    if m.dtype == torch.bool:
        return m
    seen = m == 0
    if not bool(torch.all(seen | (m <= torch.finfo(m.dtype).min / 2))):
        raise ValueError("attend: an additive mask must hold 0 (seen) or the dtype's minimum (not seen)")
    return seen


def _per_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
             compute: torch.dtype) -> torch.Tensor:
    """One maskless SDPA per row over its keys: ``q [Hq, T, D]``, ``k``/``v`` ``[Hkv, S, D]`` -> ``[T, Hq, D]``."""
    hq, t, d = q.shape
    s = k.shape[1]
    rows = []
    for r in range(t):
        if allowed is None:
            kr, vr = k[:, : s - t + r + 1], v[:, : s - t + r + 1]
        else:
            keep = allowed[r].nonzero().squeeze(-1)  # [S_r]
            kr, vr = k.index_select(1, keep), v.index_select(1, keep)
        out = F.scaled_dot_product_attention(q[None, :, r : r + 1].to(compute), kr[None].to(compute),
                                             vr[None].to(compute), scale=scale,
                                             enable_gqa=hq != k.shape[0])  # [1, Hq, 1, D]
        rows.append(out[0, :, 0])
    return torch.stack(rows).to(q.dtype)  # [T, Hq, D]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Attention of ``q [1, Hq, T, D]`` over ``k``/``v`` ``[1, Hkv, S, D]`` (the cache and the new rows; Hq a
    multiple of Hkv) -> ``[1, T, Hq * D]`` in ``q``'s dtype, each row computed alone over the keys
    ``allowed [T, S]`` grants it (None: causal, row ``t`` sees keys ``< S - T + t + 1``)."""
    _, hq, t, d = q.shape
    cpu = q.device.type == "cpu"
    lib = kernels.library() if cpu and q.dtype in (torch.float32, torch.bfloat16) else None
    if lib is not None:
        out = kernels.attend(q[0], k[0], v[0], allowed, scale, lib)  # [T, Hq, D]
    else:
        compute = torch.float32 if cpu else q.dtype
        out = _per_row(q[0], k[0], v[0], allowed, scale, compute)
    return out.reshape(1, t, hq * d)
