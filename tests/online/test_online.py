"""Online speculative decoding: observation of verification, the bounded buffer, updates that keep outputs exact,
roll-back of a bad update, and state that survives a restart."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.core.engine import generate
from speculant.core.types import SamplingParams
from speculant.drafters.registry import build_drafter
from speculant.online import OnlineAdapter, OnlineBuffer, OnlineConfig, evaluation
from speculant.online.observed import Observation, ObservedDrafter
from speculant.online.trainer import distillation_loss
from speculant.tiny_models import perturbed, tiny_model

VOCAB = 64


def _pair(seed: int = 0, scale: float = 0.4):
    target = tiny_model("llama", seed=seed, vocab_size=VOCAB, init_std=0.2)
    draft = perturbed(tiny_model("llama", seed=seed, vocab_size=VOCAB, init_std=0.2), scale, seed=7)
    return target, draft


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_an_observed_drafter_changes_nothing_and_records_the_targets_verdicts():
    target, draft = _pair()
    refused = taken = 0
    for prompt in _prompts(4):
        plain = generate(target, prompt, None, max_new_tokens=24, eos_token_id=[]).token_ids
        observed = ObservedDrafter(build_drafter("chain:k=3", draft), top_k=5)
        got = generate(target, prompt, observed, max_new_tokens=24, eos_token_id=[])
        assert got.token_ids == plain
        o = observed.observation()
        assert o is not None and o.top_ids.shape == (len(o), 5) and o.top_p.dtype == torch.float16
        ids = o.ids.tolist()
        assert ids == (prompt + plain)[: len(ids)]
        # greedy: every committed token is the target's top token at its position, so the recorded top-1 is it
        assert [ids[t] for t in o.positions.tolist()] == o.top_ids[:, 0].tolist()
        assert torch.all(o.positions >= len(prompt)) and torch.all(o.top_p[:, :-1] >= o.top_p[:, 1:])
        refused, taken = refused + int(o.rejected.sum()), taken + int((~o.rejected).sum())
    assert refused > 0 and taken > 0  # refused and accepted drafts


def test_a_perfect_draft_is_never_refused():
    target, _ = _pair()
    observed = ObservedDrafter(build_drafter("chain:k=3", target))
    generate(target, [3, 4, 5], observed, max_new_tokens=20, eos_token_id=[])
    o = observed.observation()
    assert len(o) > 10 and not o.rejected.any()


def _observation(n_ids: int, n_pos: int, k: int = 4) -> Observation:
    return Observation(ids=torch.arange(n_ids, dtype=torch.int32), positions=torch.arange(1, n_pos + 1),
                       top_ids=torch.zeros(n_pos, k, dtype=torch.int32), top_p=torch.ones(n_pos, k).half(),
                       rejected=torch.ones(n_pos, dtype=torch.bool))


def test_the_buffer_stays_within_its_bound_and_holds_one_request_in_n_back():
    one = _observation(100, 50)
    buffer = OnlineBuffer(max_bytes=10 * one.nbytes, holdout_every=4)
    for _ in range(37):
        buffer.add(_observation(100, 50))
        assert buffer.nbytes <= buffer.max_bytes
    assert len(buffer) == 10 and buffer.added == 37
    assert len(buffer.held()) in (2, 3) and len(buffer.train()) + len(buffer.held()) == 10
    huge = _observation(5000, 4000)
    buffer.add(huge)  # larger than the bound alone: cut to its last positions
    assert buffer.nbytes <= buffer.max_bytes and len(buffer.train()[-1] if buffer.added % 4 else buffer.held()[-1])
    again = OnlineBuffer(max_bytes=buffer.max_bytes, holdout_every=4)
    again.load_state_dict(buffer.state_dict())
    assert len(again) == len(buffer) and again.nbytes == buffer.nbytes and again.added == buffer.added
    with pytest.raises(ValueError, match="holdout_every"):
        OnlineBuffer(holdout_every=1)


def _session(target, draft, method="chain:k=3"):
    return speculant.load(target=target, draft=draft, method=method)


def _run(adapter: OnlineAdapter, prompts, **kw) -> list[list[int]]:
    return [adapter.generate(p, max_new_tokens=24, eos_token_id=[], **kw).token_ids for p in prompts]


def test_updates_raise_agreement_and_never_change_greedy_outputs():
    target, draft = _pair(scale=0.6)
    prompts = _prompts(40, seed=5)
    plain = [generate(target, p, None, max_new_tokens=24, eos_token_id=[]).token_ids for p in prompts]
    adapter = OnlineAdapter(_session(target, draft), OnlineConfig(update_every=10, steps=30, lr=1e-2, min_held=1,
                                                                  holdout_every=4, min_positions=4))
    first = adapter.session.draft
    assert _run(adapter, prompts) == plain  # exact throughout, with updates between requests
    accepted = [h for h in adapter.history if h["accepted"]]
    assert len(adapter.history) >= 3 and accepted and adapter.version == len(accepted)
    assert all(h["agreement_after"] > h["agreement_before"] and h["z"] >= 1.64 for h in accepted)
    assert adapter.session.draft is not first and accepted[-1]["agreement_after"] > adapter.history[0][
        "agreement_before"]
    # the adapted drafter, greedy and exact on new prompts; the target's parameters never changed
    fresh = _prompts(6, seed=11)
    assert _run(adapter, fresh) == [generate(target, p, None, max_new_tokens=24, eos_token_id=[]).token_ids
                                    for p in fresh]
    assert all(not p.requires_grad for p in adapter.session.draft.parameters())


@pytest.mark.parametrize("positions", ["all", "rejected"])
def test_the_prompt_text_adds_a_next_token_loss_on_the_prompts_rows(positions):
    """prompt_weight w: an update's loss is the distillation loss plus w times the cross-entropy of the draft's
    next-token prediction over the prompt's tokens inside the training window (each row's label: the token after
    it), computed here from an independent full forward; w = 0 leaves the loss as it was."""
    target, draft = _pair(scale=0.6)
    prompt = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    observed = ObservedDrafter(build_drafter("chain:k=3", draft), top_k=8)
    generate(target, prompt, observed, max_new_tokens=24, eos_token_id=[])
    o = observed.observation()
    assert int(o.positions.min()) == len(prompt) and o.rejected.any()
    window = 30  # the window starts inside the prompt: only its last prompt rows count
    plain = OnlineConfig(positions=positions, window=window)
    weighted = OnlineConfig(positions=positions, window=window, prompt_weight=0.5)
    with torch.no_grad():
        base, total = distillation_loss(draft, o, plain), distillation_loss(draft, o, weighted)
        trained = o.positions if positions == "all" else o.positions[o.rejected]
        start, end = int(trained.max()) - window, int(trained.max())
        logits = draft(input_ids=o.ids[None, start:end].long()).logits[0].float()  # [window, V]: the forward's
        rows = torch.arange(start, len(prompt) - 1)  # rows predicting prompt tokens start + 1 .. len(prompt) - 1
        text = torch.nn.functional.cross_entropy(logits[rows - start], o.ids[rows + 1].long())
    assert len(rows) > 0 and start > 0
    torch.testing.assert_close(total, base + 0.5 * text, rtol=1e-4, atol=1e-5)
    short = OnlineConfig(positions="all", window=8, prompt_weight=0.5)
    with torch.no_grad():  # a window that starts after the prompt: no prompt rows, the distillation loss alone
        torch.testing.assert_close(distillation_loss(draft, o, short),
                                   distillation_loss(draft, o, OnlineConfig(positions="all", window=8)))
    with pytest.raises(ValueError, match="prompt_weight"):
        OnlineConfig(prompt_weight=-1.0)


def test_a_bad_update_is_rolled_back():
    target, draft = _pair(scale=0.2)
    adapter = OnlineAdapter(_session(target, draft), OnlineConfig(update_every=8, steps=5, lr=50.0, min_held=1,
                                                                  holdout_every=4, min_positions=1))
    serving = adapter.session.draft
    before = {n: p.clone() for n, p in serving.named_parameters()}
    _run(adapter, _prompts(8, seed=9))
    assert adapter.history and not adapter.history[-1]["accepted"] and adapter.version == 0
    assert adapter.history[-1]["agreement_after"] < adapter.history[-1]["agreement_before"]
    assert adapter.session.draft is serving
    assert all(torch.equal(p, before[n]) for n, p in serving.named_parameters())


@pytest.mark.parametrize("gained, lost, min_z, kept", [
    (2, 1, 1.64, False),  # agreement rose, by noise: z = 0.58
    (2, 1, 0.0, True),  # the bare "did not drop" rule keeps it
    (9, 0, 1.64, True),  # z = 3
    (0, 0, 0.0, True),  # no position changed: did not drop
    (0, 0, 1.64, False),
    (1, 3, 0.0, False),  # dropped
])
def test_the_check_keeps_an_update_only_when_its_gain_is_beyond_noise(gained, lost, min_z, kept, monkeypatch):
    """McNemar's z over the paired held-back positions: (gained - lost) / sqrt(gained + lost) >= min_z."""
    target, draft = _pair(scale=0.6)
    adapter = OnlineAdapter(_session(target, draft), OnlineConfig(update_every=4, steps=1, min_held=1,
                                                                  holdout_every=2, min_positions=1, min_z=min_z))
    serving = adapter.session.draft
    same = 20  # positions where both agree
    was = torch.tensor([True] * same + [False] * gained + [True] * lost + [False] * 5)
    now = torch.tensor([True] * same + [True] * gained + [False] * lost + [False] * 5)

    def hits(model, observations, window):  # the serving drafter first, then the candidate
        yield
        return was if model is serving else now

    monkeypatch.setattr(evaluation, "agreement_hits", hits)
    _run(adapter, _prompts(4, seed=2))
    entry = adapter.history[-1]
    assert (entry["gained"], entry["lost"]) == (gained, lost)
    assert entry["accepted"] is kept and (adapter.session.draft is not serving) is kept
    if gained + lost:
        assert entry["z"] == pytest.approx((gained - lost) / (gained + lost) ** 0.5, abs=1e-3)
    with pytest.raises(ValueError, match="min_z"):
        OnlineConfig(min_z=-1)


