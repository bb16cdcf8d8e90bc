"""Chunked prefill in the batch (``Batch(prefill_chunk=N)``): a prompt joining running sequences enters the cache N
tokens per step inside the step's forward; the running sequences emit tokens every step meanwhile, and every
sequence decodes as it does alone (quantized weights: the joining sequence's first logits are the bits of a whole
prefill), with a reused prefix, feature drafters, others finishing or cancelled meanwhile; sampling keeps the
target's distribution (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculant.core.batch import Batch
from speculant.core.engine import generate
from speculant.core.prefix_cache import PrefixCache
from speculant.core.types import SamplingParams
from speculant.drafters.registry import build_drafter
from speculant.kv import resolve_eviction
from speculant.tiny_models import perturbed, tiny_model
from helpers import N_FAST
from test_batch import VOCAB, _drafter, _pair
from test_sampling_distribution import BATCH, PASS_P, PROMPT, exact_joint, pvalues
from test_sampling_distribution import VOCAB as FIVE

RUNNERS = ([5, 9, 11, 3], [7, 8, 9, 10, 11, 12], [40, 41, 2])
RUNNER_SPECS = ("chain:k=3", None, "specinfer:width=2:depth=2")


def _long(n: int = 60, seed: int = 1) -> list[int]:
    """A prompt of ``n`` tokens (at most attention.MAX_ROWS: a whole prefill of it also attends row by row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n - n // 4,), generator=g).tolist()
    return ids + ids[: n // 4]


def _join(target, draft, chunk: int, spec="chain:k=3", budgets=(40, 40, 40), warm: int = 2, prompt=None,
          prefixes=None, eos=()):
    """Runners decode ``warm`` steps, then the long prompt joins with ``chunk``; returns the batch, the runners'
    and the joiner's indices, and per step (after the join) the set of sequences with an event and whether the
    joiner was still prefilling before it."""
    batch = Batch(target, prefill_chunk=chunk, prefixes=prefixes)
    runners = [batch.add(p, _drafter(s, draft), n, eos_token_id=list(eos))
               for p, s, n in zip(RUNNERS, RUNNER_SPECS, budgets)]
    for _ in range(warm):
        batch.step()
    joiner = batch.add(prompt or _long(), _drafter(spec, draft), 20, eos_token_id=list(eos))
    steps = []
    while len(batch):
        filling = joiner in batch.active and batch._sequences[joiner].prefilling
        steps.append(({e.sequence for e in batch.step()}, filling))
    return batch, runners, joiner, steps


def _alone(target, draft, prompt, spec, n, eos=()):
    return generate(target, prompt, drafter=_drafter(spec, draft), max_new_tokens=n, eos_token_id=list(eos))


@pytest.mark.parametrize("arch, kind, dtype", [("llama", "q4", torch.float32), ("qwen2", "none", torch.float32),
                                               ("llama", "q8", torch.bfloat16)])
def test_a_long_prompt_joins_in_chunks_and_every_sequence_decodes_as_alone(arch, kind, dtype):
    target, draft = _pair(arch, kind, dtype)
    batch, runners, joiner, steps = _join(target, draft, 8)
    for i, p, s in zip(runners, RUNNERS, RUNNER_SPECS):
        assert batch.result(i).token_ids == _alone(target, draft, p, s, 40).token_ids, s
    got = batch.result(joiner)
    assert got.token_ids == _alone(target, draft, _long(), "chain:k=3", 20).token_ids
    filling = [events for events, f in steps if f]
    assert len(filling) == -(-59 // 8)  # 59 prompt tokens before the root, 8 per step
    assert all(set(runners) <= events and joiner not in events for events in filling)  # nobody waits
    assert got.stats.prefill_s > 0


@pytest.mark.parametrize("fold", [True, False])
def test_quantized_chunks_give_the_bits_of_a_whole_prefill(fold):
    """The joining sequence's first verification logits are equal bit for bit, chunked or whole, the chunks folded
    into the step's forward or in a forward of their own (``fold_chunks``)."""
    target, draft = _pair("llama", "q4")
    firsts = []
    for chunk in (0, 8, 5):
        batch = Batch(target, prefill_chunk=chunk)
        batch.fold_chunks = fold
        batch.add(RUNNERS[0], None, 50, eos_token_id=[])
        batch.step()
        joiner = batch.add(_long(), None, 4, eos_token_id=[])
        seq = batch._sequences[joiner]
        while seq.stats.target_calls == 0:
            batch.step()
        firsts.append(seq.state.last_logits)  # [1, V]
    assert torch.equal(firsts[0], firsts[1]) and torch.equal(firsts[0], firsts[2])


@pytest.mark.parametrize("spec", ["chain:k=3", "specinfer:width=2:depth=2", "chain:k=3:window=24"])
def test_the_draft_model_reads_the_prompt_chunk_by_chunk_too(spec):
    """A draft model reads the joining prompt at the target's pace (``Drafter.prefill`` after each chunk), so its
    first proposal feeds only the root instead of the whole prompt at once (which would stall every running stream
    for a whole draft prefill); outputs as alone."""
    target, draft = _pair("llama", "q4")
    batch = Batch(target, prefill_chunk=8)
    batch.add(RUNNERS[0], None, 60, eos_token_id=[])
    batch.step()
    drafter = _drafter(spec, draft)
    joiner = batch.add(_long(), drafter, 20, eos_token_id=[])
    seq = batch._sequences[joiner]
    cached = []
    while seq.prefilling:
        batch.step()
        cached.append(drafter._n_cached)
    window = 24 if "window" in spec else len(_long())
    assert seq.stats.draft_calls == 0  # reading the prompt is prefill, not draft calls
    assert len(set(cached)) > 2 and all(0 <= b - a <= 8 for a, b in zip([0] + cached, cached))  # chunk by chunk
    assert drafter._n_cached == min(window, len(_long())) - 1  # all but the root, before the first proposal
    while joiner in batch.active:
        batch.step()
    assert batch.result(joiner).token_ids == _alone(target, draft, _long(), spec, 20).token_ids


def test_feature_drafters_read_the_target_states_of_every_chunk():
    """A feature (EAGLE-style) drafter reads the target's states of every prompt token, a lower layer's too: the
    chunks hand them over in order, as one prefill does."""
    from speculant.drafters.feature import FeatureDrafter
    from speculant.models.attached import build_attached

    target = tiny_model("llama", seed=2, vocab_size=VOCAB)
    tapped = build_attached(target, [0], features=True, taps=[0])
    with torch.no_grad():
        for p in tapped.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    want = generate(target, _long(), drafter=FeatureDrafter(tapped, k=2), max_new_tokens=20, eos_token_id=[])
    batch = Batch(target, prefill_chunk=7)
    batch.add(RUNNERS[0], None, 60, eos_token_id=[])
    batch.step()
    joiner = batch.add(_long(), FeatureDrafter(tapped, k=2), 20, eos_token_id=[])
    assert batch._sequences[joiner].prefilling
    while joiner in batch.active:
        batch.step()
    got = batch.result(joiner)
    assert got.token_ids == want.token_ids and got.stats.draft_tokens > 0


def test_a_reused_prefix_then_chunks_and_the_blocks_are_stored_as_they_complete():
    target, draft = _pair("llama", "q4")
    prompt = _long()
    pc = PrefixCache(1 << 26, block=8)
    generate(target, prompt[:20], max_new_tokens=2, prefix_cache=pc)  # stores 2 blocks of the prompt
    batch, runners, joiner, steps = _join(target, draft, 8, prefixes=pc)
    got = batch.result(joiner)
    assert got.stats.prompt_cached_tokens == 16
    assert sum(f for _, f in steps) == -(-(59 - 16) // 8)
    assert got.token_ids == _alone(target, draft, prompt, "chain:k=3", 20).token_ids
    assert pc.cached(target, prompt) >= 56  # every block of the prompt, stored chunk by chunk


def test_others_ending_meanwhile_and_a_batch_left_prefilling_alone():
    """Runners end by their budgets and a stop token while the prompt joins; once nobody decodes the rest of the
    prompt goes in at once (one step), and every output is as alone."""
    target, draft = _pair("llama", "q4")
    batch, runners, joiner, steps = _join(target, draft, 4, budgets=(3, 5, 4), warm=1, eos=(7,))
    for i, p, s, n in zip(runners, RUNNERS, RUNNER_SPECS, (3, 5, 4)):
        assert batch.result(i).token_ids == _alone(target, draft, p, s, n, eos=(7,)).token_ids
    assert batch.result(joiner).token_ids == _alone(target, draft, _long(), "chain:k=3", 20, eos=(7,)).token_ids
    filling = [events for events, f in steps if f]
    assert 1 < len(filling) < -(-59 // 4)  # chunks while runners decoded, then the rest at once
    assert filling[-1] == set()


def test_a_joining_sequence_cancelled_while_prefilling_and_the_others_go_on():
    target, draft = _pair("llama", "q4")
    batch = Batch(target, prefill_chunk=8)
    runner = batch.add(RUNNERS[0], _drafter("chain:k=3", draft), 30, eos_token_id=[])
    batch.step()
    joiner = batch.add(_long(), _drafter("chain:k=3", draft), 20, eos_token_id=[])
    batch.step()
    cancelled = batch.cancel(joiner)
    assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == []
    while len(batch):
        batch.step()
    assert batch.result(runner).token_ids == _alone(target, draft, RUNNERS[0], "chain:k=3", 30).token_ids


def test_when_a_prompt_goes_in_at_once():
    """Alone (nobody to protect), with a KV policy (block-wise prefill), with a short rest, or with chunk 0."""
    target, draft = _pair("llama", "q4")
    batch = Batch(target, prefill_chunk=8)
    first = batch.add(_long(), None, 10, eos_token_id=[])
    assert not batch._sequences[first].prefilling
    kv = batch.add(_long(), None, 10, eos_token_id=[], kv_policy=resolve_eviction("keydiff"), kv_budget=32,
                   kv_block=8)
    assert not batch._sequences[kv].prefilling
    assert not batch._sequences[batch.add(_long(9), None, 10, eos_token_id=[])].prefilling
    assert not batch._sequences[batch.add(_long(), None, 10, eos_token_id=[], prefill_chunk=0)].prefilling
    assert batch._sequences[batch.add(_long(), None, 10, eos_token_id=[])].prefilling
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunk must be a whole number"):
            Batch(target, prefill_chunk=bad)
        with pytest.raises(ValueError, match="prefill_chunk must be a whole number"):
            batch.add(_long(), None, 10, prefill_chunk=bad)


def test_sampling_after_a_chunked_prefill_keeps_the_target_distribution():
    """Seeded sampled generations of the 5-token model, each joining a running sequence one prompt token per step
    with a chain drafter: the joint of its 3 new tokens fits the exact target joint (chi-square)."""
    target = tiny_model("llama", vocab_size=FIVE, init_std=0.2, seed=0)
    draft = perturbed(target, scale=0.3, seed=5)
    k, n = 2, N_FAST
    expected = exact_joint(target, SamplingParams(temperature=1.0), k + 1)
    counts = np.zeros([FIVE] * (k + 1))
    chunked = 0
    for start in range(0, n, BATCH):
        batch = Batch(target, prefill_chunk=1)
        runner = batch.add([1, 2], None, 400, temperature=1.0, seed=0, eos_token_id=[])
        batch.step()
        index = []
        for i in range(start, min(n, start + BATCH)):
            index.append(batch.add(PROMPT, build_drafter(f"chain:k={k}", draft), k + 1, temperature=1.0,
                                   seed=100 + i, eos_token_id=[]))
            chunked += batch._sequences[index[-1]].prefilling
        while any(i in batch.active for i in index):
            batch.step()
        batch.cancel(runner)
        for i in index:
            counts[tuple(batch.result(i).token_ids)] += 1
    assert chunked == n
    p = pvalues(counts, expected * n)
    assert min(p.values()) > PASS_P, p


def test_chunks_through_the_models_own_forward():
    """``forward="model"`` (transformers' forward, one sequence at a time): the chunks go in the same way."""
    target, draft = _pair("llama", "none")
    batch = Batch(target, forward="model", prefill_chunk=8)
    runner = batch.add(RUNNERS[0], None, 30, eos_token_id=[])
    batch.step()
    joiner = batch.add(_long(), None, 12, eos_token_id=[])
    assert batch._sequences[joiner].prefilling
    while len(batch):
        batch.step()
    assert batch.result(joiner).token_ids == _alone(target, draft, _long(), None, 12).token_ids
    assert batch.result(runner).token_ids == _alone(target, draft, RUNNERS[0], None, 30).token_ids
