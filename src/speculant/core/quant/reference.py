"""q4's product in torch: the compiled kernel's scheme (:mod:`speculant.core.kernels`, ``csrc/q4.cpp``) op for op,
for q4, q8 and q6 matrices (:mod:`speculant.core.quant.formats`).

It runs where the kernel cannot (no compiler, ``SPECULANT_KERNELS=0``, float16 inputs) and lets the tests check the
kernel bit for bit. Activations are quantized per row and block of :data:`~speculant.core.kernels.GROUP` inputs as
the kernel does (:func:`q4_activations`); the integer dot products are exact in float32 matmuls, and each fused
multiply-add is done in float64 and rounded to float32, which gives the kernel's result but for rare double
rounding. Every step is row independent (integer-valued matmuls are exact; the rest is elementwise).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..kernels import GROUP, HALF

__all__ = ["CodedMatrix", "q4_activations", "q4_reference"]


class CodedMatrix(Protocol):
    """What the reference reads of a q4 / q8 / q6 :class:`~.formats.QuantMatrix`."""

    kind: str
    shape: torch.Size  # (out, in)
    scale: torch.Tensor  # [out, in / 32] float16 (q6: d)
    zero: torch.Tensor | None  # [out, in / 32] float16 minimums (q6: int8 sub-scales [out, in / 16])

    def unpacked_codes(self, rows: slice = ...) -> torch.Tensor: ...


def q4_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4's activation quantization of ``x [M, K]``: ``(a [M, K / 32, 32], d [M, K / 32], s [M, K / 32])`` in
    float32, ``a`` the int8 values (integers in [-127, 127]), ``d = max|x| / 127`` per block, ``s = d * sum(a)``;
    the same float32 operations as the kernel's, so the same bits."""
    v = x.float().reshape(x.shape[0], -1, GROUP)  # [M, G, 32]
    d = v.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    a = (v * inv[..., None]).round()  # half to even, as nearbyintf
    return a, d, d * a.sum(-1)


def q4_reference(x: torch.Tensor, matrix: CodedMatrix, columns: int = 4096) -> torch.Tensor:
    """The q4 (or q8, q6) product ``x [M, K] -> [M, N]`` (float32) in torch: the kernel's scheme, op for op, with each
    fused multiply-add done in float64 and rounded to float32 (the same result but for rare double rounding). Row
    independent (integer-valued matmuls are exact; the rest is elementwise). Used without a compiler and by the
    tests; ``columns`` output columns at a time bound its memory."""
    a, d, s = q4_activations(x)  # [M, G, 32], [M, G], [M, G]
    n, k = matrix.shape
    out = torch.empty(x.shape[0], n)
    if matrix.kind == "q6":
        return _q6_reference(a, d, matrix, columns, out)
    for c0 in range(0, n, columns):
        c1 = min(n, c0 + columns)
        q = matrix.unpacked_codes(slice(c0, c1)).reshape(c1 - c0, -1, GROUP).float()  # [C, G, 32]
        sw, mw = matrix.scale[c0:c1].float(), matrix.zero[c0:c1].float()  # [C, G]
        acc = torch.zeros(x.shape[0], c1 - c0)
        for g in range(k // GROUP):
            dot = a[:, g] @ q[:, g].T  # [M, C] exact integers (|dot| < 2^24)
            t = d[:, g, None] * sw[None, :, g]  # [M, C] float32, as the kernel's multiply
            acc = (acc.double() + t.double() * dot.double()).float()  # fma(t, dot, acc)
            acc = (acc.double() + mw[None, :, g].double() * s[:, g, None].double()).float()  # fma(mw, s, acc)
        out[:, c0:c1] = acc
    return out


def _q6_reference(a: torch.Tensor, d: torch.Tensor, matrix: CodedMatrix, columns: int,
                  out: torch.Tensor) -> torch.Tensor:
    """:func:`q4_reference` for a q6 matrix (``a [M, G, 32]``, ``d [M, G]``): per half the exact ``sum (q - 32) a``,
    ``S = sc_0 D_0 + sc_1 D_1`` (exact in float32), ``acc = fma(d_w * dx, S, acc)``."""
    n, k = matrix.shape
    halves = a.reshape(a.shape[0], -1, 2, HALF)  # [M, G, 2, 16]
    for c0 in range(0, n, columns):
        c1 = min(n, c0 + columns)
        q = matrix.unpacked_codes(slice(c0, c1)).reshape(c1 - c0, -1, 2, HALF).float() - 32  # [C, G, 2, 16]
        sub = matrix.zero[c0:c1].float().reshape(c1 - c0, -1, 2)  # [C, G, 2]
        dw = matrix.scale[c0:c1].float()  # [C, G]
        acc = torch.zeros(a.shape[0], c1 - c0)
        for g in range(k // GROUP):
            # S = sc_0 D_0 + sc_1 D_1 [M, C]: exact integers
            s = (halves[:, g, 0] @ q[:, g, 0].T * sub[None, :, g, 0]
                 + halves[:, g, 1] @ q[:, g, 1].T * sub[None, :, g, 1])
            t = d[:, g, None] * dw[None, :, g]  # [M, C] float32, as the kernel's multiply
            acc = (acc.double() + t.double() * s.double()).float()  # fma(t, S, acc)
        out[:, c0:c1] = acc
    return out
