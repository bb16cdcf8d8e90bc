"""speculant's own q4 kernel (speculant.core.kernels, csrc/q4.cpp) and the q4 quantization kind: the kernel equals
the torch reference of the same scheme; its code paths (AVX-512, AVX2, scalar) agree bit for bit; each output row
is bitwise independent of the row count and of the thread count; without a compiler the reference runs after one
warning; a q4 model decodes the same tokens with every method as with plain decoding.

The first use builds the library (about 2-3 s, cached in ~/.cache/speculant/kernels); the code-path test builds two
more variants once. Kernel tests skip where no library can be built (the reference path is tested regardless)."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

import speculant
from speculant.core import kernels
from speculant.core.cache import SpecCache
from speculant.core.packed import linear
from speculant.core.quant import GROUP, QuantMatrix, attach, q4_activations, q4_reference, quantize_model, \
    quantized_linears, releasable
from speculant.core.target_forward import llama_forward_for
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import perturbed, tiny_model

DTYPES = (torch.float32, torch.bfloat16)
SHAPES = [(5, 32), (97, 64), (48, 160), (300, 1536)]  # N below 16, odd N, K = 1..5 groups, a wide one


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One thread unless a test sets two."""


@pytest.fixture(scope="module")
def lib():
    """The native library (built once per session), or a skip where none can be built."""
    library = kernels.library()
    if library is None:
        pytest.skip("speculant's q4 kernel cannot be built here (the torch reference is tested elsewhere)")
    return library


