"""The lean forward (speculant/core/llama_forward.py) computes what transformers' forward computes and fills the same
cache, on every covered architecture, for prefills, single tokens, chains, tree levels, probe slots and evicted caches;
decoding through it gives the tokens decoding through the model's own forward gives; anything it does not
cover falls back to the model's forward (and forward='lean' then names the reason)."""

from __future__ import annotations

import copy

import pytest
import torch

import speculant
from speculant.core.cache import SpecCache, cache_kwarg
from speculant.core.llama_forward import COVERED, LlamaForward, unsupported
from speculant.core.packed import PACK_ENV, PackedMatrix, packable
from speculant.core.target_forward import TargetForward, llama_forward_for
from speculant.core.tree import TreeAttention
from speculant.core.types import DraftTree
from speculant.drafters.registry import build_drafter
from speculant.kv import BudgetCache
from speculant.tiny_models import perturbed, tiny_model

LEAN_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


def test_every_covered_class_has_a_tiny_model():
    assert sorted(type(tiny_model(a)).__name__ for a in LEAN_ARCHS) == sorted(COVERED)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budgeted", [False, True])
def test_lean_logits_and_cache_match_the_model(arch, dtype, budgeted):
    """float32: equal to rounding. bfloat16: the lean forward attends in float32 on a CPU and transformers in bf16,
    so both are compared with the float32 model: the lean logits must be as close to it as transformers' are."""
    model = tiny_model(arch, seed=3, kv_heads=1 if arch == "qwen3" else 2, dtype=dtype)
    exact = copy.deepcopy(model).float()
    lean = LlamaForward.build(model)
    assert lean is not None, unsupported(model)
    make = BudgetCache if budgeted else SpecCache
    ours, ref, ref32 = (make(2, capacity=8) for _ in range(3))  # small: the buffers must grow too
    gen = torch.Generator().manual_seed(0)

    def check(ids=None, positions=None, mask=None, embeds=None):
        got = lean(ids, ours, positions, mask, inputs_embeds=embeds)
        feed = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        with torch.no_grad():
            want = model(**feed, **cache_kwarg(model, ref), position_ids=positions, attention_mask=mask,
                         use_cache=True).logits
            feed32 = {k: v.float() if k == "inputs_embeds" else v for k, v in feed.items()}
            mask32 = None if mask is None else mask.float()
            truth = exact(**feed32, **cache_kwarg(exact, ref32), position_ids=positions, attention_mask=mask32,
                          use_cache=True).logits
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            for a, b in zip(ours.layers, ref.layers):
                torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)
        else:
            ours_err = (got.float() - truth).abs().max()
            theirs_err = (want.float() - truth).abs().max()
            assert ours_err <= 2 * theirs_err + 0.01 * truth.abs().max(), (ours_err, theirs_err)

    check(torch.randint(0, 96, (1, 7), generator=gen))  # prefill of an empty cache (is_causal)
    check(torch.randint(0, 96, (1, 1), generator=gen))  # one token, no mask
    check(torch.randint(0, 96, (1, 3), generator=gen))  # a chain continuing the cache (boolean causal mask)
    n = ours.get_seq_length()
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 1])  # a tree: explicit mask and positions
    mask, positions = TreeAttention(dtype, model.device).build(tree, n)
    check(torch.tensor([[9, *tree.tokens]]), positions, mask)
    for cache in (ours, ref, ref32):
        cache.crop(n)
    embeds = torch.randn(1, 3, 32, generator=gen).to(dtype)  # probe slots come as embeddings
    check(embeds=embeds, positions=torch.tensor([[n, n + 1, n + 1]]))
    if budgeted:  # an evicted cache: drop slots, keep original positions
        for cache in (ours, ref, ref32):
            cache.keep(2, [4, 6, 8])
        check(torch.randint(0, 96, (1, 2), generator=gen), positions=torch.tensor([[20, 21]]))


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "phi"])
def test_uncovered_architectures_fall_back(arch, caplog):
    model = tiny_model(arch)
    assert "not a covered architecture" in unsupported(model)
    assert TargetForward(model).kind == "model"
    with pytest.raises(ValueError, match="forward='lean' is not available"):
        TargetForward(model, "lean")
    gen = speculant.generate(model, [3, 4, 5], max_new_tokens=4, eos_token_id=[])
    assert gen.stats.target_forward == "model"


