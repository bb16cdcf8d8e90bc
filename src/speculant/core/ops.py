"""The Llama forward's building blocks: RMSNorm, and matrix products with their neighbours fused where a kernel can.

A decoder layer of a small model on a CPU spends a large share of its time outside the matrix products: about 50
torch ops per layer (norms in float32 and back, bias and residual adds, the GLU's chunk, silu and multiply), each
a few microseconds of dispatch, measured 17 ms of a 72 ms Qwen2.5-Coder-1.5B q4 step (bfloat16, 2 threads) and 11
of the 0.5B drafter's 30 ms. :func:`fused_linear` states one product with what surrounds it (a norm or a GLU
before, a bias and a residual after); where the matrix is ``q4`` and speculant's kernel is built, one kernel call
does all of it (``csrc/q4.cpp``: each step rounded to the dtype as the separate torch op would round it, so the two
paths differ by float rounding only), else the same steps run as torch ops. Either way each row is computed alone,
so the forward stays row independent (:mod:`speculant.core.attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .packed import PackedMatrix, linear
from .quant import QuantMatrix

__all__ = ["fused_linear", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as transformers computes it: statistics in float32, the normalised value
    rounded to ``x``'s dtype, then scaled by ``weight``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_linear(x: torch.Tensor, weight: torch.Tensor | PackedMatrix | QuantMatrix, bias: torch.Tensor | None = None,
                 *, norm: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + (f(x) @ weight.T + bias)`` with ``f`` = RMSNorm by ``norm`` (``eps``), or ``silu(gate) * up``
    of ``x = [gate | up]`` when ``glu``, or nothing: ``x [..., in]`` (``[..., 2 in]`` with ``glu``) ->
    ``[..., out]``. One kernel call for a q4 matrix (:meth:`QuantMatrix.fused`), else torch ops."""
    if type(weight) is QuantMatrix:
        out = weight.fused(x, bias, norm=norm, eps=eps, glu=glu, residual=residual)
        if out is not None:
            return out
    if norm is not None:
        x = rms_norm(x, norm, eps)
    if glu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = linear(x, weight, bias)
    return y if residual is None else residual + y