def _matrix(n: int, k: int, dtype: torch.dtype, seed: int = 0, kind: str = "q4") -> QuantMatrix:
    """A random matrix of ``kind`` (``"q7"``: q8 with 7-bit codes, the kernel's bits-7 route)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return QuantMatrix.quantize(w, "q8", code_bits=7) if kind == "q7" else QuantMatrix.quantize(w, kind)


def _rows(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, :GROUP] *= 20  # blocks of very different ranges: the per-block activation scales matter
    if m > 1:
        x[1, GROUP:] = 0  # all-zero blocks (scale 0)
    return x.to(dtype)


# ------------------------------------------------------------------------------------------- the scheme


def test_activation_quantization_is_per_row_blocks_of_32_in_int8():
    x = _rows(3, 96, torch.float32)
    a, d, s = q4_activations(x)
    assert a.shape == (3, 3, GROUP) and d.shape == s.shape == (3, 3)
    assert torch.equal(a, a.round()) and int(a.abs().max()) == 127  # integers, each block's largest at +-127
    blocks = x.reshape(3, 3, GROUP)
    torch.testing.assert_close(d, blocks.abs().amax(-1) / 127)
    assert ((a * d[..., None] - blocks).abs() <= d[..., None] / 2 * (1 + 1e-5)).all()
    assert (a[1, 1:] == 0).all() and (d[1, 1:] == 0).all()  # a zero block stays zero
    torch.testing.assert_close(s, d * a.sum(-1))


def test_q4_weights_are_float16_scale_times_code_plus_minimum():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    q = QuantMatrix.quantize(w, "q4")
    assert q.kind == "q4" and q.scale.dtype == q.zero.dtype == torch.float16 and q.scale.shape == (40, 2)
    codes = q.unpacked_codes()
    want = codes.float() * q.scale.float().repeat_interleave(GROUP, 1) + q.zero.float().repeat_interleave(GROUP, 1)
    assert torch.equal(q.dequantize(), want)
    err = (want - w).abs()
    assert (err <= 0.5 * q.scale.float().repeat_interleave(GROUP, 1) + 2e-3 * w.abs().max()).all()
    # a loader's Q4_1 codes map onto it unchanged
    again = QuantMatrix.int4(codes, q.scale, q.zero, torch.float32, kind="q4")
    assert torch.equal(again.dequantize(), q.dequantize())
    # the packed layout: byte 64 c + 4 j + b of block (nb, g) holds inputs 4c+b (low) and 16+4c+b (high) of column j
    packed = q._kernel[0]
    assert packed.shape == (3, 2, kernels.Q4_BLOCK_BYTES)  # 40 columns padded to 48
    nb, g, c, j, b = 1, 1, 2, 5, 3
    byte = int(packed[nb, g, 64 * c + 4 * j + b])
    n, k = 16 * nb + j, 32 * g + 4 * c + b
    assert byte & 15 == int(codes[n, k]) and byte >> 4 == int(codes[n, k + 16])
    assert float(packed[nb, g, 256 + 2 * j : 258 + 2 * j].view(torch.float16)) == float(q.scale[n, g])
    assert float(packed[nb, g, 288 + 2 * j : 290 + 2 * j].view(torch.float16)) == float(q.zero[n, g])
    assert (packed[2, :, 64 * c + 4 * 8 + b] == 0).all()  # column 40 + 0 = padding


def test_q8_weights_are_q4_with_8_bit_codes_and_q4_codes_carry_over():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    q = QuantMatrix.quantize(w, "q8")
    assert q.kind == "q8" and q.bits == 8 and q.scale.dtype == torch.float16 and q.codes.shape == (40, 64)
    codes = q.unpacked_codes()
    assert int(codes.max()) == 255 and int(codes.min()) == 0
    scale, zero = q.scale.float().repeat_interleave(GROUP, 1), q.zero.float().repeat_interleave(GROUP, 1)
    assert torch.equal(q.dequantize(), codes.float() * scale + zero)
    assert ((q.dequantize() - w).abs() <= 0.5 * scale + 1e-3 * w.abs().max()).all()
    q4 = QuantMatrix.quantize(w, "q4")
    assert float((q.dequantize() - w).abs().max()) < float((q4.dequantize() - w).abs().max()) / 8
    assert q.nbytes == 40 * 64 * 9 // 8 and q4.nbytes == 40 * 64 * 5 // 8
    # the packed layout: byte 64 s + 4 j + b of block (nb, g) holds input 4s+b of column j, then scales and minimums
    packed = q._kernel[0]
    assert packed.shape == (3, 2, kernels.Q8_BLOCK_BYTES)
    nb, g, s, j, b = 1, 1, 6, 5, 3
    n = 16 * nb + j
    assert int(packed[nb, g, 64 * s + 4 * j + b]) == int(codes[n, 32 * g + 4 * s + b])
    assert float(packed[nb, g, 512 + 2 * j : 514 + 2 * j].view(torch.float16)) == float(q.scale[n, g])
    assert float(packed[nb, g, 544 + 2 * j : 546 + 2 * j].view(torch.float16)) == float(q.zero[n, g])
    assert torch.equal(QuantMatrix(q.kind, q.codes, q.scale, q.zero, q.dtype).dequantize(), q.dequantize())
    # 4-bit codes make a q8 matrix of the same values; fusing q4 with q8 promotes the q4 part unchanged
    promoted = QuantMatrix.int4(q4.unpacked_codes(), q4.scale, q4.zero, torch.float32, kind="q8")
    assert promoted.kind == "q8" and torch.equal(promoted.dequantize(), q4.dequantize())
    fused = QuantMatrix.cat([q4, q, q4])
    assert fused.kind == "q8" and torch.equal(fused.dequantize(), torch.cat([q4.dequantize(), q.dequantize(),
                                                                            q4.dequantize()]))
    assert torch.equal(fused.rows(torch.tensor([41, 2])).dequantize(), fused.dequantize()[[41, 2]])
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        QuantMatrix.from_codes(codes.int() + 1, q.scale, q.zero, torch.float32, "q8")
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        QuantMatrix.from_codes(codes, q.scale, q.zero, torch.float32, "q4")


def test_q6_weights_are_d_times_sub_scale_times_code_minus_32():
    """q6 holds Q6_K's form: a float16 d per 32 inputs, an int8 sub-scale per 16, 6-bit codes around 32, in its
    448-byte blocks (7 bits per weight where q8 takes 9); fused beside another kind it becomes q8 (requantized)."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    q = QuantMatrix.quantize(w, "q6")
    assert q.kind == "q6" and q.bits == 6 and q.kernel_bits == 6 and q.codes.shape == (40, 64)
    assert q.scale.dtype == torch.float16 and q.scale.shape == (40, 2) and q.zero.dtype == torch.int8
    assert q.zero.shape == (40, 4) and q.nbytes == 40 * 64 * 7 // 8
    codes = q.unpacked_codes()
    assert int(codes.max()) <= 63 and int(codes.min()) == 0  # each half's extreme weight at code 0, as Q6_K does
    step = q.scale.float().repeat_interleave(2, 1) * q.zero.float()  # [40, 4]: d * sc per 16 inputs
    want = (step.repeat_interleave(16, 1) * (codes.float() - 32))
    assert torch.equal(q.dequantize(), want)
    assert ((want - w).abs() <= 0.5 * step.abs().repeat_interleave(16, 1) + 1e-2 * w.abs().max()).all()
    q4 = QuantMatrix.quantize(w, "q4")
    assert float((q.dequantize() - w).abs().mean()) < float((q4.dequantize() - w).abs().mean()) / 3
    # the packed layout: nibbles as q4's, then the high 2 bits, the sub-scales and d
    packed = q._kernel[0]
    assert packed.shape == (3, 2, kernels.Q6_BLOCK_BYTES)
    nb, g, j, b = 1, 1, 5, 3
    n = 16 * nb + j
    for c in range(4):
        for half in range(2):
            k = 32 * g + 16 * half + 4 * c + b
            nibble = (int(packed[nb, g, 64 * c + 4 * j + b]) >> (4 * half)) & 15
            crumb = (int(packed[nb, g, 256 + 64 * half + 4 * j + b]) >> (2 * c)) & 3
            assert nibble | (crumb << 4) == int(codes[n, k]), (c, half)
            assert int(packed[nb, g, 384 + 16 * half + j].view(torch.int8)) == int(q.zero[n, 2 * g + half])
    assert float(packed[nb, g, 416 + 2 * j : 418 + 2 * j].view(torch.float16)) == float(q.scale[n, g])
    again = QuantMatrix.q6(codes, q.scale.float(), q.zero, torch.float32)
    assert torch.equal(again.blocks, q.blocks)
    fused = QuantMatrix.cat([q, q])
    assert fused.kind == "q6" and torch.equal(fused.dequantize(), torch.cat([q.dequantize()] * 2))
    mixed = QuantMatrix.cat([q4, q])
    assert mixed.kind == "q8" and torch.equal(mixed.dequantize()[:40], q4.dequantize())
    assert ((mixed.dequantize()[40:] - q.dequantize()).abs() <= 0.5 * mixed.scale[40:].float().repeat_interleave(32, 1)
            * (1 + 1e-3) + 1e-6).all()
    assert torch.equal(q.rows(torch.tensor([33, 2])).dequantize(), q.dequantize()[[33, 2]])
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        QuantMatrix.q6(codes.int() + 1, q.scale, q.zero, torch.float32)
    with pytest.raises(ValueError, match=r"\[-128, 128\)"):
        QuantMatrix.q6(codes, q.scale, q.zero.int() - 200, torch.float32)
    with pytest.raises(ValueError, match="float16 values"):
        QuantMatrix.q6(codes, q.scale.float() * (1 + 2 ** -20), q.zero, torch.float32)