@pytest.mark.parametrize("key, value, reason", [
    ("hidden_act", "gelu", "activation"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "RoPE type"),
])
def test_uncovered_options_fall_back(key, value, reason):
    cfg_model = tiny_model("llama")
    setattr(cfg_model.config, key, value)
    if key == "rope_parameters":  # the rotary module reads its type at construction
        cfg_model.model.rotary_emb.rope_type = "dynamic"
    assert reason in unsupported(cfg_model)
    assert "training" in unsupported(tiny_model("llama").train())


def test_sliding_window_beyond_the_sequence_falls_back():
    model = tiny_model("mistral")
    model.config.sliding_window = 16
    assert TargetForward(model, max_length=16).kind == "lean"
    assert TargetForward(model, max_length=17).kind == "model"
    with pytest.raises(ValueError, match="sliding window"):
        speculant.generate(model, [3, 4, 5], max_new_tokens=20, forward="lean")
    with pytest.raises(ValueError, match="forward must be one of"):
        speculant.generate(model, [3, 4, 5], max_new_tokens=2, forward="fast")


def test_fusing_keeps_one_copy_and_sees_in_place_updates(monkeypatch):
    monkeypatch.setenv(PACK_ENV, "0")  # unpacked: the lean forward reads the model's own tensors
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lean = llama_forward_for(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    attn = model.model.layers[0].self_attn
    fused = lean.layers[0].qkv
    # the model's q/k/v weights are views of the fused matrix: no second copy
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.mul_(1.5)  # e.g. training between generations
    assert llama_forward_for(model) is lean  # nothing replaced: no rebuild
    rows = attn.q_proj.weight.shape[0]
    assert torch.equal(fused[rows : rows + attn.k_proj.weight.shape[0]], attn.k_proj.weight)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.testing.assert_close(lean(ids, SpecCache(2)), want, atol=1e-5, rtol=1e-4)
    model.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.detach().clone())
    assert llama_forward_for(model) is not lean  # a replaced parameter: rebuilt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_matrices_give_the_dense_results_and_follow_in_place_updates(monkeypatch, dtype):
    """Packing (speculant.core.packed) changes the layout only: bf16 logits equal the unpacked lean forward's bit for
    bit, float32 ones to rounding; a packed lean forward is a copy, so llama_forward_for rebuilds it after an in-place
    update, and it is not built where SPECULANT_PACK=0 or the weights cannot be packed."""
    model = tiny_model("qwen3", seed=3).to(dtype)
    if not packable(model.lm_head.weight):
        pytest.skip(f"this CPU/torch build cannot pack {dtype} matrices (oneDNN)")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    dense = LlamaForward(model, pack=False)
    packed = LlamaForward(model, pack=True)
    assert packed.packed and not dense.packed and isinstance(packed.layers[0].qkv, PackedMatrix)

    def same(got, want):
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

    for t in (1, 5):
        same(packed(ids[:, :t], SpecCache(2)), dense(ids[:, :t], SpecCache(2)))
    monkeypatch.setenv(PACK_ENV, "1")
    lean = llama_forward_for(model)
    assert lean.packed and llama_forward_for(model) is lean
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    rebuilt = llama_forward_for(model)
    assert rebuilt is not lean and rebuilt.packed
    same(rebuilt(ids, SpecCache(2)), LlamaForward(model, pack=False)(ids, SpecCache(2)))
    assert not torch.allclose(lean(ids, SpecCache(2)).float(), rebuilt(ids, SpecCache(2)).float())
    monkeypatch.setenv(PACK_ENV, "0")
    assert not LlamaForward(model).packed
    monkeypatch.setenv(PACK_ENV, "auto")
    assert not LlamaForward(model).packed  # auto: a model this small stays in the caches, packing does not pay
    monkeypatch.setenv(PACK_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECULANT_PACK must be auto, 1 or 0"):
        LlamaForward(model)
    monkeypatch.setenv(PACK_ENV, "1")
    assert not LlamaForward(model.to(torch.float16)).packed  # float16: not packable, the dense path


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@pytest.mark.parametrize("pack", ["0", "1"])
def test_decoding_through_the_lean_forward_gives_the_model_forward_tokens(arch, pack, monkeypatch):
    monkeypatch.setenv(PACK_ENV, pack)  # the lean forward with dense and with packed matrices (speculant.core.packed)
    target = tiny_model(arch, seed=0)
    draft = perturbed(target, 0.05, seed=2)
    prompt = [3, 4, 5, 6, 7]
    for spec in ("ar", "chain:k=3", "specinfer:width=2:depth=3", "lookup"):
        outs = {}
        for forward in ("lean", "model"):
            drafter = build_drafter(spec, draft if spec != "ar" and spec != "lookup" else None)
            gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=20, eos_token_id=[],
                                     forward=forward)
            assert gen.stats.target_forward == forward
            outs[forward] = (gen.token_ids, gen.stats.accepted_hist)
        assert outs["lean"] == outs["model"], spec
    plain = speculant.generate(target, prompt, max_new_tokens=20, eos_token_id=[], forward="model").token_ids
    assert outs["lean"][0] == plain


