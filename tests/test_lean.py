"""The lean draft forward (drafters/lean.py) computes what transformers' forward computes, fills the same cache,
and is used only where it applies. Losslessness never depends on it (only drafts go through it); the greedy and
distribution tests of the drafters run through it for every Llama draft."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.cache import SpecCache
from speculant.drafters.lean import LeanLlama
from speculant.drafters.registry import build_drafter
from speculant.testing import perturbed, tiny_model
from speculant.tree import TreeAttention
from speculant.types import DraftTree


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_matches_transformers_on_prefill_decode_and_tree_levels(kv_heads, dtype):
    model = tiny_model("llama", seed=3, vocab_size=96, hidden=32, heads=4, kv_heads=kv_heads, dtype=dtype)
    lean = LeanLlama.build(model)
    assert lean is not None
    ours, ref = SpecCache(2, capacity=8), SpecCache(2, capacity=8)  # small: the buffers must grow too
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    gen = torch.Generator().manual_seed(0)

    def check(ids, positions=None, mask=None):
        got = lean(ids, ours, positions, mask)
        with torch.no_grad():
            want = model.model(input_ids=ids, past_key_values=ref, position_ids=positions, attention_mask=mask,
                               use_cache=True).last_hidden_state
        torch.testing.assert_close(got, want, **tol)
        for a, b in zip(ours.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, **tol)
            torch.testing.assert_close(a.values, b.values, **tol)

    check(torch.randint(0, 96, (1, 7), generator=gen))  # prefill, causal
    check(torch.randint(0, 96, (1, 1), generator=gen))  # one token
    check(torch.randint(0, 96, (1, 3), generator=gen))  # a chain continuing the cache
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 1])  # a tree level: explicit mask and positions
    mask, positions = TreeAttention(dtype, model.device).build(tree, ours.get_seq_length() - 1)
    n = ours.get_seq_length()
    check(torch.tensor([tree.tokens]), positions[:, 1:], mask[:, :, 1:, : n + 5])


def test_lean_is_built_only_where_it_reproduces_the_model():
    assert LeanLlama.build(tiny_model("llama")) is not None
    for arch in ("gpt2", "qwen3", "mistral"):
        assert LeanLlama.build(tiny_model(arch)) is None, arch
    training = tiny_model("llama").train()
    assert LeanLlama.build(training) is None
    for key, value in (("attention_bias", True), ("hidden_act", "gelu"), ("rope_parameters", {"rope_type": "yarn"})):
        model = tiny_model("llama")
        setattr(model.config, key, value)
        assert LeanLlama.build(model) is None, key


def test_drafter_uses_lean_forward_and_rebuilds_after_weight_updates():
    target = tiny_model("llama", seed=0, vocab_size=96)
    draft = perturbed(target, 0.05, seed=2)
    prompt = [3, 4, 5, 6]
    drafter = build_drafter("chain:k=3", draft)
    lean_gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=16, eos_token_id=[])
    assert drafter._lean is not None
    plain = build_drafter("chain:k=3", draft)
    plain.lean_forward = False
    plain_gen = speculant.generate(target, prompt, drafter=plain, max_new_tokens=16, eos_token_id=[])
    assert plain._lean is None
    # same output (lossless either way) and, on this float32 model, the same proposals: same acceptance
    assert lean_gen.token_ids == plain_gen.token_ids
    assert lean_gen.stats.accepted_hist == plain_gen.stats.accepted_hist
    # an in-place weight update (e.g. training between generations) makes the fused weights stale: rebuilt
    first = drafter._lean
    with torch.no_grad():
        draft.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    speculant.generate(target, prompt, drafter=drafter, max_new_tokens=4, eos_token_id=[])
    assert drafter._lean is not first
    q = draft.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(drafter._lean.layers[0][1][: q.shape[0]], q)