@pytest.mark.parametrize("kind", ("q4", "q6"))
def test_the_reference_computes_the_quantized_product(kind):
    """The reference (and so the kernel) multiplies the dequantized weights by the quantized activations."""
    q = _matrix(48, 160, torch.float32, kind=kind)
    x = _rows(4, 160, torch.float32)
    a, d, _ = q4_activations(x)
    want = (a * d[..., None]).reshape(4, 160).double() @ q.dequantize().double().T
    got = q4_reference(x, q)
    torch.testing.assert_close(got.double(), want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)
    full = q4_reference(x, q, columns=7)  # column chunks do not change a bit
    assert torch.equal(full, got)
    # and it is close to the float product (activation rounding: well under 1%)
    dense = x @ q.dequantize().T
    assert float((got - dense).abs().max()) < 0.02 * float(dense.abs().max())


# ------------------------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("kind", ("q4", "q8", "q7", "q6"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_the_kernel_equals_the_torch_reference(lib, dtype, n, k, kind):
    q = _matrix(n, k, dtype, kind=kind)
    assert q.kernel_bits == {"q4": 4, "q8": 8, "q7": 7, "q6": 6}[kind]
    for m in (1, 4, 16, 33):
        x = _rows(m, k, dtype)
        got = kernels.q4_matmul(x, q._kernel[0], n, lib, bits=q.kernel_bits)
        assert got.shape == (m, n) and got.dtype == dtype
        want = q4_reference(x, q).to(dtype)
        # the same operations; the reference's float64 fma may round twice, a last-bit difference at most
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6 * float(want.float().abs().max()),
                                   rtol=1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(linear(x[None], q, None)[0], got)  # the seam the lean forward calls


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA variants are x86 builds")
def test_every_code_path_computes_the_same_bits(lib):
    """AVX-512 (VNNI or not), AVX2 and scalar code run the same float operations per lane, for 4-, 7- and 8-bit codes
    (without VNNI an 8-bit code's dot product is taken nibble by nibble, a 7-bit one by AVX2's own route) and q6's:
    the same bits, so a result does not depend on the CPU it was computed on either."""
    isas = ("avx2", "generic") + (("avx512",) if kernels.q4_isa() == "avx512-vnni" else ())  # AVX-512 without VNNI
    paths = {isa: kernels.library(isa) for isa in isas}
    assert kernels.q4_isa("generic") == "scalar"
    if "avx512" in paths:
        assert kernels.q4_isa("avx512") == "avx512"
    for kind in ("q4", "q8", "q7", "q6"):
        for dtype in DTYPES:
            for n, k in ((97, 64), (300, 1536)):
                q = _matrix(n, k, dtype, kind=kind)
                for m in (1, 2, 4, 6, 19):  # each tile loop: up to 4 rows grouped (2 with 8-bit codes), 3-7, 8-16
                    x = _rows(m, k, dtype)
                    x[m // 2] *= 1e3  # large activations: int8 codes at +-127 against 8-bit codes up to 255
                    want = kernels.q4_matmul(x, q._kernel[0], n, lib, bits=q.kernel_bits)
                    for isa, other in paths.items():
                        if other is not None:
                            got = kernels.q4_matmul(x, q._kernel[0], n, other, bits=q.kernel_bits)
                            assert torch.equal(got, want), (isa, kind, dtype, n, k, m)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA variants are x86 builds")
def test_every_code_path_fuses_the_same_bits(lib):
    """The fused steps around the product (the RMSNorm's lane sums, silu(gate) * up, + bias, + residual, and the
    activations' int8 quantization before it) have vector routes of their own on AVX-512 and AVX2: every build gives
    the scalar build's bits, a block of huge values included (the GLU's tails past a multiple of 16: the glu test)."""
    isas = ("avx2", "generic") + (("avx512",) if kernels.q4_isa() == "avx512-vnni" else ())
    paths = {isa: kernels.library(isa) for isa in isas}
    assert all(paths.values()), paths
    g = torch.Generator().manual_seed(7)
    for kind in ("q4", "q6"):
        for dtype in DTYPES:
            for n, k in ((40, 96), (300, 1536)):
                q = _matrix(n, k, dtype, seed=3, kind=kind)
                x, gu = _rows(5, k, dtype), torch.randn(5, 2 * k, generator=g).to(dtype)
                x[2, -GROUP:] = 3e4  # a block of huge values
                x[3, -1] = -3e4  # a block whose largest magnitude sits last
                norm, bias = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype), torch.randn(n, generator=g).to(dtype)
                residual = torch.randn(5, n, generator=g).to(dtype)
                cases = {"norm": (x, dict(norm=norm, eps=1e-6)), "glu": (gu, dict(glu=True)),
                         "bias+residual": (x, dict(bias=bias, residual=residual))}
                for name, (inp, kw) in cases.items():
                    for m in (1, 3, 5):
                        kw_m = {**kw, "residual": kw["residual"][:m]} if "residual" in kw else kw
                        want = kernels.q4_matmul(inp[:m], q._kernel[0], n, lib, bits=q.kernel_bits, **kw_m)
                        for isa, other in paths.items():
                            if other is not None:
                                got = kernels.q4_matmul(inp[:m], q._kernel[0], n, other, bits=q.kernel_bits, **kw_m)
                                assert torch.equal(got, want), (isa, kind, dtype, n, k, name, m)


