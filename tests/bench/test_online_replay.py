"""``benchmarks/online_replay.py``: a greedy generation replayed from its answer gives the live generation's steps and
the observation the live :class:`ObservedDrafter` kept (what the online adapter trains and checks on)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import speculant
from speculant.core.engine import generate
from speculant.online.observed import ObservedDrafter
from speculant.online.traffic import TrafficMemory, WithTraffic
from speculant.tiny_models import perturbed, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from draft_length import draft_matches  # noqa: E402
from online_replay import observation  # noqa: E402
from traffic_replay import replay_request  # noqa: E402

VOCAB = 48


@pytest.mark.parametrize("traffic", [0, 5])
@pytest.mark.parametrize("method,k,lookup", [("chain:k=3", 3, 0), ("chain:k=2:lookup=4", 2, 4)])
def test_a_replayed_request_has_the_live_steps_and_observation(method, k, lookup, traffic):
    target = tiny_model("llama", seed=0, vocab_size=VOCAB, init_std=0.2)
    draft = perturbed(tiny_model("llama", seed=0, vocab_size=VOCAB, init_std=0.2), 0.5, seed=7)
    session = speculant.load(target=target, draft=draft, method=method)
    g = torch.Generator().manual_seed(2)
    earlier = torch.randint(2, VOCAB, (30,), generator=g).tolist()
    prompt = earlier[:-3] + torch.randint(2, VOCAB, (3,), generator=g).tolist()  # close to an earlier request
    new = 40
    live_memory, replay_memory = TrafficMemory(), TrafficMemory()
    for memory in (live_memory, replay_memory):
        memory.add(earlier + generate(target, earlier, None, max_new_tokens=new, eos_token_id=[]).token_ids)
    inner = session.drafter()
    observed = ObservedDrafter(WithTraffic(inner, live_memory, traffic) if traffic else inner, top_k=6)
    live = generate(target, prompt, observed, max_new_tokens=new, eos_token_id=[])
    answer = live.token_ids
    match = draft_matches(session, [(prompt, answer)])[0]["match"]
    calls, _, steps = replay_request(prompt, answer, match, k, lookup, replay_memory, traffic, new)
    assert calls == live.stats.target_calls and sum(s[1] for s in steps) == len(answer)
    if traffic:  # the memory's chains took part (the request is close to an earlier one)
        assert replay_request(prompt, answer, match, k, lookup, None, 0, new)[0] != calls
    want, got = observed.observation(), observation(session, prompt, answer, steps, 6)
    assert got.ids.tolist() == want.ids.tolist() and got.positions.tolist() == want.positions.tolist()
    assert got.rejected.tolist() == want.rejected.tolist() and want.rejected.any() and not want.rejected.all()
    assert got.top_ids[:, 0].tolist() == want.top_ids[:, 0].tolist()  # the top token: the answer's (greedy)
    torch.testing.assert_close(got.top_p.float(), want.top_p.float(), atol=2e-3, rtol=0)