def test_no_update_until_enough_requests_are_held_back():
    """A round needs ``min_held`` held-back requests: on fewer its check is noise."""
    target, draft = _pair(scale=0.6)
    config = OnlineConfig(update_every=2, steps=2, lr=3e-3, holdout_every=4, min_positions=1, min_held=3)
    adapter = OnlineAdapter(_session(target, draft), config)
    for i, prompt in enumerate(_prompts(14, seed=3)):
        adapter.generate(prompt, max_new_tokens=24, eos_token_id=[])
        held = len(adapter.buffer.held())
        if held < 3:  # one request in 4 held back: none ran before the 12th request
            assert not adapter.due() and not adapter.history, (i, held)
    assert len(adapter.buffer.held()) == 3 and adapter.history
    assert all(h["held_requests"] >= 3 for h in adapter.history)
    with pytest.raises(ValueError, match="min_held"):
        OnlineConfig(min_held=0)


def test_sampling_with_an_updated_drafter_keeps_the_target_distribution():
    from test_sampling_distribution import VOCAB as V, exact_joint, pvalues, sample_counts

    target = tiny_model("llama", vocab_size=V, init_std=0.2, seed=0)
    draft = perturbed(tiny_model("llama", vocab_size=V, init_std=0.2, seed=0), 0.8, seed=7)
    adapter = OnlineAdapter(_session(target, draft), OnlineConfig(update_every=6, steps=20, lr=3e-3, min_held=1,
                                                                  holdout_every=3, min_positions=2))
    g = torch.Generator().manual_seed(13)
    for _ in range(24):
        prompt = torch.randint(0, V, (6,), generator=g).tolist()
        adapter.generate(prompt, max_new_tokens=12, eos_token_id=[], temperature=1.0, seed=int(prompt[0]))
    assert adapter.history and adapter.session.draft is not draft  # updated (the test below needs a new drafter)
    params = SamplingParams(temperature=1.0)
    counts, hist, drafted = sample_counts(target, lambda: build_drafter("chain:k=2", adapter.session.draft), params, 3,
                                          1200, seed0=77)
    assert drafted > 0
    bad = {n: p for n, p in pvalues(counts, exact_joint(target, params, 3)).items() if not p > 1e-4}
    assert not bad, f"sampled distribution differs from the target's: {bad}"


