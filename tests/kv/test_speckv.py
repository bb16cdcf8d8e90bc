"""SpecKV (speculant/kv/speckv.py): the draft's provisional tokens are scored, never committed; their attention is
exactly the attention a full forward over prompt + provisional tokens computes; it works by name inside generate,
wrapped in CAOTE, and gives a one-line error without a draft."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.core.cache import SpecCache, cache_kwarg
from speculant.drafters.registry import build_drafter
from speculant.kv import BudgetCache, SpecKV, parse_policy, prefill_blockwise
from speculant.kv import budget as kv_budget
from speculant.tiny_models import perturbed, tiny_model

PROMPT = [3 + (i * 7) % 90 for i in range(40)]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, vocab_size=96, context=256)
    return target, perturbed(target, 0.05, seed=2)


def test_provisional_tokens_are_the_drafts_greedy_continuation(pair):
    target, draft = pair
    spec = SpecKV(lookahead=5, draft=draft)
    want = speculant.generate(draft, PROMPT + [9], max_new_tokens=4, eos_token_id=[]).token_ids
    assert spec.provisional(PROMPT, known=[9]) == [9, *want]
    assert spec.provisional(PROMPT, known=[1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5]


def test_lookahead_attention_equals_brute_force_and_leaves_the_cache_unchanged(pair):
    target, draft = pair
    spec = SpecKV(lookahead=6, draft=draft)
    cache = BudgetCache(2, capacity=64)
    with torch.no_grad():
        target(input_ids=torch.tensor([PROMPT]), **cache_kwarg(target, cache), use_cache=True)
        keys = [layer.keys.clone() for layer in cache.layers]
        attn = spec.lookahead_attention(target, cache, PROMPT, known=[9])
    assert cache.length == len(PROMPT) and cache.next_position == len(PROMPT)
    assert all(torch.equal(k, layer.keys) for k, layer in zip(keys, cache.layers))
    provisional = spec.provisional(PROMPT, known=[9])
    eager = tiny_model("llama", seed=0, vocab_size=96, context=256)
    eager.load_state_dict(target.state_dict())
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        full = eager(input_ids=torch.tensor([PROMPT + provisional]), output_attentions=True).attentions
    for layer, a in attn.items():
        brute = full[layer][:, :, -6:, : len(PROMPT)]  # the provisional rows over the prompt's columns
        torch.testing.assert_close(a, brute, atol=1e-5, rtol=1e-4)


def test_eviction_keeps_prompt_tokens_only_with_their_full_cache_values(pair):
    target, draft = pair
    for spec in ("speckv", "caote:speckv", "speckv:passes=2", "caote:speckv:passes=2:lookahead=4"):
        policy = parse_policy(spec)
        policy_core = policy if isinstance(policy, SpecKV) else policy.inner
        policy_core.draft = draft
        cache, full = BudgetCache(2, capacity=64), SpecCache(2, capacity=64)
        with torch.no_grad():
            prefill_blockwise(target, torch.tensor([PROMPT]), cache, policy, budget=12, block=16, following=[9])
            target(input_ids=torch.tensor([PROMPT]), **cache_kwarg(target, full), use_cache=True)
        assert cache.length == 12 and cache.next_position == len(PROMPT)
        for layer in cache.layers:
            assert int(layer.positions.max()) < len(PROMPT)
        # layer 0's keys depend on the token and its position only: the kept ones are the full cache's
        layer, ref = cache.layers[0], full.layers[0]
        kept = ref.keys.gather(2, layer.positions[..., None].expand(-1, -1, -1, ref.keys.shape[-1]))
        torch.testing.assert_close(layer.keys, kept)


def test_scores_come_from_the_lookahead_at_the_last_block_only(pair, monkeypatch):
    target, draft = pair
    calls = []
    original = SpecKV.lookahead_attention

    def spy(self, model, cache, prefix, known=(), **kwargs):
        calls.append((len(prefix), list(known)))
        return original(self, model, cache, prefix, known, **kwargs)

    monkeypatch.setattr(SpecKV, "lookahead_attention", spy)
    with torch.no_grad():
        prefill_blockwise(target, torch.tensor([PROMPT]), BudgetCache(2, capacity=64), SpecKV(draft=draft), 12,
                          block=16, following=[9])
        assert calls == [(40, [9])]
        calls.clear()
        prefill_blockwise(target, torch.tensor([PROMPT]), BudgetCache(2, capacity=64),
                          SpecKV(draft=draft, every_block=True), 12, block=16, following=[9])
    assert calls == [(16, []), (32, []), (40, [9])]


def test_two_passes_score_every_block_with_the_first_pass_end_queries(pair, monkeypatch):
    """passes=2: the first pass (scratch cache) ends with the observation window's and the provisional answer's
    queries; the second pass scores its blocks before the last with their plain softmax attention over the cache
    (no causal mask: they come after every cached token), its last block with a fresh lookahead; the peak KV is
    that of one pass."""
    target, draft = pair
    observers = {}
    with torch.no_grad():
        spec = SpecKV(draft=draft)
        kv_budget._prefill_pass(target, torch.tensor([PROMPT]), BudgetCache(2, capacity=64), spec,
                                12, 16, False, [9], None, None, queries_out=observers)
    heads, dim = target.config.num_attention_heads, target.config.hidden_size // target.config.num_attention_heads
    # the last block holds 8 prompt tokens (< window 16), then 16 provisional tokens
    assert sorted(observers) == [0, 1] and observers[0].shape == (1, heads, 8 + 16, dim)

    seen, looks = [], []
    original_evict, original_look = kv_budget.evict, SpecKV.lookahead_attention

    def spy_evict(cache, policy, budget, protect_last=0, attn=None):
        keys = {i: layer.keys.clone() for i, layer in enumerate(cache.layers)}
        seen.append((keys, attn))
        return original_evict(cache, policy, budget, protect_last, attn)

    def spy_look(self, model, cache, prefix, known=(), **kwargs):
        looks.append(len(prefix))
        return original_look(self, model, cache, prefix, known, **kwargs)

    monkeypatch.setattr(kv_budget, "evict", spy_evict)
    monkeypatch.setattr(SpecKV, "lookahead_attention", spy_look)
    one, two = BudgetCache(2, capacity=64), BudgetCache(2, capacity=64)
    with torch.no_grad():
        prefill_blockwise(target, torch.tensor([PROMPT]), one, SpecKV(draft=draft), 12, block=16, following=[9])
        seen.clear(), looks.clear()
        prefill_blockwise(target, torch.tensor([PROMPT]), two, SpecKV(draft=draft, passes=2), 12, block=16,
                          following=[9])
    assert looks == [40, 40] and len(seen) == 6  # 3 blocks per pass, a lookahead at each pass's last block
    scaling = target.model.layers[0].self_attn.scaling
    for keys, attn in seen[3:5]:  # the second pass's first two blocks
        for i, q in observers.items():
            k = keys[i].float().repeat_interleave(heads // keys[i].shape[1], dim=1)
            brute = torch.softmax(q.float() @ k.transpose(-1, -2) * scaling, -1)
            torch.testing.assert_close(attn[i], brute)
    assert two.peak_nbytes == one.peak_nbytes
    assert two.length == 12 and two.next_position == len(PROMPT)


def test_generate_by_name_with_a_drafter_and_errors(pair):
    target, draft = pair
    prompt = PROMPT * 2
    full = speculant.generate(target, prompt, max_new_tokens=12, eos_token_id=[]).token_ids
    # a budget above the length evicts nothing: full-cache output, provisional tokens never committed
    same = speculant.generate(target, prompt, drafter=build_drafter("chain:k=3", draft), max_new_tokens=12,
                              eos_token_id=[], kv_policy="speckv", kv_budget=500).token_ids
    assert same == full
    gen = speculant.generate(target, prompt, drafter=build_drafter("chain:k=3", draft), max_new_tokens=12,
                             eos_token_id=[], kv_policy="caote:speckv", kv_budget=24, kv_block=16)
    assert len(gen.token_ids) == 12 and gen.stats.kv_peak_bytes > 0
    with pytest.raises(ValueError, match="speckv needs a draft model"):
        speculant.generate(target, prompt, max_new_tokens=4, kv_policy="speckv", kv_budget=24)
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        SpecKV(lookahead=0)
