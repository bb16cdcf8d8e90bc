"""Prefix caching (:mod:`speculant.core.prefix_cache`): what is stored and found, the byte budget, and that reuse
never changes an output: greedy decoding with and without reuse gives the same tokens for every kind of drafter
(quantized weights: the same bits), also when blocks are evicted while a generation runs, after a cancelled one and
for sequences decoded together; sampling keeps the target's distribution (chi-square)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from speculant.core.batch import Batch
from speculant.core.cache import SpecCache, cache_kwarg
from speculant.core.engine import generate, generate_batch, generate_steps
from speculant.core.prefix_cache import PrefixCache
from speculant.drafters.registry import build_drafter
from speculant.kv import resolve_eviction
from speculant.tiny_models import perturbed, tiny_model
from helpers import N_FAST
from test_batch import VOCAB, _drafter, _pair
from test_sampling_distribution import BATCH, FAIL_P, PASS_P, PROMPT, exact_joint, pvalues
from test_sampling_distribution import VOCAB as FIVE

V = VOCAB
SPECS = (None, "chain:k=3", "specinfer:width=2:depth=3", "lookup", "chain:k=2:lookup=4", "tree:topk=2:depth=3")


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (n,), generator=g).tolist()
    return ids + ids[: n // 3]  # some repetition: lookup finds drafts


def _filled(model, n: int, seed: int = 0) -> tuple[list[int], SpecCache]:
    """``n`` random ids and a cache holding their keys/values (one prefill)."""
    ids = _ids(n, seed)[:n]
    cache = SpecCache(len(model.model.layers))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), **cache_kwarg(model, cache), use_cache=True)
    return ids, cache


# ----------------------------------------------------------------------------------------------- the store


def test_a_prefix_is_found_block_by_block_and_restored_as_computed():
    target, _ = _pair("llama", "none")
    ids, cache = _filled(target, 45)
    pc = PrefixCache(1 << 24, block=8)
    assert pc.store(target, ids, cache) == 40  # whole blocks only
    assert len(pc) == 5 and pc.nbytes == sum(2 * layer.keys[0, :, :8].numel() * 4 for layer in cache.layers) * 5
    # the longest cached prefix, rounded down to a block; a different token ends the match at its block
    assert pc.cached(target, ids) == 40
    assert pc.cached(target, ids[:23]) == 16
    assert pc.cached(target, ids[:20] + [1] + ids[21:]) == 16
    assert pc.cached(target, [1] + ids[1:]) == 0
    fresh = SpecCache(len(target.model.layers))
    assert pc.restore(target, ids[:37], fresh) == 32
    for a, b in zip(fresh.layers, cache.layers):
        assert torch.equal(a.keys, b.keys[:, :, :32]) and torch.equal(a.values, b.values[:, :, :32])
    assert pc.stats.queried == 37 and pc.stats.hit == 32
    with pytest.raises(ValueError, match="empty cache"):
        pc.restore(target, ids, fresh)


def test_each_model_has_its_own_prefixes():
    target, draft = _pair("llama", "none")
    ids, cache = _filled(target, 32)
    pc = PrefixCache(1 << 24, block=8)
    pc.store(target, ids, cache)
    assert pc.cached(target, ids) == 32 and pc.cached(draft, ids) == 0


def test_the_budget_is_never_exceeded_and_the_least_recently_used_go_first():
    target, _ = _pair("llama", "none")
    one = _filled(target, 8, seed=0)[1].layers[0].keys.numel() * 4 * 2 * len(target.model.layers)  # bytes a block
    pc = PrefixCache(3 * one, block=8)
    a, cache_a = _filled(target, 16, seed=1)
    b, cache_b = _filled(target, 16, seed=2)
    pc.store(target, a, cache_a)  # 2 blocks
    pc.store(target, b, cache_b)  # 2 more: a's last block (the least recent leaf) goes
    assert pc.nbytes <= 3 * one and pc.peak_nbytes <= 3 * one and len(pc) == 3
    assert pc.cached(target, a) == 8 and pc.cached(target, b) == 16
    pc.restore(target, a, SpecCache(len(target.model.layers)))  # touch a: now b is the least recent
    c, cache_c = _filled(target, 8, seed=3)
    pc.store(target, c, cache_c)
    assert pc.cached(target, a) == 8 and pc.cached(target, b) == 8 and pc.cached(target, c) == 8
    assert pc.stats.evicted == 2
    # a block larger than the whole budget is not kept, and nothing fails
    tiny = PrefixCache(one // 2, block=8)
    assert tiny.store(target, a, cache_a) == 0 and len(tiny) == 0
    assert PrefixCache(0).store(target, a, cache_a) == 16 and PrefixCache(0).cached(target, a) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_a_bad_budget_or_block_is_a_one_line_error(bad):
    with pytest.raises(ValueError, match="budget must be a number of bytes"):
        PrefixCache(bad)
    with pytest.raises(ValueError, match="block must be a positive number"):
        PrefixCache(1024, block=bad if bad != 1.5 else 0)


def test_threads_store_and_restore_at_once():
    target, _ = _pair("llama", "none")
    ids, cache = _filled(target, 64)
    pc = PrefixCache(1 << 24, block=4)
    errors = []

    def work(i):
        try:
            for _ in range(20):
                pc.store(target, ids[: 8 + i * 8], cache)
                fresh = SpecCache(len(target.model.layers))
                n = pc.restore(target, ids, fresh)
                assert torch.equal(fresh.layers[0].keys, cache.layers[0].keys[:, :, :n])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pc.cached(target, ids) == 32


# ----------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind, arch, dtype", [("none", "llama", torch.float32), ("q4", "qwen2", torch.float32),
                                               ("q8", "llama", torch.bfloat16)])
def test_greedy_output_is_the_same_with_and_without_reuse(kind, arch, dtype):
    """A conversation of three turns (each prompt: the previous prompt, its answer and a new message) with every
    kind of drafter: the same tokens whether the prefixes are reused or computed; later turns reuse the earlier
    turns (target and draft model alike)."""
    target, draft = _pair(arch, kind, dtype)
    for spec in SPECS:
        pc = PrefixCache(1 << 26, block=8)
        prompt = _ids(40, 5)
        for turn in range(3):
            plain = generate(target, prompt, drafter=_drafter(spec, draft), max_new_tokens=20)
            reused = generate(target, prompt, drafter=_drafter(spec, draft), max_new_tokens=20, prefix_cache=pc)
            assert reused.token_ids == plain.token_ids, (spec, turn)
            if turn:
                assert reused.stats.prompt_cached_tokens >= (len(prompt) - 30) // 8 * 8
                if spec is not None and spec != "lookup":
                    assert reused.stats.draft_cached_tokens > 0
            prompt = prompt + plain.token_ids + _ids(6, 10 + turn)


def test_quantized_reuse_is_the_same_bits():
    """With row-independent quantized kernels a reused key/value is the very value a full prefill computes: the
    logits of the first step are equal bit for bit."""
    target, draft = _pair("llama", "q4")
    prompt = _ids(50, 3)
    pc = PrefixCache(1 << 26, block=8)
    generate(target, prompt[:30], max_new_tokens=4, prefix_cache=pc)
    firsts = []
    for cache in (None, pc):
        batch = Batch(target, prefixes=cache)
        index = batch.add(prompt, None, 2)
        batch.step()
        firsts.append(batch.result(index).stats.prompt_cached_tokens)
        firsts.append(batch._sequences[index].state.last_logits)  # [1, V]: the first step's
    assert firsts[0] == 0 and firsts[2] == 24  # prompt[:30]'s 29 prefilled tokens: 3 whole blocks
    assert torch.equal(firsts[1], firsts[3])


def test_eviction_while_generating_and_a_cancelled_generation_change_nothing():
    """A budget of a few blocks (blocks are evicted while a generation still extends its prefix) and a generation
    closed after two steps: later generations still decode exactly as without reuse."""
    target, draft = _pair("llama", "none")
    block_bytes = 2 * 2 * 8 * 8 * 4 * len(target.model.layers)  # K and V, 2 KV heads, 8 tokens, head dim 8, float32
    pc = PrefixCache(3 * block_bytes, block=8)
    prompt = _ids(60, 7)
    steps = generate_steps(target, prompt, drafter=_drafter("chain:k=3", draft), max_new_tokens=30, prefix_cache=pc)
    next(steps), next(steps)
    steps.close()
    for spec in ("chain:k=3", "specinfer:width=2:depth=3"):
        plain = generate(target, prompt, drafter=_drafter(spec, draft), max_new_tokens=30)
        reused = generate(target, prompt, drafter=_drafter(spec, draft), max_new_tokens=30, prefix_cache=pc)
        assert reused.token_ids == plain.token_ids
        assert pc.peak_nbytes <= 3 * block_bytes
    assert pc.stats.evicted > 0 and pc.stats.hit > 0


def test_sequences_decoded_together_share_a_prefix_and_decode_as_alone():
    target, draft = _pair("llama", "q4")
    system = _ids(48, 11)
    prompts = [system + _ids(5 + i, 20 + i) for i in range(4)]
    specs = ["chain:k=3", None, "specinfer:width=2:depth=3", "lookup"]
    alone = [generate(target, p, drafter=_drafter(s, draft), max_new_tokens=16) for p, s in zip(prompts, specs)]
    pc = PrefixCache(1 << 26, block=8)
    generate(target, system, max_new_tokens=2, prefix_cache=pc)  # an earlier request with the same system prompt
    together = generate_batch(target, prompts, [_drafter(s, draft) for s in specs], max_new_tokens=16,
                              prefix_cache=pc)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    # the earlier request stored the system prompt's 64 tokens but its last (the root): 7 whole blocks
    assert all(g.stats.prompt_cached_tokens >= 56 for g in together)


def test_where_reuse_cannot_apply_it_says_so_once_and_computes_as_before(caplog):
    target, draft = _pair("llama", "none")
    prompt = _ids(40, 2)
    pc = PrefixCache(1 << 26, block=8)
    generate(target, prompt, max_new_tokens=4, prefix_cache=pc)
    policy = resolve_eviction("keydiff")
    plain = generate(target, prompt, max_new_tokens=12, kv_policy=policy, kv_budget=24, kv_block=8)
    with caplog.at_level(logging.WARNING):
        with_cache = generate(target, prompt, max_new_tokens=12, kv_policy=resolve_eviction("keydiff"), kv_budget=24,
                              kv_block=8, prefix_cache=pc)
    assert with_cache.token_ids == plain.token_ids and with_cache.stats.prompt_cached_tokens == 0
    assert "not reused" in caplog.text and "KV eviction policy" in caplog.text


def test_a_batch_reuses_what_its_earlier_sequences_stored():
    target, _ = _pair("llama", "none")
    batch = Batch(target, prefixes=PrefixCache(1 << 26, block=8))
    prompt = _ids(33, 4)
    first = batch.add(prompt, None, 10)
    while len(batch):
        batch.step()
    second = batch.add(prompt + batch.result(first).token_ids + [5, 6, 7], None, 4)
    # the first held 44 + 10 - 1 tokens when it ended (every committed token but the last): 6 whole blocks
    assert batch.result(second).stats.prompt_cached_tokens == 48


# ----------------------------------------------------------------------------------------------- sampling


def _sampled_with_reuse(corrupt: bool = False):
    """p-values of seeded sampled generations of the 5-token model (a chain of 3 drafts, 4 new tokens), each after
    a first one that stored the prompt's blocks (blocks of 2 tokens, so the short prompt and the draft's context
    are reused), against the exact target joint; ``corrupt``: the stored keys are scaled (a wrong reuse)."""
    from speculant.core.types import SamplingParams

    target = tiny_model("llama", vocab_size=FIVE, init_std=0.2, seed=0)
    draft = perturbed(target, scale=0.3, seed=5)
    params = SamplingParams(temperature=1.0)
    k, n = 3, N_FAST
    expected = exact_joint(target, params, k + 1)
    counts = np.zeros([FIVE] * (k + 1))
    pc = PrefixCache(1 << 24, block=2)
    generate(target, PROMPT, build_drafter("chain:k=1", draft), max_new_tokens=2, temperature=1.0, seed=0,
             eos_token_id=[], prefix_cache=pc)  # stores the prompt's blocks, the target's and the draft's
    if corrupt:
        for block in pc._blocks.values():
            block.keys = block.keys * 3.0
    hits = 0
    for start in range(0, n, BATCH):
        seeds = list(range(start, start + BATCH))
        gens = generate_batch(target, [PROMPT] * BATCH, [build_drafter(f"chain:k={k}", draft) for _ in seeds],
                              max_new_tokens=k + 1, temperature=1.0, seed=seeds, eos_token_id=[], prefix_cache=pc)
        for gen in gens:
            counts[tuple(gen.token_ids)] += 1
            hits += gen.stats.prompt_cached_tokens > 0 and gen.stats.draft_cached_tokens > 0
    assert hits == n
    return pvalues(counts, expected * n)


def test_sampling_with_reused_prefixes_keeps_the_target_distribution():
    """The joint of the new tokens fits the exact target joint (chi-square: the joint, every pair of positions,
    the first token)."""
    p = _sampled_with_reuse()
    assert min(p.values()) > PASS_P, p


def test_negative_control_a_wrong_reused_key_is_detected():
    p = _sampled_with_reuse(corrupt=True)
    assert min(p.values()) < FAIL_P, p