def test_the_glu_step_is_silu_times_up_to_a_few_ulp_and_the_same_bits_on_every_path(lib):
    """The kernel's GLU (its own ``1 + exp``, vectorised) against float64's silu(g) * u: within a few float32 ulp
    wherever float32's exp(-g) is finite (the saturated right end included: silu(g) = g), at most a tiny negative
    value beyond, inf and NaN kept; every ISA build the same bits, float32 and bfloat16."""
    g = torch.cat([torch.linspace(-120, 120, 24001), torch.randn(4000) * 4, torch.tensor(
        [0.0, -0.0, -20.0, 20.0, -88.7, 88.7, -89.0, 89.0, -104.0, 1e-30, -1e-30, float("inf"), float("-inf")])])
    u = torch.rand(g.numel(), generator=torch.Generator().manual_seed(3)) + 0.5
    x = torch.cat([g, u]).contiguous()
    got = kernels.glu(x, lib)
    g64, u64 = g.double(), u.double()
    want = (g64 * torch.sigmoid(g64) * u64).float()
    inside = torch.isfinite(g) & (g > -88)  # below, exp(-g) passes float32's largest value: g / inf = -0
    ulp = (want[inside].abs().clamp_min(torch.finfo(torch.float32).tiny) * 2.0 ** -23)
    err = ((got[inside] - want[inside]).abs() / ulp).max().item()
    assert err <= 4, err
    far_left = torch.isfinite(g) & (g <= -88)
    assert (got[far_left] <= 0).all() and (got[far_left].abs() < 1e-35).all()
    assert got[g == float("inf")].item() == float("inf") and got[g == float("-inf")].isnan().all()
    assert torch.isnan(kernels.glu(torch.tensor([float("nan"), 1.0]), lib)).all()
    if platform.machine() in ("x86_64", "AMD64"):
        isas = ("avx2", "generic") + (("avx512",) if kernels.q4_isa() == "avx512-vnni" else ())
        for dtype in DTYPES:
            xd = x.to(dtype)
            want_bits = kernels.glu(xd, lib).view(torch.int32)  # as bits: NaN's included
            for isa in isas:
                assert torch.equal(kernels.glu(xd, kernels.library(isa)).view(torch.int32), want_bits), (isa, dtype)