def test_the_state_survives_a_restart_and_refuses_another_model(tmp_path):
    target, draft = _pair(scale=0.6)
    # about the state, not the check: min_z=0 keeps every update whose agreement did not drop
    config = OnlineConfig(update_every=6, steps=10, lr=3e-3, holdout_every=3, min_positions=2, min_held=1, min_z=0)
    adapter = OnlineAdapter(_session(target, draft), config, state_dir=tmp_path)
    _run(adapter, _prompts(12, seed=13))
    assert adapter.version >= 1
    adapter.stop()  # saves
    trained = {n: p.clone() for n, p in adapter.session.draft.named_parameters()}
    _, fresh_draft = _pair(scale=0.6)
    resumed = OnlineAdapter(_session(target, fresh_draft), config, state_dir=tmp_path)
    assert resumed.version == adapter.version and resumed.history == adapter.history
    assert len(resumed.buffer) == len(adapter.buffer) and resumed.buffer.added == adapter.buffer.added
    assert all(torch.equal(p, trained[n]) for n, p in resumed.session.draft.named_parameters())
    prompt = [5, 6, 7, 8]
    assert resumed.generate(prompt, max_new_tokens=16, eos_token_id=[]).token_ids == generate(
        target, prompt, None, max_new_tokens=16, eos_token_id=[]).token_ids
    other = tiny_model("llama", seed=1, vocab_size=VOCAB, hidden=48)
    with pytest.raises(ValueError, match="another draft model"):
        OnlineAdapter(_session(target, other), config, state_dir=tmp_path)


