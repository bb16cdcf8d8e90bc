"""Weight-only quantization (speculant.core.quant): quantized linears compute their dequantized matrices for every
shape class; each output row is bitwise independent of how many rows are multiplied together (what keeps
verification equal to plain decoding); a quantized model decodes through the lean forward's quantized kernels, and
every method's greedy output equals plain decoding of the same quantized model; sampling keeps its distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import speculant
from speculant.core.cache import SpecCache
from speculant.core.llama_forward import LlamaForward
from speculant.core.packed import linear
from speculant.core.target_forward import llama_forward_for
from speculant.core.quant import (GROUP, QUANTIZATIONS, QuantMatrix, ReleasedLinear, quantization_of,
                                   quantize_model)
from speculant.core.types import SamplingParams
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import perturbed, tiny_model
from helpers import sizes
from test_sampling_distribution import FAIL_P, PASS_P, VOCAB, exact_joint, pvalues, sample_joint

KINDS = ("int8", "int4")
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread (row independence is also checked on two)."""


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- matrices


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(64, 32), (97, 64), (5, 96), (48, 160)])  # odd N, N below 16, K = 1..5 groups
@pytest.mark.parametrize("m", [1, 4, 16])
def test_quantized_linear_equals_the_dequantized_reference(kind, dtype, n, k, m):
    w = _weight(n, k).to(dtype)
    q = QuantMatrix.quantize(w, kind)
    assert q.shape == (n, k) and q.dtype == dtype
    deq = q.dequantize()  # [N, K]
    assert deq.dtype == dtype
    # the quantization itself: within half a step of the original weights
    step = q.scale.float()[:, None] if kind == "int8" else q.scale.float().repeat_interleave(GROUP, 1)
    err = (deq.float() - w.float()).abs()
    assert (err <= 0.5 * step + 1e-2 * w.float().abs() + 1e-6).all(), float((err - 0.5 * step).max())
    assert err.max() > 0  # it did quantize
    x = torch.randn(1, m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n).to(dtype)
    got = linear(x, q, bias)  # the seam the lean forward calls
    assert got.shape == (1, m, n) and got.dtype == dtype
    want = x.float() @ deq.float().T + bias.float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol * float(want.abs().max()), rtol=tol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_each_output_row_is_independent_of_the_row_count(kind, dtype, threads):
    """Verification multiplies 1..16 rows where plain decoding multiplies one: every row of a product must be the
    same bits whatever rows it is multiplied with, on the shapes of a real layer and a tiny one."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # a real model's layer shapes in bfloat16 (float32's int4 kernel is slow there: a mid-sized one)
        big = ((2048, 1536), (1536, 8960)) if dtype == torch.bfloat16 else ((256, 1024),)
        for n, k in ((96, 32), *big):
            q = QuantMatrix.quantize(_weight(n, k, seed=n).to(dtype), kind)
            x = torch.randn(33, k, generator=torch.Generator().manual_seed(2)).to(dtype)
            full = linear(x, q)  # [33, N]
            for rows in (*range(1, 17), 33):
                assert torch.equal(linear(x[:rows], q), full[:rows]), (n, k, rows)
            for r in (0, 7, 32):  # a row alone
                assert torch.equal(linear(x[r : r + 1], q), full[r : r + 1]), (n, k, r)
    finally:
        torch.set_num_threads(before)


def test_int4_from_codes_is_scale_times_code_plus_minimum():
    """A loader's codes (GGUF Q4_K sub-blocks: scale d*sc, minimum -dmin*m) map onto the int4 matrix unchanged."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (48, 64), generator=gen)
    scale, minimum = torch.rand(48, 2, generator=gen), -torch.rand(48, 2, generator=gen)
    q = QuantMatrix.int4(codes, scale, minimum, torch.float32)
    assert torch.equal(q.unpacked_codes(), codes.to(torch.uint8)) and q.codes.numel() == codes.numel() // 2
    want = codes.float() * scale.repeat_interleave(GROUP, 1) + minimum.repeat_interleave(GROUP, 1)
    torch.testing.assert_close(q.dequantize(), want, atol=1e-6, rtol=1e-6)
    other = QuantMatrix.quantize(_weight(16, 64), "int4")
    fused = QuantMatrix.cat([q, other])  # fused projections: rows stacked, one matrix
    assert fused.shape == (64, 64)
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), other.dequantize()]))
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(linear(x, fused), torch.cat([linear(x, q), linear(x, other)], -1))