def test_7_bit_codes_take_their_own_route_to_the_same_bits(lib):
    """q8 codes below 128 (``kernel_bits`` 7: a GGUF file's 4- and 5-bit codes in q8 blocks as they are, or 127-step
    requantization) go to the kernel as bits 7: on AVX2 without VNNI one ``maddubs`` per 4 inputs instead of two, the
    same exact integer dots, so the same bits as the 8-bit route, for every row count, the fused steps and 1-2
    threads."""
    assert kernels.q4_seven() == (kernels.q4_isa() == "avx2")  # the route is built exactly where it pays
    if platform.machine() in ("x86_64", "AMD64"):
        assert kernels.q4_seven(isa="avx2") and not kernels.q4_seven(isa="generic")
    before = torch.get_num_threads()
    try:
        for dtype in DTYPES:
            q = _matrix(300, 1536, dtype, kind="q7")
            assert q.kernel_bits == 7 and int(q.unpacked_codes().max()) == 127
            norm, bias = torch.rand(1536).to(dtype) + 0.5, torch.randn(300).to(dtype)
            x = _rows(17, 1536, dtype)
            x[5] *= 1e3  # int8 activations at +-127 against codes up to 127: pairs of products near int16's limit
            for rows in (*range(1, 9), 16, 17):
                torch.set_num_threads(1 + rows % 2)
                res = torch.randn(rows, 300).to(dtype)
                args = (x[:rows], q._kernel[0], 300, lib)
                kernels.q4_seven(False)
                want = [kernels.q4_matmul(*args, bits=7), kernels.q4_matmul(*args, bits=7, norm=norm, eps=1e-5,
                                                                            bias=bias, residual=res)]
                assert torch.equal(want[0], kernels.q4_matmul(*args, bits=8))  # off: the 8-bit route
                kernels.q4_seven(True)
                got = [kernels.q4_matmul(*args, bits=7), kernels.q4_matmul(*args, bits=7, norm=norm, eps=1e-5,
                                                                           bias=bias, residual=res)]
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (dtype, rows)
        assert _matrix(64, 64, torch.float32, kind="q8").kernel_bits == 8  # 255 steps: codes past 127
        codes = torch.zeros(32, 64, dtype=torch.uint8)
        scale, low = torch.full((32, 2), 0.01), torch.zeros(32, 2)
        assert QuantMatrix.from_codes(codes + 127, scale, low, torch.float32, "q8").kernel_bits == 7
        codes[5, 17] = 128  # one code at 128 is enough for the 8-bit route
        assert QuantMatrix.from_codes(codes, scale, low, torch.float32, "q8").kernel_bits == 8
        assert QuantMatrix.from_blocks("q8", q.shape, q.blocks, q.dtype).kernel_bits == 7
        with pytest.raises(ValueError, match="q8 takes 7 or 8"):
            QuantMatrix.quantize(torch.randn(16, 64), "q4", code_bits=7)
    finally:
        kernels.q4_seven(True)
        torch.set_num_threads(before)


@pytest.mark.skipif(not kernels.q4_amx(), reason="this CPU, OS or build has no AMX tiles")
def test_the_amx_tiles_compute_the_same_bits_as_the_vnni_path(lib):
    """With AMX, 10..16 rows take a tile multiply for a block's integer dots; the float operations after it are the
    VNNI path's, so every row count gives the same bits with and without tiles (4- and 8-bit codes, tail columns,
    extreme activations, 1 and 2 threads)."""
    before = torch.get_num_threads()
    try:
        for kind in ("q4", "q8"):
            for dtype in DTYPES:
                for n, k in ((97, 64), (300, 1536)):
                    q, x = _matrix(n, k, dtype, kind=kind), _rows(35, k, dtype)
                    x[3] *= 1e3  # int8 codes at +-127 against 8-bit codes up to 255
                    for rows in (2, 9, 10, 13, 16, 17, 26, 35):
                        torch.set_num_threads(1 + rows % 2)
                        kernels.q4_amx(False)
                        want = kernels.q4_matmul(x[:rows], q._kernel[0], n, lib, bits=q.bits)
                        assert kernels.q4_amx(True)
                        got = kernels.q4_matmul(x[:rows], q._kernel[0], n, lib, bits=q.bits)
                        assert torch.equal(got, want), (kind, dtype, n, k, rows)
    finally:
        kernels.q4_amx(True)
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype, kind", [(torch.float32, "q4"), (torch.bfloat16, "q4"), (torch.float32, "q8"),
                                         (torch.float32, "q7"), (torch.float32, "q6"), (torch.bfloat16, "q6")])
