"""KV eviction inside ``speculant.generate``: composes with every drafter, bounded memory, clear errors.

(The policies, the budgeted cache and block-wise prefill themselves are tested in test_kv.py.)
"""

from __future__ import annotations

import pytest
import torch
from helpers import record_caches

import speculant
import speculant.kv.budget
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import perturbed, tiny_model

VOCAB = 96
PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]
SPECS = ["ar", "chain:k=3", "specinfer:width=2:depth=2", "spectr:width=2:depth=2", "rsd-c:branching=2/1",
         "rsd-s:width=2:depth=2", "tree:budget=4:topk=2:depth=2", "mask-probe:masks=2:tree=2/1", "lookup:ngram=2:k=3"]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    return target, perturbed(target, scale=0.05, seed=3)


@pytest.mark.parametrize("policy", ["keydiff", "caote:h2o"])
@pytest.mark.parametrize("spec", SPECS)
def test_budget_above_length_changes_nothing(pair, spec, policy):
    """With a budget the sequence never exceeds, eviction is a no-op: identical tokens to the full cache,
    through block-wise prefill, explicit positions and (for attention policies) query capture."""
    target, draft = pair
    full = speculant.generate(target, PROMPT, drafter=build_drafter(spec, draft), max_new_tokens=20,
                              eos_token_id=[])
    kv = speculant.generate(target, PROMPT, drafter=build_drafter(spec, draft), max_new_tokens=20,
                            eos_token_id=[], kv_policy=policy, kv_budget=100, kv_block=16)
    assert kv.token_ids == full.token_ids


@pytest.mark.parametrize("spec", SPECS)
def test_small_budget_bounds_the_cache_with_every_drafter(pair, spec, monkeypatch):
    caches = record_caches(monkeypatch, speculant.kv.budget, "BudgetCache")
    target, draft = pair
    budget, block = 12, 8
    gen = speculant.generate(target, PROMPT, drafter=build_drafter(spec, draft), max_new_tokens=24,
                             eos_token_id=[], kv_policy="keydiff", kv_budget=budget, kv_block=block,
                             temperature=1.0, seed=0)
    assert len(gen.token_ids) == 24
    (cache,) = caches
    per_token = cache.layers[0].keys.shape[1] * cache.layers[0].keys.shape[-1] * 4 * 2 * len(cache.layers)
    # the prompt (40 tokens) is > 3x the budget; live KV never exceeded budget + max(block, one step's inputs)
    assert cache.layers[0].length <= budget
    assert cache.peak_nbytes <= (budget + max(block, 1 + 8 + 8 * 2)) * per_token
    assert cache.next_position == len(PROMPT) - 1 + 24  # original positions kept counting


def test_kv_errors(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="needs both kv_policy and kv_budget"):
        speculant.generate(target, PROMPT, kv_policy="keydiff")
    with pytest.raises(ValueError, match="kv_budget"):
        speculant.generate(target, PROMPT, kv_policy="keydiff", kv_budget=0)
    with pytest.raises(ValueError, match="unknown"):
        speculant.generate(target, PROMPT, kv_policy="nope", kv_budget=8)


@pytest.mark.parametrize("policy", ["h2o", "caote:h2o"])
def test_h2o_keeps_its_recent_window_inside_generate(pair, policy, monkeypatch):
    """The engine's evictions pass the budget to the policy: H2O keeps the latest half of it (int(0.5 * 12) = 6
    consecutive positions ending at the last committed token) next to its heavy hitters."""
    caches = record_caches(monkeypatch, speculant.kv.budget, "BudgetCache")
    target, draft = pair
    gen = speculant.generate(target, PROMPT, drafter=build_drafter("chain:k=3", draft), max_new_tokens=16,
                             eos_token_id=[], kv_policy=policy, kv_budget=12, kv_block=8)
    assert len(gen.token_ids) == 16
    (cache,) = caches
    end = cache.next_position
    for layer in range(len(cache.layers)):
        pos = cache.positions(layer)
        assert pos.shape[-1] == 12
        assert (pos[..., -6:] == torch.arange(end - 6, end)).all()


def test_decoding_evicts_in_batches_within_budget_plus_block(pair, monkeypatch):
    """While decoding, verified tokens fill the block's room beyond the budget (block - STEP_ROOM) and are then
    evicted back to the budget in one go: far fewer evictions than steps, the live cache within budget + block."""
    caches = record_caches(monkeypatch, speculant.kv.budget, "BudgetCache")
    calls = []
    evict = speculant.kv.budget.evict
    monkeypatch.setattr(speculant.kv.budget, "evict", lambda cache, *a, **k: calls.append(cache.length)
                        or evict(cache, *a, **k))
    target, _ = pair
    budget, room = 12, 8
    block = speculant.kv.budget.STEP_ROOM + room
    gen = speculant.generate(target, PROMPT, max_new_tokens=36, eos_token_id=[], kv_policy="keydiff",
                             kv_budget=budget, kv_block=block)
    assert len(gen.token_ids) == 36
    (cache,) = caches
    decoding = calls[1:]  # the prompt (39 tokens before the root, < one block) is evicted once, at its end
    assert decoding and all(n == budget + room + 1 for n in decoding)  # each when the room overflows
    assert len(decoding) == 36 // (room + 1)  # one step per token (the root first): not once per step
    assert budget <= cache.layers[0].length <= budget + room
    per_token = cache.layers[0].keys.shape[1] * cache.layers[0].keys.shape[-1] * 4 * 2 * len(cache.layers)
    assert cache.peak_nbytes <= (budget + block) * per_token
