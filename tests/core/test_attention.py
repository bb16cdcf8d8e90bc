"""Row-independent attention (speculant.core.attention, csrc/attend.cpp): each row's output equals, bit for bit, the
same row computed alone over the same keys (causal and tree masks, GQA, 1 and 2 threads, both code paths), it
agrees with SDPA to rounding, and a quantized model's lean forward over T new tokens gives the logits of T
one-token forwards exactly, which is what makes speculation exact there."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from speculant.core import attention, kernels
from speculant.core.cache import SpecCache
from speculant.core.llama_forward import LlamaForward, Segment
from speculant.core.quant import quantize_model
from speculant.core.tree import ancestor_matrix
from speculant.tiny_models import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One thread unless a test sets two."""


@pytest.fixture(params=["kernel", "per-row"])
def path(request, monkeypatch):
    """Both code paths: the compiled kernel (skipped where it cannot be built) and the per-row SDPA fallback."""
    if request.param == "kernel":
        if kernels.library() is None:
            pytest.skip("speculant's compiled kernels cannot be built here")
    else:
        monkeypatch.setattr(kernels, "library", lambda isa="native": None)
    return request.param


def _qkv(hq: int, hkv: int, t: int, s: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, t, d, generator=g).to(dtype)
    # keys/values as views into a larger buffer, like the cache's (capacity beyond S, non-contiguous heads)
    kv = torch.randn(2, 1, hkv, s + 7, d, generator=g).to(dtype)
    return q, kv[0, :, :, :s], kv[1, :, :, :s]


def _sdpa(q, k, v, allowed, scale):
    t, s = q.shape[2], k.shape[2]
    if allowed is None:
        allowed = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed[None, None], scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])  # [1, Hq, T, D]
    return out.transpose(1, 2).reshape(1, t, -1)


TREE = [-1, 0, 0, 1, 2, 2]  # parents of 6 nodes below the root: two branches


def _tree_allowed(past: int) -> torch.Tensor:
    vis = ancestor_matrix(tuple(TREE))  # [Q, Q] with the root
    q = vis.shape[0]
    return torch.cat([torch.ones(q, past, dtype=torch.bool), vis], 1)  # [Q, L + Q]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (6, 6, 24), (12, 2, 128)])
def test_attention_agrees_with_sdpa(path, dtype, hq, hkv, d):
    past = 29
    for allowed_of in (lambda: None, lambda: _tree_allowed(past)):
        allowed = allowed_of()
        t = 5 if allowed is None else allowed.shape[0]
        q, k, v = _qkv(hq, hkv, t, past + t, d, dtype)
        got = attention.attend(q, k, v, allowed, d**-0.5)
        assert got.shape == (1, t, hq * d) and got.dtype == dtype
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), _sdpa(q, k, v, allowed, d**-0.5), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_equals_itself_computed_alone(path, dtype, threads):
    """Chain rows against one-row calls over the cache so far, tree rows against one-row calls over exactly their
    ancestors laid out contiguously (what plain decoding sees after the path is accepted): the same bits."""
    torch.set_num_threads(threads)
    try:
        hq, hkv, d, past = 4, 2, 40, 23
        q, k, v = _qkv(hq, hkv, 6, past + 6, d, dtype, seed=3)
        together = attention.attend(q, k, v, None, 0.3)  # [1, 6, Hq D]
        for r in range(6):
            alone = attention.attend(q[:, :, r : r + 1], k[:, :, : past + r + 1], v[:, :, : past + r + 1], None, 0.3)
            assert torch.equal(together[:, r], alone[:, 0]), r
        allowed = _tree_allowed(past)  # [7, L + 7]
        qt, kt, vt = _qkv(hq, hkv, allowed.shape[0], allowed.shape[1], d, dtype, seed=4)
        tree = attention.attend(qt, kt, vt, allowed, 0.3)
        for r in range(allowed.shape[0]):
            keep = allowed[r].nonzero().squeeze(-1)
            alone = attention.attend(qt[:, :, r : r + 1], kt[:, :, keep], vt[:, :, keep], None, 0.3)
            assert torch.equal(tree[:, r], alone[:, 0]), r
    finally:
        torch.set_num_threads(1)


def test_an_additive_mask_is_a_key_set_and_nothing_else():
    allowed = _tree_allowed(4)
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    assert torch.equal(attention.allowed_keys(additive), allowed)
    assert torch.equal(attention.allowed_keys(allowed[None, None]), allowed)
    assert attention.allowed_keys(None) is None
    with pytest.raises(ValueError, match="additive mask must hold 0"):
        attention.allowed_keys(additive - 1.0)