def test_each_row_is_independent_of_the_row_count_and_the_threads(lib, dtype, kind):
    """Verification multiplies 1..16 rows where plain decoding multiplies one: a row's result is the same bits with
    any rows, on 1 or 2 threads (threads split the columns, never the reduction), on a real layer's shapes."""
    before = torch.get_num_threads()
    try:
        for n, k in ((96, 32), (2048, 1536), (1536, 8960)):
            q, x = _matrix(n, k, dtype, seed=n, kind=kind), _rows(33, k, dtype, seed=2)
            torch.set_num_threads(1)
            full = linear(x, q)  # [33, N]
            torch.set_num_threads(2)
            assert torch.equal(linear(x, q), full)
            for rows in (*range(1, 17), 33):
                torch.set_num_threads(1 + rows % 2)
                assert torch.equal(linear(x[:rows], q), full[:rows]), (n, k, rows)
            for r in (0, 7, 16, 32):  # a row alone
                assert torch.equal(linear(x[r : r + 1], q), full[r : r + 1]), (n, k, r)
    finally:
        torch.set_num_threads(before)


def test_the_reference_rows_are_independent_too():
    q, x = _matrix(80, 96, torch.bfloat16), _rows(17, 96, torch.bfloat16)
    full = q4_reference(x, q)
    for rows in (1, 2, 5, 16, 17):
        assert torch.equal(q4_reference(x[:rows], q), full[:rows])


# ------------------------------------------------------------------------------------------- building


def test_the_build_is_cached_by_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    if kernels.library() is None:
        pytest.skip("no compiler here")
    path = kernels._build("native")
    assert path.parent == tmp_path / "kernels" and path.name.startswith("speculant-native-") and path.exists()
    stamp = path.stat().st_mtime_ns
    assert kernels._build("native") == path and path.stat().st_mtime_ns == stamp  # not built again
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_another_copy_of_the_sources_builds_and_serves_for_a_block(tmp_path):
    """kernels.build_of (a copy of the sources, as benchmarks/kernel_ab.py builds an earlier revision's) and
    kernels.using (library() answers that build inside the block, the usual one after it)."""
    lib = kernels.library()
    if lib is None:
        pytest.skip("no compiler here")
    for source in kernels.SOURCES:
        (tmp_path / source.name).write_bytes(source.read_bytes())
    other = kernels.build_of(tmp_path)
    assert other.q4_isa() == lib.q4_isa()
    with kernels.using(other):
        assert kernels.library() is other
        with kernels.using(None):
            assert kernels.library() is None
        assert kernels.library() is other
    assert kernels.library() is lib
    with pytest.raises(RuntimeError, match="cannot be built or loaded"):
        kernels.build_of(tmp_path / "missing")


def test_without_a_compiler_the_reference_runs_after_one_warning(monkeypatch, caplog):
    def fail(isa):
        raise RuntimeError("no C++ compiler found (set CXX)")

    monkeypatch.setattr(kernels, "_build", fail)
    monkeypatch.setattr(kernels, "_libraries", {})
    q, x = _matrix(48, 64, torch.bfloat16), _rows(5, 64, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="speculant.core.kernels"):
        got = linear(x, q)
        again = linear(x[:2], q)
    assert torch.equal(got, q4_reference(x, q).to(torch.bfloat16)) and torch.equal(again, got[:2])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    assert kernels.q4_isa() is None
    monkeypatch.setattr(kernels, "_libraries", {})
    monkeypatch.setenv(kernels.KERNELS_ENV, "0")  # switched off: no build tried, no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="speculant.core.kernels"):
        assert kernels.library() is None
    assert not caplog.records


