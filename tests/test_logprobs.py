"""Log-probabilities of the emitted tokens (``generate(..., logprobs=K)``, OpenAI's ``logprobs``/``top_logprobs``).

They come out of verification (the target's rows along the accepted path), so they must equal a plain
teacher-forced target forward over prompt + output, for accepted draft tokens and bonus tokens alike, for every
drafting method, greedy and sampled; asking for them must not change the tokens. The server serves them in
OpenAI's shapes (chat and completions, streamed and not)."""

from __future__ import annotations

import json

import pytest
import torch

import speculant
from speculant.drafters.registry import build_drafter
from speculant.testing import perturbed, tiny_model

VOCAB = 96
N = 20
TOP = 3
# the target repeats itself after this prompt (77 77 77 ...), so prompt lookup gets draft tokens accepted too
PROMPT = [3, 4]
METHODS = ["ar", "chain:k=3", "tree:budget=10:topk=3:depth=4", "rsd-c:branching=2/2/1", "specinfer:width=2:depth=3",
           "lookup"]
# float32 rounding between the engine's forward (lean, tree-masked, cached) and one plain transformers forward
ATOL, RTOL = 5e-5, 1e-5
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=40, top_p=0.95, seed=3)}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    return target, perturbed(target, scale=0.08, seed=7)  # agrees often, not always: accepted and bonus tokens


def _drafter(spec, draft):
    return None if spec == "ar" else build_drafter(spec, draft)


def teacher_forced(target, prompt: list[int], out: list[int]) -> torch.Tensor:
    """``[len(out), V]``: the target's raw log-probabilities at each output position, one plain forward."""
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + out])).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(out) - 1], dim=-1)


def check_against(target, prompt, gen, top) -> None:
    ref = teacher_forced(target, prompt, gen.token_ids)  # [E, V]
    assert [lp.token for lp in gen.logprobs] == gen.token_ids
    got = torch.tensor([lp.logprob for lp in gen.logprobs])
    want = ref.gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    for i, lp in enumerate(gen.logprobs):
        assert len(lp.top) == top
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), ref[i].topk(top).values, atol=ATOL, rtol=RTOL)
        for tok, v in lp.top:  # the ids are those values' tokens (ties aside, the same as the reference's top-k)
            assert abs(ref[i, tok].item() - v) <= ATOL + RTOL * abs(v)


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("spec", METHODS)
def test_logprobs_equal_a_teacher_forced_forward(pair, spec, mode):
    target, draft = pair
    kwargs = dict(max_new_tokens=N, eos_token_id=[], **SAMPLING[mode])
    plain = speculant.generate(target, PROMPT, drafter=_drafter(spec, draft), **kwargs)
    steps = []
    gen = speculant.generate(target, PROMPT, drafter=_drafter(spec, draft), logprobs=TOP,
                             stream=lambda ids, lps: steps.append((ids, lps)), **kwargs)
    assert plain.logprobs is None
    assert gen.token_ids == plain.token_ids  # asking for logprobs changes nothing
    assert len(gen.logprobs) == len(gen.token_ids) == N
    check_against(target, PROMPT, gen, TOP)
    # the stream got the same logprobs, step by step, with its ids
    assert [t for ids, _ in steps for t in ids] == gen.token_ids
    assert [lp for _, lps in steps for lp in lps] == gen.logprobs
    assert all([lp.token for lp in lps] == ids for ids, lps in steps)
    if spec != "ar":  # accepted draft tokens were covered, not only bonus tokens
        assert sum(gen.stats.accepted_hist[1:]) > 0, (spec, gen.stats.accepted_hist)


def test_top_zero_and_cut_steps(pair):
    """``logprobs=0``: the emitted token's logprob only; a step cut by a stop token or max_new_tokens reports the
    emitted tokens only."""
    target, draft = pair
    ref = speculant.generate(target, PROMPT, max_new_tokens=N, eos_token_id=[]).token_ids
    stop = ref[7]
    gen = speculant.generate(target, PROMPT, drafter=build_drafter("chain:k=4", target), max_new_tokens=N,
                             eos_token_id=stop, logprobs=0)
    assert gen.token_ids == ref[: ref.index(stop) + 1]
    assert all(lp.top == () for lp in gen.logprobs)
    check_against(target, PROMPT, gen, 0)
    gen = speculant.generate(target, PROMPT, drafter=build_drafter("chain:k=4", target), max_new_tokens=6,
                             eos_token_id=[], logprobs=1)
    assert len(gen.logprobs) == 6
    check_against(target, PROMPT, gen, 1)


def test_top_is_capped_at_the_vocabulary(pair):
    target, _ = pair
    gen = speculant.generate(target, PROMPT, max_new_tokens=2, logprobs=VOCAB + 50)
    assert all(len(lp.top) == VOCAB for lp in gen.logprobs)


def test_session_generate_takes_logprobs(pair):
    target, _ = pair
    session = speculant.load(target, method="lookup")
    gen = session.generate(PROMPT, max_new_tokens=8, logprobs=2, eos_token_id=[])
    check_against(target, PROMPT, gen, 2)