def test_bad_settings_are_value_errors():
    target, draft = _pair()
    with pytest.raises(ValueError, match="online loss"):
        OnlineConfig(loss="kl")
    with pytest.raises(ValueError, match="positions"):
        OnlineConfig(positions="some")
    with pytest.raises(ValueError, match="draft model"):
        OnlineAdapter(speculant.load(target=target, method="lookup"))


def test_an_update_taken_a_step_at_a_time_is_the_whole_update():
    """work() takes one forward (and backward) of the round per call, the serving drafter unchanged until the round
    ends; the round it completes trains and checks exactly what update() does in one call."""
    config = OnlineConfig(update_every=100, steps=3, batch=2, lr=3e-3, holdout_every=3, min_positions=1, min_held=1)
    adapters = []
    for _ in range(2):
        target, draft = _pair(scale=0.6)
        adapter = OnlineAdapter(_session(target, draft), config)
        _run(adapter, _prompts(9, seed=4))
        adapter._since_update = config.update_every  # due now
        adapters.append(adapter)
    whole, stepped = adapters
    entry = whole.update()
    serving = stepped.session.draft
    assert stepped.pending()
    calls = 0
    while (done := stepped.work()) is None:
        calls += 1
        assert stepped.session.draft is serving and stepped.pending()
    assert not stepped.pending() and stepped.work() is None
    held = len(stepped.buffer.held())
    assert calls == 3 * 2 + 2 * held  # a step per training forward, then per checked request, twice; then the end
    same = ("accepted", "steps", "loss_first", "loss_last", "agreement_before", "agreement_after")
    assert {k: done[k] for k in same} == {k: entry[k] for k in same}
    for a, b in zip(whole.session.draft.parameters(), stepped.session.draft.parameters()):
        assert torch.equal(a, b)
