"""The quantized forms of a weight matrix: :class:`QuantMatrix` (its codes and scales, their packing into each
kernel's layout, and its products), and the tables that name the forms.

Matrix kinds (:data:`KINDS`):

* ``int8``: per output channel, symmetric: ``w[n, k] = scale[n] * q[n, k]``, ``q`` in ``[-127, 127]``
  (``torch._weight_int8pack_mm``).
* ``int4``: groups of :data:`GROUP` (32) along the input, asymmetric: ``w[n, k] = scale[n, g] * q[n, k] +
  minimum[n, g]``, ``q`` in ``[0, 16)``, ``g = k // 32`` (``torch.ops.aten._weight_int4pack_mm_for_cpu``). This is
  the shape GGUF's Q4_0/Q4_1/Q4_K blocks decode to (Q4_K: ``scale = d * sc``, ``minimum = -dmin * m`` per 32-weight
  sub-block), so a loader can hand its codes over unchanged (:meth:`QuantMatrix.int4`).
* ``q4``: int4 weights *and int8 activations*, on speculant's own kernel (:mod:`speculant.core.kernels`,
  ``csrc/q4.cpp``). Weights as GGUF's Q4_1: groups of 32 inputs, ``w = scale * q + minimum``, ``q`` in ``[0, 16)``,
  ``scale`` and ``minimum`` stored in float16 (the kind's definition: :meth:`QuantMatrix.dequantize` returns these
  values). What changes from ``int4``: each input row is quantized too, per block of 32 inputs as GGUF's Q8_1:
  ``d = max|x| / 127``, ``a = round(x / d)`` (``x * (1 / d)``, half to even) in ``[-127, 127]``; the product is
  ``y[m, n] = sum_g (scale * d) * (q . a) + minimum * (d * sum(a))`` with exact integer dot products (VNNI
  ``dpbusd`` / AVX2 ``maddubs``) and float32 fused multiply-adds over the groups in increasing order. Each weight
  block is read once for up to 16 rows, so verifying 16 tokens costs little more than decoding one (torch's int4
  kernel is compute-bound beyond one row). Without a compiler the same scheme runs in torch
  (:func:`~.reference.q4_reference`, slower; it agrees with the kernel to float64-vs-fma double
  rounding, a rare last-bit difference). The model's own (transformers) forward multiplies by the same matrices
  (:mod:`speculant.core.quant.rewrite`), so it computes the q4 model too (its attention differs from
  :class:`~speculant.core.llama_forward.LlamaForward`'s by float rounding only).
* ``q8``: q4 with 8-bit codes (``q`` in ``[0, 256)``, ``scale = (max - min) / 255``), the same activations, kernel
  and epilogue (9 bits per weight where q4 has 5); ``--quantization q8`` makes every matrix q8. A q8 matrix whose
  codes all lie below 128 (a GGUF file's 5-bit tensors as they are, or any matrix built with
  ``QuantMatrix.quantize(..., code_bits=7)``) goes to the kernel as 7-bit codes (:attr:`QuantMatrix.kernel_bits`),
  which an AVX2 CPU without VNNI multiplies with one ``maddubs`` per 4 inputs instead of two: the same bits, less
  time beyond one row.
* ``q6``: a GGUF file's Q6_K tensors as they are, on the same kernel and activations: per 32 inputs a float16
  ``d`` (Q6_K's, per 256, repeated) and two int8 sub-scales ``sc`` (one per 16 inputs), ``w = d * sc * (q - 32)``
  with ``q`` in ``[0, 64)``; the product takes each half's exact integer dot ``sum (q - 32) a`` and
  ``y = sum_g fma(d * dx, sc_0 D_0 + sc_1 D_1, acc)`` (``csrc/q4.cpp``, "q6"). 7 bits per weight where q8 takes 9,
  and the file's values exactly (:meth:`QuantMatrix.q6`); :meth:`QuantMatrix.quantize` makes one from float values
  too (tests).

Model quantizations (:data:`QUANTIZATIONS`) name what a whole model is made of: ``none`` or one kind for every
matrix, except ``file`` (a model quantization, not a matrix kind): each matrix as precise as its GGUF file, q4
matrices except wider ones for the tensors the file stores in more than 4 bits (:data:`HOLDS`): Q6_K as q6, Q5_0,
Q8_0 ... as q8, so the model stays as close to the file as q4's activations allow. A q6 value projection fused with
q4 q and k (the Llama forward's one q/k/v matrix) is held as q8 on the model too (:func:`~.rewrite.unify_fused`), so
that both forwards multiply by the same matrices.

Exactness rests on row independence: verification multiplies 1..16 rows by each matrix where plain decoding
multiplies one, so a token's output row must not depend on how many rows are multiplied together. Both torch
kernels loop over rows with the same arithmetic per row, and q4's kernel is row independent by construction
(same operations in the same order for every row whatever their number, threads split the columns only) (checked
bitwise in tests/test_quant.py and tests/test_kernels.py for 1..16 and more rows, 1 and 2 threads). The attention
between the products is row independent too (:mod:`speculant.core.attention`), so a quantized forward over T
tokens gives the bits of T one-token forwards (tests/test_attention.py, end to end on four architectures): every
method's greedy output equals plain decoding's. Note: torch's dense float kernels (``F.linear`` in float32, and
oneDNN's packed ones of :mod:`speculant.core.packed` for larger matrices) are *not* row independent bit for bit;
their differences are float rounding, which is why greedy equality of unquantized models holds on well-separated
logits but a near-tie may flip.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import GROUP, HALF
from ..modes import normal_mode
from .reference import q4_reference

__all__ = ["ATTR", "BITS", "BLOCK_KINDS", "BLOCK_LAYOUT", "DRAFT_KIND", "GROUP", "HALF", "HOLDS", "KINDS",
           "MATRIX_KIND", "QUANTIZATIONS", "QuantMatrix"]

QUANTIZATIONS = ("none", "int8", "int4", "q4", "file", "q8")
"""Accepted values of ``quantization=`` (``--quantization``)."""

KINDS = ("int8", "int4", "q4", "q8", "q6")
"""Kinds of :class:`QuantMatrix`."""

BITS = {"int8": 8, "int4": 4, "q4": 4, "q8": 8, "q6": 6}
"""Bits per weight code of each kind."""

HOLDS = {"int8": ("int8",), "int4": ("int4",), "q4": ("q4",), "file": ("q4", "q8", "q6"), "q8": ("q8",)}
"""The matrix kinds a model quantized to each kind may hold: a ``file`` model (each matrix as precise as its GGUF
file) keeps the file's Q6_K tensors as q6 and its other tensors of more than 4 bits (Q5_0, Q8_0 ...) in 8-bit blocks
(q8), all on the same kernel (see :func:`speculant.models.loading.quantize_loaded`), as the file itself spends more
bits on them, and 4-bit ones for the rest."""

MATRIX_KIND = {"file": "q4"}
"""The kind of the matrices :func:`~.rewrite.quantize_model` makes for a model quantization, where it is not the same
name (a ``file`` model's matrices without wider codes in its file are q4)."""

DRAFT_KIND = {"file": "q4"}
"""The kind a draft takes by default when its target has this one (a draft only proposes: its numerics never change
what is emitted, so it takes the fastest form of the target's kind)."""

ATTR = "speculant_quant"
"""The attribute of a quantized ``nn.Linear`` that holds its :class:`QuantMatrix`."""

BLOCK_LAYOUT = 1
"""Version of the q4 / q8 / q6 kernel's block layouts (:meth:`QuantMatrix._pack`, ``csrc/q4.cpp``): blocks saved under
another version (a model's matrix cache, :mod:`speculant.models.matrix_cache`) are rebuilt, never read. Bump it with
any change to the layout."""

BLOCK_KINDS = ("q4", "q8", "q6")
"""The kinds of speculant's own kernel (int8 activations, codes with a scale and minimum per 32, or q6's scales,
packed in its blocks: :attr:`QuantMatrix.blocks`)."""

_Q6_SCALES, _Q6_D = 384, 416  # a q6 block's int8 sub-scales and float16 d (csrc/q4.cpp)
_N_ALIGN = 16  # the int4 CPU kernel packs output rows in blocks of 16: pad the rows up to a multiple
_QUANTIZE_ROWS = 8192  # QuantMatrix.quantize works through this many rows at a time


class QuantMatrix:
    """A weight-only quantized ``[out, in]`` matrix; :meth:`linear` multiplies ``x [..., in]`` by it in
    ``dtype`` (the model's dtype; the scales are stored rounded to it, so every form computes the same matrix).

    Build with :meth:`quantize` (from a float matrix), :meth:`from_codes` / :meth:`int4` (from codes, e.g. a GGUF
    file's) or :meth:`cat` (fused rows). ``codes``: int8 ``[out, in]`` (int8); uint8 ``[out, in / 2]``, two 4-bit
    codes per byte, the even input's in the low nibble (int4, q4); uint8 ``[out, in]`` (q8, q6)
    (:meth:`unpacked_codes`: one code per byte for every kind but int8); ``scale``: ``[out]`` (int8) or
    ``[out, in / 32]`` (int4, q4, q8; q6: ``d``, float16); ``zero``: None (int8), ``[out, in / 32]`` (int4: the
    kernel's form ``w = (q - 8) * scale + zero``; q4, q8: the minimum, ``w = q * scale + zero``, scale and zero in
    float16) or q6's int8 sub-scales ``[out, in / 16]`` (``w = scale * zero * (q - 32)``).
    q4 and q8 multiply ``x`` quantized per row to int8 (see the module doc); q8 is q4 with 8-bit codes
    (``q`` in ``[0, 256)``). ``kernel_bits``: the ``bits`` the kernel is called with (4 for q4; 7 for a q8 matrix
    whose codes all lie below 128, which an AVX2 CPU without VNNI multiplies by a cheaper route, the same bits; 6 for
    q6; else 8)."""

    __slots__ = ("kind", "shape", "dtype", "_codes", "scale", "zero", "nbytes", "_kernel", "kernel_bits")

    def __init__(self, kind: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        if kind not in KINDS:
            raise ValueError(f"quantized kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if codes.dim() != 2:
            raise ValueError(f"codes must be a [out, in] matrix, got shape {tuple(codes.shape)}")
        out, inp = codes.shape[0], codes.shape[1] * (8 // BITS[kind])
        if kind != "int8" and inp % GROUP:
            raise ValueError(f"{kind} needs the input size to be a multiple of {GROUP}, got {inp}")
        want = (out,) if kind == "int8" else (out, inp // GROUP)
        want_zero = (out, inp // HALF) if kind == "q6" else want
        if tuple(scale.shape) != want or (zero is not None and tuple(zero.shape) != want_zero):
            raise ValueError(f"{kind} scales must have shape {want}, got {tuple(scale.shape)}")
        self.kind, self.shape, self.dtype = kind, torch.Size((out, inp)), dtype
        sdtype = torch.float16 if kind in BLOCK_KINDS else dtype
        self._codes, self.scale = codes, scale.to(sdtype)
        self.zero = None if zero is None else zero.to(torch.int8 if kind == "q6" else sdtype)
        # what the kernel holds: int8 codes as they are (1 byte per weight); int4 codes two per byte (reordered);
        # q4 / q8 codes at 4 / 8 bits and a float16 scale and minimum per 32 (5 / 9 bits per weight); q6 codes at 6
        # bits, a float16 d per 32 and an int8 sub-scale per 16 (7 bits per weight)
        # (int4 matrices also keep their own nibble codes for cat and dequantize: another half byte per weight; q4
        # and q8 ones read them back from the kernel's blocks when asked, unless the kernel is not built)
        self.nbytes = _nbytes(kind, out, inp)
        self._kernel = self._prepare()
        self.kernel_bits = _kernel_bits(kind, codes)
        if kind in BLOCK_KINDS and kernels.library() is not None:
            self._codes = None

    @property
    def codes(self) -> torch.Tensor:
        """The codes as described in the class doc (a q4 / q8 matrix unpacks them from its kernel blocks on each
        call)."""
        return self._codes if self._codes is not None else self._unpack()

    @property
    def bits(self) -> int:
        """Bits per weight code (:data:`BITS`)."""
        return BITS[self.kind]

    # ------------------------------------------------------------------------------------------ construction

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str, code_bits: int | None = None) -> QuantMatrix:
        """The ``kind`` (int8, int4, q4, q8, q6) quantization of ``weight [out, in]``, in ``weight``'s dtype (round to
        nearest; int8 scale = max |w| / 127 per row; int4 scale = (max - min) / 15 and minimum = min per group; q4
        the same rounded to float16 first, the codes taken against the rounded values; q8 as q4 with 255 steps; q6
        as Q6_K: per 16 inputs a scale ``-w_max / 32`` (``w_max`` the weight of largest magnitude), per 32 ``d = max
        |scale| / 127`` in float16, ``sc = round(scale / d)`` in [-127, 127], ``q = round(w / (d * sc)) + 32`` in
        [0, 64)). ``code_bits=7`` (q8 only):
        127 steps, codes below 128, which an AVX2 CPU without VNNI multiplies faster (:attr:`kernel_bits`)."""
        if code_bits not in (None, BITS.get(kind)) and not (kind == "q8" and code_bits == 7):
            raise ValueError(f"code_bits={code_bits} is not a choice for {kind} (q8 takes 7 or 8)")
        w = weight.detach()
        if kind == "int8":
            w = w.float()
            scale = (w.abs().amax(1) / 127).clamp_min(1e-12).to(weight.dtype).float()  # [out], as the kernel sees it
            codes = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            return cls("int8", codes, scale, None, weight.dtype)
        if kind in ("int4", "q4", "q8"):
            if w.dim() != 2 or w.shape[1] % GROUP:
                raise ValueError(f"{kind} needs the input size to be a multiple of {GROUP}, got shape "
                                 f"{tuple(w.shape)}")
            top = (1 << (code_bits or BITS[kind])) - 1
            parts = []  # row chunks: each group is quantized alone, and an LM head's float temporaries stay small
            for rows in w.split(_QUANTIZE_ROWS):
                g = rows.float().reshape(rows.shape[0], -1, GROUP)  # [rows, groups, 32]
                low, high = g.amin(-1), g.amax(-1)
                scale = ((high - low) / top).clamp_min(1e-12)
                if kind in BLOCK_KINDS:  # the stored float16 values; a scale that underflows to 0 keeps codes 0
                    low, scale = low.half().float(), scale.half().float()
                    scale = torch.where(scale > 0, scale, torch.inf)
                codes = ((g - low[..., None]) / scale[..., None]).round().clamp(0, top).to(torch.uint8)
                parts.append((codes.reshape(rows.shape), torch.where(torch.isinf(scale), 0.0, scale), low))
            codes, scale, low = (torch.cat(p) for p in zip(*parts))
            return cls.from_codes(codes, scale, low, weight.dtype, kind)
        if kind == "q6":
            if w.dim() != 2 or w.shape[1] % GROUP:
                raise ValueError(f"q6 needs the input size to be a multiple of {GROUP}, got shape {tuple(w.shape)}")
            parts = []
            for rows in w.split(_QUANTIZE_ROWS):
                h = rows.float().reshape(rows.shape[0], -1, 2, HALF)  # [rows, groups, 2, 16]
                top = h.gather(-1, h.abs().argmax(-1, keepdim=True))[..., 0]  # the signed extreme
                sub = top / -32  # [rows, groups, 2]: the extreme is code 0 exactly, as Q6_K's quantizer does
                d = (sub.abs().amax(-1) / 127).half().float()  # [rows, groups]
                sc = torch.where(d[..., None] > 0, sub / torch.where(d > 0, d, 1)[..., None], 0)
                sc = sc.round().clamp(-127, 127)
                step = d[..., None] * sc  # [rows, groups, 2]
                q = torch.where(step[..., None] != 0, h / torch.where(step != 0, step, 1)[..., None], 0)
                q = (q.round() + 32).clamp(0, 63).to(torch.uint8)
                parts.append((q.reshape(rows.shape), d, sc.to(torch.int8).reshape(rows.shape[0], -1)))
            codes, d, sc = (torch.cat(p) for p in zip(*parts))
            return cls.q6(codes, d, sc, weight.dtype)
        raise ValueError(f"quantization must be one of {', '.join(KINDS)} here, got {kind!r}")

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype,
                   kind: str) -> QuantMatrix:
        """An int4, q4 or q8 matrix from its codes ``[out, in]`` (integers in ``[0, 2^bits)``: 16 for int4 and q4,
        256 for q8), ``scale`` and ``minimum`` ``[out, in / 32]``: ``w = scale * q + minimum``, computed in
        ``dtype`` (q4, q8: scale and minimum rounded to float16). 4-bit codes make a q8 matrix too (the same values,
        twice the bytes)."""
        if kind not in ("int4", "q4", "q8"):
            raise ValueError(f"codes with a scale and minimum per {GROUP} make an int4, q4 or q8 matrix, not {kind!r}")
        top = (1 << BITS[kind]) - 1
        if codes.dim() == 2 and codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > top):
            raise ValueError(f"{kind} codes must lie in [0, {top + 1})")
        if codes.dim() != 2 or codes.shape[1] % GROUP:
            raise ValueError(f"{kind} codes must be [out, in] with in a multiple of {GROUP}, got {tuple(codes.shape)}")
        codes, scale = codes.to(torch.uint8), scale.float()
        zero = minimum.float() if kind in BLOCK_KINDS else minimum.float() + 8 * scale
        if kind != "q8":
            nibbles = codes.reshape(codes.shape[0], -1, 2)
            codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
        return cls(kind, codes, scale, zero, dtype)

    @classmethod
    def q6(cls, codes: torch.Tensor, d: torch.Tensor, sub: torch.Tensor, dtype: torch.dtype) -> QuantMatrix:
        """A q6 matrix from a GGUF file's Q6_K contents (or :meth:`quantize`'s): codes uint8 ``[out, in]`` in
        ``[0, 64)``, ``d`` ``[out, in / 32]`` (float16 values: Q6_K's per-256 ``d`` repeated per 32), ``sub`` integers
        in ``[-128, 128)`` ``[out, in / 16]``: ``w = d * sub * (q - 32)`` (:meth:`dequantize`)."""
        if codes.dim() != 2 or codes.shape[1] % GROUP:
            raise ValueError(f"q6 codes must be [out, in] with in a multiple of {GROUP}, got {tuple(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 63):
            raise ValueError("q6 codes must lie in [0, 64)")
        if sub.numel() and (int(sub.min()) < -128 or int(sub.max()) > 127):
            raise ValueError("q6 sub-scales must lie in [-128, 128)")
        if d.numel() and not torch.equal(d.float().half().float(), d.float()):
            raise ValueError("q6 scales d must be float16 values")
        return cls("q6", codes.to(torch.uint8), d, sub.to(torch.int8), dtype)

    @classmethod
    def from_blocks(cls, kind: str, shape: tuple[int, int], blocks: torch.Tensor, dtype: torch.dtype) -> QuantMatrix:
        """A q4, q8 or q6 matrix of ``shape`` ``(out, in)`` from the kernel's own blocks (:attr:`blocks` of a matrix of
        the same kind and shape, e.g. read back from a cache): the same matrix, bit for bit, without packing again.
        Raises ValueError for another kind or blocks of another shape or dtype."""
        if kind not in BLOCK_KINDS:
            raise ValueError(f"kernel blocks make a q4, q8 or q6 matrix, not {kind!r}")
        out, inp = int(shape[0]), int(shape[1])
        want = (-(-out // kernels.Q4_COLUMNS), inp // GROUP, kernels.BLOCK_BYTES[BITS[kind]])
        if inp % GROUP or blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
            raise ValueError(f"{kind} blocks of a {out} x {inp} matrix must be uint8 {want}, got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        m = cls.__new__(cls)
        m.kind, m.shape, m.dtype = kind, torch.Size((out, inp)), dtype
        m._kernel, m._codes = (blocks.contiguous(),), None
        codes = want[2] - 64  # the block's code bytes, then 16 float16 scales and 16 float16 minimums

        def per_column(at: int) -> torch.Tensor:  # [nb, groups, 32] bytes -> [out, groups] float16 (_pack's inverse)
            v = m._kernel[0][..., at:at + 32].contiguous().view(torch.float16)  # [nb, groups, 16]
            return v.transpose(1, 2).reshape(-1, want[1])[:out].contiguous()

        if kind == "q6":  # codes (384 bytes), the int8 sub-scales [half, j], then d
            m.scale = per_column(_Q6_D)
            sub = m._kernel[0][..., _Q6_SCALES:_Q6_D].contiguous().view(torch.int8).reshape(-1, want[1], 2, 16)
            m.zero = sub.permute(0, 3, 1, 2).reshape(-1, 2 * want[1])[:out].contiguous()  # [out, 2 groups]
        else:
            m.scale, m.zero = per_column(codes), per_column(codes + 32)
        m.nbytes = _nbytes(kind, out, inp)
        m.kernel_bits = _kernel_bits(kind, m._kernel[0][..., :codes] if kind == "q8" else None)
        if kernels.library() is None:  # torch's reference reads the codes: keep them unpacked, as __init__ does
            m._codes = m._unpack()
        return m

    @property
    def blocks(self) -> torch.Tensor:
        """uint8 ``[out' / 16, in / 32, 320, 576 or 448]``: a q4 / q8 / q6 matrix's kernel blocks (:meth:`_pack`),
        what :meth:`from_blocks` takes back. ValueError for another kind."""
        if self.kind not in BLOCK_KINDS:
            raise ValueError(f"a {self.kind} matrix has no q4 / q8 / q6 kernel blocks")
        return self._kernel[0]

    @classmethod
    def int4(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype,
             kind: str = "int4") -> QuantMatrix:
        """:meth:`from_codes` for 4-bit codes (in ``[0, 16)`` whatever ``kind``): a GGUF Q4_K sub-block has
        ``scale = d * sc``, ``minimum = -dmin * m``; Q4_1: ``d``, ``m``."""
        if codes.dim() == 2 and codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
            raise ValueError("int4 codes must lie in [0, 16)")
        return cls.from_codes(codes, scale, minimum, dtype, kind)

    @classmethod
    def cat(cls, parts: list[QuantMatrix]) -> QuantMatrix:
        """The matrices stacked along the output rows (fused q/k/v, gate/up): one matrix, one kernel call. q4 and q8
        parts fuse into a q8 matrix (each q4 part's codes and scales unchanged: the same values); a q6 part beside
        another kind is requantized to q8 first (within 1/510 of a group's range: q6 holds no other kind's values,
        and q8 no q6 ones exactly; a Q4_K_M file's Q6_K value projections, fused with q and k)."""
        parts = cls.fusable(parts)
        first = parts[0]
        kinds = {p.kind for p in parts}
        if (len(kinds) > 1 and not kinds <= set(BLOCK_KINDS)) or any(
                p.dtype != first.dtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only quantized matrices of one kind (or q4 with q8), dtype and input size can be fused")
        if len(parts) == 1:
            return first
        if len(kinds) > 1:
            return cls.from_codes(torch.cat([p.unpacked_codes() for p in parts]), torch.cat([p.scale for p in parts]),
                                  torch.cat([p.zero for p in parts]), first.dtype, "q8")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])
        return cls(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zero,
                   first.dtype)

    @classmethod
    def fusable(cls, parts: list[QuantMatrix]) -> list[QuantMatrix]:
        """``parts`` as :meth:`cat` fuses them: a q6 part beside another kind requantized to q8 (the others, and a
        group of one kind, as they are)."""
        if len({p.kind for p in parts}) < 2:
            return list(parts)
        return [cls.quantize(p.dequantize(), "q8") if p.kind == "q6" else p for p in parts]

    def rows(self, keep: torch.Tensor) -> QuantMatrix:
        """The matrix of the output rows ``keep [M]`` (long) only, the same codes and scales: a VocabTrim'd head."""
        zero = None if self.zero is None else self.zero[keep]
        return QuantMatrix(self.kind, self.codes[keep], self.scale[keep], zero, self.dtype)

    def _prepare(self):
        """The kernel's operands: int8 ``(codes, scale)``; int4 ``(packed codes, [groups, out', 2] scale/zero,
        out')`` with the rows padded to a multiple of 16 (padding rows are zero: code 8, scale and zero 0); q4, q8
        and q6 ``(packed,)``, see :meth:`_pack`."""
        with normal_mode():
            if self.kind == "int8":
                return self.codes.contiguous(), self.scale.contiguous()
            if self.kind in BLOCK_KINDS:
                return (self._pack(),)
            out = self.shape[0]
            pad = -out % _N_ALIGN
            codes, scale, zero = self.unpacked_codes().to(torch.int32), self.scale, self.zero
            if pad:
                codes = torch.cat([codes, codes.new_full((pad, codes.shape[1]), 8)])
                scale = torch.cat([scale, scale.new_zeros((pad, scale.shape[1]))])
                zero = torch.cat([zero, zero.new_zeros((pad, zero.shape[1]))])
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
            scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [groups, out + pad, 2]
            return packed, scale_zero

    def _pack(self) -> torch.Tensor:
        """uint8 ``[out' / 16, in / 32, 320, 576 or 448]``: the q4 / q8 / q6 kernel's blocks (``csrc/q4.cpp``),
        ``out`` padded to ``out'``, a multiple of 16, with zero rows. Per block of 16 columns ``j`` x 32 inputs, q4:
        byte ``64 c + 4 j + b`` holds input ``4 c + b`` of column ``j`` in its low nibble and input ``16 + 4 c + b``
        in its high nibble (c, b < 4); q8: byte ``64 s + 4 j + b`` holds input ``4 s + b`` (s < 8); then the 16
        float16 scales and the 16 float16 minimums. q6: q4's nibbles of the codes' low 4 bits, then byte
        ``256 + 64 h + 4 j + b`` holds the high 2 bits of input ``16 h + 4 k + b`` at bits ``2k`` (k < 4), then the
        int8 sub-scales (byte ``384 + 16 h + j``) and the 16 float16 ``d``."""
        out, inp = self.shape
        groups, pad = inp // GROUP, -out % kernels.Q4_COLUMNS
        q, scale, minimum = self.unpacked_codes(), self.scale, self.zero  # [out, in], [out, groups] x 2
        if pad:
            q = torch.cat([q, q.new_zeros(pad, inp)])
            scale = torch.cat([scale, scale.new_zeros(pad, groups)])
            if self.kind != "q6":
                minimum = torch.cat([minimum, minimum.new_zeros(pad, groups)])
        blocks = (out + pad) // kernels.Q4_COLUMNS

        def per_block(v: torch.Tensor) -> torch.Tensor:  # [out', groups] float16 -> [nb, groups, 32] bytes
            return v.reshape(blocks, kernels.Q4_COLUMNS, groups).transpose(1, 2).contiguous().view(torch.uint8)

        if self.kind == "q8":  # input k = 32 g + 4 s + b of column 16 nb + j  ->  [nb, g, s, j, b]
            q = q.reshape(blocks, kernels.Q4_COLUMNS, groups, 8, 4).permute(0, 2, 3, 1, 4)
            codes = q.reshape(blocks, groups, 512)
        else:  # input k = 32 g + 16 half + 4 c + b of column 16 nb + j  ->  [nb, g, c, j, b, half]
            q = q.reshape(blocks, kernels.Q4_COLUMNS, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
            low = q & 15
            codes = (low[..., 0] | (low[..., 1] << 4)).reshape(blocks, groups, 256)  # q6: the low 4 bits
        if self.kind == "q6":
            top = (q >> 4).permute(0, 1, 5, 3, 4, 2)  # [nb, g, half, j, b, k]: crumb k of byte [half, j, b]
            crumbs = (top[..., 0] | (top[..., 1] << 2) | (top[..., 2] << 4) | (top[..., 3] << 6))
            sub = self.zero if not pad else torch.cat([self.zero, self.zero.new_zeros(pad, 2 * groups)])
            sub = sub.reshape(blocks, kernels.Q4_COLUMNS, groups, 2).permute(0, 2, 3, 1)  # [nb, g, half, j]
            return torch.cat([codes, crumbs.reshape(blocks, groups, _Q6_SCALES - 256),
                              sub.contiguous().view(torch.uint8).reshape(blocks, groups, _Q6_D - _Q6_SCALES),
                              per_block(scale)], -1).contiguous()
        return torch.cat([codes, per_block(scale), per_block(minimum)], -1).contiguous()

    def _unpack(self) -> torch.Tensor:
        """:attr:`codes` read back from the kernel's blocks (the inverse of :meth:`_pack`'s reordering): uint8
        ``[out, in / 2]`` nibble pairs (q4) or ``[out, in]`` (q8, q6)."""
        out, inp = self.shape
        packed = self._kernel[0]  # [out' / 16, groups, 320, 576 or 448]
        blocks, groups = packed.shape[0], packed.shape[1]
        if self.kind == "q8":
            b = packed[..., :512].reshape(blocks, groups, 8, kernels.Q4_COLUMNS, 4)  # [nb, g, s, j, b]
            return b.permute(0, 3, 1, 2, 4).reshape(blocks * kernels.Q4_COLUMNS, inp)[:out]
        b = packed[..., :256].reshape(blocks, groups, 4, kernels.Q4_COLUMNS, 4)  # [nb, g, c, j, b]
        q = torch.stack([b & 15, b >> 4], -1)  # [nb, g, c, j, b, half]
        if self.kind == "q6":  # and the high 2 bits
            crumbs = packed[..., 256:_Q6_SCALES].reshape(blocks, groups, 2, kernels.Q4_COLUMNS, 4)  # [nb,g,half,j,b]
            top = torch.stack([(crumbs >> (2 * k)) & 3 for k in range(4)], -1)  # [nb, g, half, j, b, k]
            q = q | (top.permute(0, 1, 5, 3, 4, 2) << 4)  # [nb, g, c, j, b, half]
        q = q.permute(0, 3, 1, 5, 2, 4).reshape(blocks * kernels.Q4_COLUMNS, inp)[:out]  # [out, in]
        if self.kind == "q6":
            return q
        pairs = q.reshape(out, -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)

    # ---------------------------------------------------------------------------------------------- use

    def unpacked_codes(self, rows: slice = slice(None)) -> torch.Tensor:
        """uint8 ``[out, in]`` (``[len(rows), in]`` for the output ``rows`` only): the int4 / q4 / q8 / q6 codes, one
        per byte."""
        if self.kind == "int8":
            raise ValueError(f"unpacked_codes of a {self.kind} matrix: its codes are int8 [out, in] already")
        codes = self.codes[rows]  # [R, in] (q8, q6) or [R, in / 2] nibble pairs (int4, q4)
        return codes if self.kind in ("q8", "q6") else _nibbles(codes).reshape(codes.shape[0], self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """``[out, in]`` in :attr:`dtype`: the matrix the quantized kernels multiply by (float32 arithmetic)."""
        if self.kind == "int8":
            w = self.codes.float() * self.scale.float()[:, None]
        elif self.kind == "q6":  # as gguf's Q6_K decoder: (d * sc) * (q - 32) in float32
            step = self.scale.float().repeat_interleave(2, 1) * self.zero.float()  # [out, in / 16]
            q = self.unpacked_codes().float().reshape(self.shape[0], -1, HALF) - 32
            w = (step[..., None] * q).reshape(self.shape)
        else:
            q = self.unpacked_codes().float().reshape(self.shape[0], -1, GROUP) - (8 if self.kind == "int4" else 0)
            w = (q * self.scale.float()[..., None] + self.zero.float()[..., None]).reshape(self.shape)
        return w.to(self.dtype)

    def fused(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, norm: torch.Tensor | None = None,
              eps: float = 0.0, glu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """:func:`speculant.core.ops.fused_linear` in one call of speculant's q4 kernel (q4, q8 and q6 matrices), or
        None where it cannot run here (another kind, no compiled kernel, a dtype or device it does not take)."""
        dtype, k = x.dtype, self.shape[1]
        if (self.kind not in BLOCK_KINDS or dtype != self.dtype or dtype not in (torch.float32, torch.bfloat16)
                or x.device.type != "cpu" or x.shape[-1] != (2 * k if glu else k)
                or not (_fits(norm, dtype, k) and _fits(bias, dtype, self.shape[0]) and _fits(residual, dtype, None))
                or (norm is not None and glu)):
            return None
        lib = kernels.library()
        if lib is None:
            return None
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, in] ([M, 2 in] with glu)
        res = None if residual is None else residual.reshape(rows.shape[0], self.shape[0]).contiguous()  # [M, out]
        out = kernels.q4_call(rows, k, self._kernel[0], self.kernel_bits, self.shape[0], lib, norm, float(eps), glu,
                              bias, res)
        return out.view(*x.shape[:-1], self.shape[0])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W.T + bias -> [..., out]`` in ``x``'s dtype (which must be :attr:`dtype`)."""
        if x.dtype != self.dtype:
            raise ValueError(f"this {self.kind} matrix computes in {self.dtype}, got input in {x.dtype}")
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, in]
        if self.kind == "int8":
            out = torch._weight_int8pack_mm(rows, *self._kernel)
        elif self.kind in BLOCK_KINDS:
            lib = kernels.library()
            if lib is None or rows.dtype not in (torch.float32, torch.bfloat16):  # (float16: the reference)
                out = q4_reference(rows, self).to(self.dtype)
            else:
                out = kernels.q4_matmul(rows, self._kernel[0], self.shape[0], lib, bits=self.kernel_bits)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self._kernel[0], GROUP, self._kernel[1])
            if out.shape[1] != self.shape[0]:
                out = out[:, : self.shape[0]].contiguous()
        out = out.view(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias


def _kernel_bits(kind: str, codes: torch.Tensor) -> int:
    """The ``bits`` the kernel takes for a matrix of ``kind`` with these codes (q8 blocks or one code per byte): 7
    for q8 codes all below 128 (:func:`speculant.core.kernels.q4_seven`), else the kind's :data:`BITS`."""
    if kind == "q8" and codes is not None and (codes.numel() == 0 or int(codes.max()) < 128):
        return 7
    return BITS[kind]


def _nbytes(kind: str, out: int, inp: int) -> int:
    """Bytes the kernel holds for an ``out x inp`` matrix of ``kind``: the codes, plus a float16 scale and minimum
    per 32 inputs for the block kinds (q6: a float16 d per 32 and an int8 sub-scale per 16, the same bytes)."""
    return out * inp * BITS[kind] // 8 + (out * inp // 8 if kind in BLOCK_KINDS else 0)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n]`` nibble pairs -> ``[..., n, 2]`` codes (low nibble first)."""
    return torch.stack([packed & 15, packed >> 4], -1)


def _fits(t: torch.Tensor | None, dtype: torch.dtype, numel: int | None) -> bool:
    """Whether ``t`` (a fused operand) may go to the q4 kernel: None, or a CPU tensor of ``dtype`` (contiguous with
    ``numel`` elements when given)."""
    return t is None or (t.dtype == dtype and t.device.type == "cpu"
                         and (numel is None or (t.numel() == numel and t.is_contiguous())))