def test_bad_input_is_a_one_line_value_error():
    w = _weight(16, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantMatrix.quantize(w, "int4")
    with pytest.raises(ValueError, match="int8, int4, q4, q8"):
        QuantMatrix.quantize(w, "int2")
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        QuantMatrix.int4(torch.full((16, 32), 16), torch.ones(16, 1), torch.zeros(16, 1), torch.float32)
    with pytest.raises(ValueError, match="scales must have shape"):
        QuantMatrix.int4(torch.zeros(16, 32, dtype=torch.long), torch.ones(16, 2), torch.zeros(16, 2), torch.float32)
    with pytest.raises(ValueError, match="computes in torch.float32"):
        linear(torch.randn(2, 48).bfloat16(), QuantMatrix.quantize(w, "int8"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(tiny_model("llama"), "int3")
    model = quantize_model(tiny_model("llama"), "int8")
    assert quantize_model(model, "int8") is model and quantize_model(model, "none") is model
    with pytest.raises(ValueError, match="already quantized to int8"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_model(tiny_model("llama", hidden=48, heads=4), "int4")
    assert QUANTIZATIONS == ("none", "int8", "int4", "q4", "file", "q8")  # q4, q8: tests/test_kernels.py


# ------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_a_quantized_model_runs_its_quantized_matrices_in_the_lean_forward(kind, arch):
    """The model's float weights are released (meta tensors of the same shape; its own forward multiplies by the
    quantized matrices, so it computes the same model), the lean forward multiplies by them too (fused), and a
    lean forward built before is replaced."""
    model = tiny_model(arch, seed=3)
    original = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    before = llama_forward_for(model)
    assert before.quantization == "none"
    quantize_model(model, kind)
    assert quantization_of(model) == kind
    down = model.model.layers[0].mlp.down_proj
    assert type(down) is ReleasedLinear and down.weight.device.type == "meta" and down.weight.shape == original.shape
    x = torch.randn(3, original.shape[1])
    assert torch.equal(down(x), down.speculant_quant.linear(x))
    model.to("cpu")  # moves leave a released weight alone
    lean = llama_forward_for(model)
    assert lean is not before and lean.quantization == kind and lean.packed
    w = lean.layers[0]
    assert all(type(m) is QuantMatrix for m in (w.qkv, w.o, w.gate_up, w.down, lean.head_matrix()))
    assert w.qkv.shape[0] == sum(model.model.layers[0].self_attn.get_submodule(p).weight.shape[0]
                                 for p in (("qkv_proj",) if arch == "phi3" else ("q_proj", "k_proj", "v_proj")))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.testing.assert_close(lean(ids, SpecCache(2)), want, atol=1e-4, rtol=1e-4)
    assert llama_forward_for(model) is lean


@pytest.mark.parametrize("kind", [*KINDS, "q4"])
def test_a_quantized_draft_drafts_through_its_quantized_head(kind, monkeypatch):
    """A draft model's logits come from its lean forward's head: the quantized matrix, not the float copy that its
    nn.Linear keeps for other forwards (reading that copy cost a q4 0.5B draft more than its 4-bit layers)."""
    from speculant.drafters.model import DraftModelDrafter

    draft = tiny_model("qwen2", seed=4, hidden=64)
    quantize_model(draft, kind)
    drafter = DraftModelDrafter(draft, k=2, vocab_trim=0)
    calls = []
    original = QuantMatrix.linear

    def spy(self, x, bias=None):
        calls.append(self.shape)
        return original(self, x, bias)

    monkeypatch.setattr(QuantMatrix, "linear", spy)
    monkeypatch.setattr(QuantMatrix, "fused", lambda self, *a, **k: None)  # every product through linear()
    speculant.generate(tiny_model("qwen2", seed=4, hidden=64), [3, 4, 5], drafter=drafter, max_new_tokens=6,
                       eos_token_id=[])
    head = draft.lm_head.weight.shape
    assert tuple(head) in [tuple(c) for c in calls]


def test_a_tied_head_quantizes_the_shared_matrix():
    model = tiny_model("qwen2", seed=1)
    model.lm_head.weight = model.model.embed_tokens.weight
    quantize_model(model, "int4")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, model.lm_head.speculant_quant.dequantize())
    assert type(LlamaForward(model).head_matrix()) is QuantMatrix


SPECS = ("chain:k=3", "specinfer:width=2:depth=3", "lookup")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch, dtype", [("llama", torch.float32), ("qwen2", torch.float32),
                                         ("qwen2", torch.bfloat16)])
def test_greedy_output_of_every_method_equals_plain_decoding_of_the_quantized_model(kind, arch, dtype):
    target = quantize_model(tiny_model(arch, seed=0, dtype=dtype), kind)
    draft = quantize_model(perturbed(tiny_model(arch, seed=0, dtype=dtype), 0.05, seed=2), kind)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7]  # repeats, so lookup proposes too
    plain = speculant.generate(target, prompt, max_new_tokens=24, eos_token_id=[])
    assert plain.stats.target_forward == "lean"
    unquantized = speculant.generate(tiny_model(arch, seed=0, dtype=dtype), prompt, max_new_tokens=24,
                                     eos_token_id=[]).token_ids
    accepted = 0
    for spec in SPECS:
        drafter = build_drafter(spec, None if spec == "lookup" else draft)
        gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=24, eos_token_id=[])
        assert gen.token_ids == plain.token_ids, (spec, unquantized)
        accepted += sum(i * c for i, c in enumerate(gen.stats.accepted_hist))
    assert accepted > 0  # drafts were accepted: the multi-row verification paths ran