def test_bad_operands_are_value_errors(lib):
    q = _matrix(16, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.q4_matmul(torch.randn(2, 48), q._kernel[0], 16, lib)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.q4_matmul(torch.randn(2, 64), q._kernel[0], 40, lib)
    with pytest.raises(ValueError, match="do not fit"):  # q4 blocks read as q8 ones
        kernels.q4_matmul(torch.randn(2, 64), q._kernel[0], 16, lib, bits=8)
    with pytest.raises(ValueError, match="do not fit"):  # q4 blocks read as q6 ones
        kernels.q4_matmul(torch.randn(2, 64), q._kernel[0], 16, lib, bits=6)
    with pytest.raises(ValueError, match="4-, 6-, 7- or 8-bit"):
        kernels.q4_matmul(torch.randn(2, 64), q._kernel[0], 16, lib, bits=5)
    with pytest.raises(ValueError, match="computes in torch.float32"):
        linear(torch.randn(2, 64).bfloat16(), q)


# ------------------------------------------------------------------------------------------- models


def test_a_q4_model_runs_its_kernel_in_the_lean_forward():
    model = quantize_model(tiny_model("llama", seed=3), "q4")
    lean = llama_forward_for(model)
    assert lean.quantization == "q4"
    w = lean.layers[0]
    assert all(type(m) is QuantMatrix and m.kind == "q4" for m in (w.qkv, w.o, w.gate_up, w.down, lean.head_matrix()))
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits  # dequantized weights, float activations: close, not equal
    got = lean(ids, SpecCache(2))
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


def test_a_long_prompt_fed_in_chunks_gives_the_bits_of_one_forward(monkeypatch):
    """A prompt longer than PREFILL_CHUNK is fed chunk by chunk; q4 rows and row-by-row attention are row
    independent, so hidden states and cached keys/values are the same bits as one forward's."""
    from speculant.core import llama_forward

    model = quantize_model(tiny_model("qwen2", seed=5), "q4")
    lean = llama_forward_for(model)
    ids = torch.tensor([[(5 * i + 1) % 90 for i in range(45)]])
    one_cache, chunk_cache = SpecCache(2), SpecCache(2)
    whole = lean.hidden(ids, one_cache)  # [1, 45, H]
    monkeypatch.setattr(llama_forward, "PREFILL_CHUNK", 16)
    calls = []
    real = lean.hidden_batch
    monkeypatch.setattr(lean, "hidden_batch", lambda segs, taps=None: calls.append(segs[0].input_ids.shape[1])
                        or real(segs, taps))
    taps = {0: None}
    chunked = lean.hidden(ids, chunk_cache, taps=taps)
    assert calls == [16, 16, 13]
    assert torch.equal(chunked, whole) and taps[0].shape[:2] == (1, 45)
    for a, b in zip(one_cache.layers, chunk_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


SPECS = ("chain:k=3", "specinfer:width=2:depth=3", "lookup")


def _mixed(model: torch.nn.Module, wide: str = "q8") -> torch.nn.Module:
    """``model`` quantized to ``file``: q4 with some matrices in ``wide`` (q8 or q6, as a GGUF file's 5- to 8-bit tensors
    load): the first layer's v and down projections and the LM head."""
    layer, free = model.model.layers[0], releasable(model, quantized_linears(model))
    for m in (layer.self_attn.v_proj, layer.mlp.down_proj, model.lm_head):
        attach(m, QuantMatrix.quantize(m.weight, wide), release_weight=id(m) in free)
    return quantize_model(model, "file")


@pytest.mark.parametrize("arch, dtype, kind", [("llama", torch.float32, "q4"), ("qwen2", torch.bfloat16, "q4"),
                                               ("qwen2", torch.float32, "q8"), ("llama", torch.float32, "mixed"),
                                               ("qwen2", torch.float32, "mixed6"), ("llama", torch.bfloat16, "mixed6")])
def test_greedy_output_of_every_method_equals_plain_decoding_of_the_q4_model(arch, dtype, kind):
    def quantized(model):
        if kind.startswith("mixed"):
            return _mixed(model, "q6" if kind == "mixed6" else "q8")
        return quantize_model(model, kind)

    target = quantized(tiny_model(arch, seed=0, dtype=dtype))
    draft = quantized(perturbed(tiny_model(arch, seed=0, dtype=dtype), 0.05, seed=2))
    if kind.startswith("mixed"):
        w, six = llama_forward_for(target).layers[0], kind == "mixed6"
        # a q6 v projection fused with q4 q and k: the fused matrix is q8 (requantized); the down projection stays q6
        assert (w.qkv.kind, w.o.kind, w.gate_up.kind, w.down.kind) == ("q8", "q4", "q4", "q6" if six else "q8")
        assert llama_forward_for(target)._q4_table(dtype)[0, 10:].tolist() == [8, 4, 4, 6 if six else 8]
        assert llama_forward_for(target).head_matrix().kind == ("q6" if six else "q8")
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7]
    plain = speculant.generate(target, prompt, max_new_tokens=24, eos_token_id=[])
    assert plain.stats.target_forward == "lean"
    accepted = 0
    for spec in SPECS:
        drafter = build_drafter(spec, None if spec == "lookup" else draft)
        gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=24, eos_token_id=[])
        assert gen.token_ids == plain.token_ids, spec
        accepted += sum(i * c for i, c in enumerate(gen.stats.accepted_hist))
    assert accepted > 0  # drafts were accepted: the multi-row verification paths ran


# ------------------------------------------------------------------------------------------- fused steps