@pytest.mark.parametrize("policy", ["keydiff", "h2o", "caote:snapkv:passes=2"])
def test_evicting_decoding_through_the_lean_forward(policy):
    """Attention-scored policies read the queries the lean forward records (QueryCapture.record); two-pass SnapKV
    keeps the first pass's window queries from it."""
    target = tiny_model("qwen3", seed=0)
    prompt = list(range(3, 43))
    outs = {forward: speculant.generate(target, prompt, max_new_tokens=16, eos_token_id=[], kv_policy=policy,
                                        kv_budget=12, kv_block=8, forward=forward).token_ids
            for forward in ("lean", "model")}
    assert outs["lean"] == outs["model"]


def test_drafter_uses_the_shared_lean_forward():
    target = tiny_model("llama", seed=0, vocab_size=96)
    draft = perturbed(target, 0.05, seed=2)
    prompt = [3, 4, 5, 6]
    drafter = build_drafter("chain:k=3", draft)
    lean_gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=16, eos_token_id=[])
    assert drafter._lean is llama_forward_for(draft)
    plain = build_drafter("chain:k=3", draft)
    plain.lean_forward = False
    plain_gen = speculant.generate(target, prompt, drafter=plain, max_new_tokens=16, eos_token_id=[])
    assert plain._lean is None
    # same output (lossless either way) and, on this float32 model, the same proposals: same acceptance
    assert lean_gen.token_ids == plain_gen.token_ids
    assert lean_gen.stats.accepted_hist == plain_gen.stats.accepted_hist


def test_fusing_under_inference_mode_leaves_a_trainable_model():
    model = tiny_model("llama")
    with torch.inference_mode():
        speculant.generate(model, [3, 4, 5], max_new_tokens=2, eos_token_id=[])
    assert llama_forward_for(model) is not None
    model.train()
    loss = model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_a_model_with_a_built_lean_forward_is_freed_and_copies_start_without_it():
    """The built lean forward lives on the model (a cycle the collector frees), never in a process-wide table that
    would keep every model ever decoded alive; a deep copy builds its own."""
    import gc
    import weakref

    model = tiny_model("llama", seed=3)
    lean = llama_forward_for(model)
    assert lean is not None and llama_forward_for(model) is lean  # built once
    twin = copy.deepcopy(model)
    assert llama_forward_for(twin) is not lean and llama_forward_for(twin).model is twin
    gone = weakref.ref(model)
    del model, lean
    gc.collect()
    assert gone() is None