@pytest.mark.parametrize("n", sizes(2500, id="int4"))
def test_int4_sampling_keeps_the_quantized_target_distribution(n):
    """Sampled speculative decoding of an int4 target with an int4 draft follows the int4 target's exact joint
    distribution (enumerated through the model's own forward, which computes the same dequantized matrices)."""
    target = quantize_model(tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0), "int4")
    draft = quantize_model(perturbed(tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0), 0.3, seed=5),
                           "int4")
    params = SamplingParams(temperature=1.0)
    expected = exact_joint(target, params, 3)
    counts, acceptance = sample_joint(target, draft, params, k=2, n=n, seed0=4_000)
    assert 0.15 < acceptance < 0.9, acceptance
    bad = {name: p for name, p in pvalues(counts, expected).items() if not p > PASS_P}
    assert not bad, f"empirical distribution differs from the int4 target's: p-values {bad}"
    assert np.isclose(counts.sum(), n)
    # the test sees the quantization: the same samples do not fit the unquantized model's distribution
    unquantized = exact_joint(tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0), params, 3)
    assert pvalues(counts, unquantized)["joint"] < FAIL_P


@pytest.mark.parametrize("kind", ["int4", "q4"])
def test_quantizing_in_row_chunks_changes_nothing(kind, monkeypatch):
    """QuantMatrix.quantize works through large matrices (an LM head) a few thousand rows at a time to bound its
    float temporaries: each group is quantized alone, so the codes, scales and minimums are those of one pass."""
    from speculant.core.quant import formats as quant

    w = torch.randn(203, 96, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(quant, "_QUANTIZE_ROWS", 64)  # 4 chunks, the last one short
    chunked = QuantMatrix.quantize(w, kind)
    monkeypatch.setattr(quant, "_QUANTIZE_ROWS", 10_000)
    whole = QuantMatrix.quantize(w, kind)
    for a, b in ((chunked.codes, whole.codes), (chunked.scale, whole.scale), (chunked.zero, whole.zero)):
        assert torch.equal(a, b)


def test_a_q4_matrix_reads_its_codes_back_from_the_kernel_blocks():
    """With the kernel built, a q4 matrix keeps only the kernel's blocks (half a byte per weight less); its codes,
    and so cat, rows and dequantize, are read back from them: the same codes, padding rows dropped."""
    from speculant.core import kernels

    if kernels.library() is None:
        pytest.skip("speculant's compiled kernels cannot be built here")
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (37, 96), generator=gen)  # 37 rows: padded to 48 in the blocks
    scale, minimum = torch.rand(37, 3, generator=gen), -torch.rand(37, 3, generator=gen)
    q = QuantMatrix.int4(codes, scale, minimum, torch.float32, "q4")
    assert q._codes is None
    assert torch.equal(q.unpacked_codes(), codes.to(torch.uint8))
    assert torch.equal(QuantMatrix.cat([q, q]).unpacked_codes(), torch.cat([codes, codes]).to(torch.uint8))
    assert torch.equal(q.rows(torch.tensor([36, 0, 5])).unpacked_codes(), codes[[36, 0, 5]].to(torch.uint8))
