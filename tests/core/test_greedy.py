"""Greedy speculative decoding must be token-identical to transformers' own greedy ``generate``.

Every architecture, three acceptance regimes (all accepted, none accepted, partial), several prompts, lengths and
draft sizes, and EOS falling inside an accepted block.
"""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.tiny_models import ARCHITECTURES, perturbed, tiny_model

VOCAB = 96


def hf_greedy(model, prompt: list[int], n: int, eos=None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    if eos is not None and eos in new:  # generate pads after EOS
        new = new[: new.index(eos) + 1]
    return new


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 19)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def models(request):
    arch = request.param
    target = tiny_model(arch, seed=0, vocab_size=VOCAB)
    return arch, {
        "all": target,  # draft = target: every draft token is accepted
        "none": tiny_model(arch, seed=123, vocab_size=VOCAB),  # unrelated random draft
        "partial": perturbed(target, scale=0.08, seed=7),  # agrees often, not always
    }


@pytest.mark.parametrize("regime", ["all", "none", "partial"])
def test_greedy_matches_transformers(models, regime):
    arch, pair = models
    target, draft = pair["all"], pair[regime]
    taus = []
    for k, prompt in zip((1, 3, 5), prompts(seed=len(arch))):
        n = 33
        ref = hf_greedy(target, prompt, n)
        gen = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(draft, k=k),
                                 max_new_tokens=n, eos_token_id=[])
        assert gen.token_ids == ref, f"{arch} {regime} k={k} prompt={prompt}"
        assert gen.stats.new_tokens == n
        taus.append((k, gen.stats.acceptance_length))
    # the regime is what it claims to be, so each branch of the verifier is exercised
    for k, tau in taus:
        if regime == "all":
            assert tau >= (k + 1) * 0.85, taus
        elif regime == "none":
            assert tau < 1.25, taus
    if regime == "partial":
        assert any(1.15 < tau < k + 0.9 for k, tau in taus if k > 1), taus


@pytest.mark.parametrize("stop", [0.3, 0.6, 0.95])
def test_a_chain_that_stops_on_the_drafts_confidence_matches_transformers(models, stop):
    """``stop``: the chain ends after a token the draft gives less than ``stop``; exact, and shorter drafts."""
    arch, pair = models
    target, draft = pair["all"], pair["partial"]
    for prompt in prompts(seed=3 + len(arch)):
        ref = hf_greedy(target, prompt, 33)
        drafter = speculant.DraftModelDrafter(draft, k=5, stop=stop)
        gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=33, eos_token_id=[])
        assert gen.token_ids == ref, f"{arch} stop={stop} prompt={prompt}"
        full = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(draft, k=5),
                                  max_new_tokens=33, eos_token_id=[])
        reached = gen.stats.depth_reached  # [i]: steps that offered a draft at depth i + 1
        per_step = gen.stats.draft_tokens / (gen.stats.target_calls - 1)
        assert per_step < full.stats.draft_tokens / (full.stats.target_calls - 1), (stop, reached)
        if stop == 0.95:  # a random tiny draft is rarely that sure: mostly one token per step
            assert len(reached) < 2 or reached[1] < reached[0] / 2, reached


def test_stop_must_be_a_probability():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    for bad in (-0.1, 1.0, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="stop"):
            speculant.DraftModelDrafter(target, k=3, stop=bad)
    with pytest.raises(ValueError, match="stop"):
        speculant.build_drafter("chain:k=3:stop=1.5", target)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plain_decoding_matches_transformers(arch):
    target = tiny_model(arch, seed=3, vocab_size=VOCAB)
    for prompt in prompts(seed=11):
        assert speculant.generate(target, prompt, max_new_tokens=25, eos_token_id=[]).token_ids == hf_greedy(
            target, prompt, 25
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_eos_inside_accepted_block(arch):
    target = tiny_model(arch, seed=0, vocab_size=VOCAB)
    prompt = prompts(seed=5)[1]
    free = hf_greedy(target, prompt, 40)
    k = 4
    # an EOS that the draft (= target) proposes in the middle of a 5-token block, at its first occurrence
    j = next(i for i in range(1, 40) if i % (k + 1) not in (0, k) and free[i] not in free[:i])
    eos = free[j]
    ref = hf_greedy(target, prompt, 40, eos=eos)
    assert ref == free[: j + 1]
    streamed: list[int] = []
    gen = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(target, k=k), max_new_tokens=40,
                             eos_token_id=eos, stream=streamed.extend)
    assert gen.token_ids == ref
    assert streamed == ref
    assert gen.stats.new_tokens == len(ref)


def test_eos_from_generation_config():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    prompt = prompts(seed=5)[1]
    free = hf_greedy(target, prompt, 40)
    j = next(i for i in range(3, 40) if free[i] not in free[:i])
    target.generation_config.eos_token_id = free[j]
    gen = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(target, k=3), max_new_tokens=40)
    assert gen.token_ids == free[: j + 1]


def test_max_new_tokens_is_exact_at_every_budget():
    target = tiny_model("qwen3", seed=0, vocab_size=VOCAB)
    prompt = prompts(seed=8)[2]
    ref = hf_greedy(target, prompt, 12)
    for n in range(1, 13):
        gen = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(target, k=5),
                                 max_new_tokens=n, eos_token_id=[])
        assert gen.token_ids == ref[:n]


def test_input_forms_agree():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    prompt = prompts(seed=2)[1]
    forms = [prompt, torch.tensor(prompt), torch.tensor([prompt])]
    outs = [speculant.generate(target, f, max_new_tokens=8, eos_token_id=[]).token_ids for f in forms]
    assert outs[0] == outs[1] == outs[2]


def test_stats_are_consistent():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft = perturbed(target, scale=0.08, seed=7)
    gen = speculant.generate(target, prompts(seed=4)[2], drafter=speculant.DraftModelDrafter(draft, k=4),
                             max_new_tokens=40, eos_token_id=[])
    s = gen.stats
    assert s.new_tokens == len(gen.token_ids) == 40
    assert sum(s.accepted_hist) == s.target_calls
    # every step emits its accepted drafts plus one bonus (the last step may be cut at max_new_tokens)
    emitted = sum((m + 1) * c for m, c in enumerate(s.accepted_hist))
    assert emitted >= s.new_tokens > emitted - 5
    assert s.acceptance_length == pytest.approx(s.new_tokens / s.target_calls)
    assert all(0.0 <= a <= 1.0 for a in s.position_acceptance) and len(s.position_acceptance) == 4
    assert s.target_calls - 1 <= s.depth_reached[0] <= s.target_calls  # the last step may draft less
    assert s.draft_calls >= s.target_calls - 1 and s.wall_s > 0 and s.tokens_per_second > 0
    assert 0.0 <= s.overhead_share < 1.0