@pytest.mark.parametrize("kind", ("q4", "q6"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norm_glu_bias_and_residual_equal_the_torch_steps(lib, dtype, kind):
    """One kernel call = RMSNorm (or silu(gate) * up), the product, + bias, + residual as separate torch ops, to the
    rounding of the norm's sum and of exp; each row still independent of the row count, bit for bit."""
    from speculant.core.ops import fused_linear, rms_norm

    n, k = 80, 96
    q = _matrix(n, k, dtype, seed=4, kind=kind)
    g = torch.Generator().manual_seed(5)
    x, gu = torch.randn(7, k, generator=g).to(dtype), torch.randn(7, 2 * k, generator=g).to(dtype)
    norm, bias = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype), torch.randn(n, generator=g).to(dtype)
    residual = torch.randn(7, n, generator=g).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    cases = {
        "norm": (x, dict(norm=norm, eps=1e-6), linear(rms_norm(x, norm, 1e-6), q)),
        "glu": (gu, dict(glu=True), linear(torch.nn.functional.silu(gu[:, :k]) * gu[:, k:], q)),
        "bias+residual": (x, dict(residual=residual), residual + linear(x, q, bias)),
    }
    for name, (inp, kw, want) in cases.items():
        b = bias if name == "bias+residual" else None
        got = fused_linear(inp, q, b, **kw)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=name)
        for rows in (1, 3):
            kw_rows = {**kw, "residual": kw["residual"][:rows]} if "residual" in kw else kw
            assert torch.equal(fused_linear(inp[:rows], q, b, **kw_rows), got[:rows]), (name, rows)
    with pytest.raises(ValueError, match="not both"):
        kernels.q4_matmul(gu, q._kernel[0], n, lib, norm=torch.ones(k, dtype=dtype), glu=True, bits=q.kernel_bits)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.q4_matmul(x, q._kernel[0], n, lib, bias=torch.ones(n + 1, dtype=dtype), bits=q.kernel_bits)


def test_q6_at_its_extremes_computes_the_reference_s_bits_on_every_path(lib):
    """A real Q6_K file's sub-scales reach -128 (ggml maps each super-block's largest there) and its codes 0 and 63:
    with activations at +-127 every half dot and S = sc0 D0 + sc1 D1 stay exact (|S| < 2^24), and every ISA build and
    row count gives the reference's bits."""
    g = torch.Generator().manual_seed(7)
    n, k = 48, 256
    codes = torch.randint(0, 64, (n, k), generator=g)
    codes[:, :16] = 0  # a half of codes all at -32
    sub = torch.randint(-128, 128, (n, k // 16), generator=g)
    sub[:, 0], sub[:, 1] = -128, 127
    d = (torch.rand(n, k // 32, generator=g) * 1e-3).half().float()
    q = QuantMatrix.q6(codes, d, sub, torch.float32)
    x = _rows(17, k, torch.float32)
    x[:, :32] = torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0) * 5  # activations +-127 in the first block
    want = q4_reference(x, q)
    x86 = platform.machine() in ("x86_64", "AMD64")
    builds = [lib] + ([kernels.library(isa) for isa in ("avx2", "generic")] if x86 else [])
    for other in builds:
        if other is None:
            continue
        got = kernels.q4_matmul(x, q.blocks, n, other, bits=6)
        torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-6)
        for rows in (1, 4, 16):
            assert torch.equal(kernels.q4_matmul(x[:rows], q.blocks, n, other, bits=6), got[:rows])
        assert torch.equal(got, kernels.q4_matmul(x, q.blocks, n, lib, bits=6))


def test_a_q6_part_fused_with_another_kind_is_held_as_the_fused_q8_on_the_model_too():
    """The lean forward multiplies q/k/v as one matrix; a q6 v projection beside q4 q and k becomes q8 there. After
    :func:`unify_fused` the model's own linear holds that very q8 matrix, so both forwards multiply by the same
    weights (a group of one kind is left as it is)."""
    from speculant.core.llama_forward import fused_groups
    from speculant.core.quant import ATTR, unify_fused

    model = _mixed(tiny_model("qwen2", seed=0), "q6")
    a = model.model.layers[0].self_attn
    assert getattr(a.v_proj, ATTR).kind == "q6"
    q6 = getattr(a.v_proj, ATTR)
    assert unify_fused(fused_groups(model)) == 1
    q8 = getattr(a.v_proj, ATTR)
    fused_here = QuantMatrix.cat([getattr(a.q_proj, ATTR), q6]).dequantize()[-q6.shape[0]:]
    assert q8.kind == "q8" and torch.equal(q8.dequantize(), fused_here)
    fused = llama_forward_for(model).layers[0].qkv
    assert fused.kind == "q8" and torch.equal(fused.dequantize()[-q8.shape[0]:], q8.dequantize())
    assert getattr(model.model.layers[0].mlp.down_proj, ATTR).kind == "q6"  # not fused: as it is
    assert unify_fused(fused_groups(model)) == 0