def test_the_kernel_rejects_bad_shapes():
    lib = kernels.library()
    if lib is None:
        pytest.skip("speculant's compiled kernels cannot be built here")
    q, k, v = _qkv(4, 2, 3, 10, 16, torch.float32)
    with pytest.raises(ValueError, match="mask must be"):
        kernels.attend(q[0], k[0], v[0], torch.ones(3, 9, dtype=torch.bool), 1.0, lib)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.attend(q[0], k[0].bfloat16(), v[0], None, 1.0, lib)
    with pytest.raises(ValueError, match="bad sizes"):
        kernels.attend(torch.randn(3, 2, 16), k[0], v[0], None, 1.0, lib)  # 3 query heads over 2 KV heads


@pytest.mark.parametrize("kind", ["q4", "int8", "int4"])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "phi3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_forward_over_t_tokens_gives_the_logits_of_t_one_token_forwards(kind, arch, dtype):
    """The property exact speculation rests on, end to end: bitwise, for chains of 2-5 tokens after prompts of
    several lengths (int8 and int4 run torch's kernels, q4 speculant's)."""
    model = tiny_model(arch, hidden=64, heads=4, kv_heads=2, vocab_size=128, dtype=dtype)
    quantize_model(model, kind)
    lean = LlamaForward(model)
    ids = torch.randint(2, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    for past, t in ((3, 5), (17, 2), (24, 4)):
        together_cache, alone_cache = SpecCache(2), SpecCache(2)
        lean(ids[:, :past], together_cache)
        lean(ids[:, :past], alone_cache)
        together = lean(ids[:, past : past + t], together_cache)
        alone = torch.cat([lean(ids[:, past + i : past + i + 1], alone_cache) for i in range(t)], 1)
        assert torch.equal(together, alone), (past, t)


def test_every_build_of_the_kernel_computes_the_same_bits():
    """The native, AVX2 and generic builds write the same C++ with no float contraction: the same bits."""
    if platform.machine() not in ("x86_64", "AMD64") or kernels.library() is None:
        pytest.skip("the ISA variants are x86 builds of a compiled library")
    # D = 64 and 128 take the AVX-512 (16 keys at a time) and AVX2 (4 keys) builds' fast routes, D = 72 the generic loops
    for dtype in (torch.float32, torch.bfloat16):
        for d in (64, 72, 128):
            for allowed in (_tree_allowed(30), None):
                t, s = (7, 37) if allowed is not None else (3, 45)
                q, k, v = _qkv(12, 2, t, s, d, dtype, seed=5)
                want = kernels.attend(q[0], k[0], v[0], allowed, 0.1, kernels.library())
                for isa in ("avx2", "generic"):
                    other = kernels.library(isa)
                    if other is not None:
                        got = kernels.attend(q[0], k[0], v[0], allowed, 0.1, other)
                        assert torch.equal(got, want), (isa, dtype, d, allowed is None)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "q4"])
def test_the_fused_attention_block_computes_the_bits_of_the_torch_ops(arch, dtype, kind, monkeypatch):
    """kernels.rope_attend (RoPE, the cache write and attention in one call per layer) and, for q4,
    kernels.q4_layers (all layers in one call) against the lean forward's torch RoPE + cache update + attend(): the
    same logits and the same cache, bit for bit, for a prompt, a chain and a tree (positions out of order, an
    ancestor mask)."""
    if kernels.library() is None:
        pytest.skip("speculant's compiled kernels cannot be built here")
    model = tiny_model(arch, hidden=64, heads=4, kv_heads=2, vocab_size=128, dtype=dtype)
    if kind != "none":
        quantize_model(model, kind)
    lean = LlamaForward(model)
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    allowed = _tree_allowed(20)  # [7, 27]: a tree of 7 nodes after 20 cached tokens
    depth = torch.tensor([0, 1, 2, 2, 3, 3, 3])  # the root, then TREE's nodes
    tree_mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]

    def run():
        cache = SpecCache(2, capacity=8)  # small: the cache grows while the block writes into it
        out = [lean(ids[:, :20], cache), lean(ids[:, 20:24], cache)]
        cache.crop(20)
        out.append(lean(ids[:, 30:37], cache, positions=(20 + depth)[None], mask=tree_mask.to(dtype)))
        out.append(lean(ids[:, 37:38], cache))
        return out, cache

    fused, fused_cache = run()  # q4: every layer in one call (kernels.q4_layers)
    plan = lean._plan(Segment(fused_cache), lean.embed[ids[:, :1]])
    assert lean._fused_attention([Segment(fused_cache)], [plan], ids.to(dtype)) is not None  # the fused path ran
    assert (lean._q4_table(dtype) is not None) == (kind == "q4")
    runs = [(fused, fused_cache)]
    if kind == "q4":  # then layer by layer from Python (one rope_attend call per layer)
        with monkeypatch.context() as m:
            m.setattr(LlamaForward, "_q4_table", lambda *a: None)
            runs.append(run())
    monkeypatch.setattr(LlamaForward, "_fused_attention", lambda *a: None)
    ops, ops_cache = run()
    for out, cache in runs:
        for a, b in zip(out, ops):
            assert torch.equal(a, b)
        for la, lb in zip(cache.layers, ops_cache.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
