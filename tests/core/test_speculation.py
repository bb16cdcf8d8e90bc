"""Speculation that adapts to load (speculant.core.speculation): the forward-cost model, the goodput choice of draft
depths, and batches decoded with speculation auto / off giving the same tokens as each prompt alone."""

from __future__ import annotations

import pytest
import torch

from speculant.core.batch import Batch
from speculant.core.engine import generate, generate_batch
from speculant.core.quant import quantize_model
from speculant.core.speculation import ForwardCost, Speculation, _Profile, row_cost
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import perturbed, tiny_model

VOCAB = 96


class _Dear(ForwardCost):
    """Each row multiplies a forward's cost by 10, whatever is measured: a draft row never pays, whatever its
    acceptance and whatever the other rows of the forward (with a cost linear in the rows, a well-accepted draft row
    can still raise the goodput of a forward that other sequences' drafts fill)."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def __call__(self, rows: int) -> float:
        return 10.0 ** rows


class _Flat(_Dear):
    """A second a forward, whatever its rows and whatever is measured: drafting pays."""

    def __call__(self, rows: int) -> float:
        return 1.0


def _cost(points: dict[int, float]) -> ForwardCost:
    cost = ForwardCost()
    for rows, seconds in points.items():
        cost.observe(rows, seconds)
    return cost


def test_the_forward_cost_interpolates_and_extrapolates_what_it_measured():
    cost = _cost({1: 1.0, 4: 1.0, 8: 1.4, 16: 2.4})
    assert cost(4) == 1.0 and cost(6) == pytest.approx(1.2) and cost(12) == pytest.approx(1.9)
    assert cost(32) == pytest.approx(4.4)  # the last two points' line
    assert _cost({5: 2.0})(40) == 2.0  # one point: flat until measured otherwise
    assert ForwardCost()(3) == 1.0 and not ForwardCost().known
    running = _cost({4: 1.0})
    for _ in range(60):
        running.observe(4, 3.0)
    assert running(4) == pytest.approx(3.0, rel=0.01)  # recent observations weigh most


def test_goodput_drafts_deep_when_rows_are_free_and_not_when_they_are_dear():
    good, poor = _Profile(0.9, 4, 1.0, 0.0), _Profile(0.2, 4, 1.0, 0.0)
    flat = Speculation("auto", _cost({1: 1.0, 32: 1.0}))
    assert flat.depths([good, poor]) == [4, 4]  # free rows: full depth even at low acceptance
    linear = Speculation("auto", _cost({1: 1.0, 2: 2.0}))  # every row costs a whole forward
    assert linear.depths([good, poor]) == [0, 0]
    middle = Speculation("auto", _cost({1: 1.0, 9: 2.0}))  # 1/8 forward per row
    k = middle.depths([good, poor])
    assert k[0] >= 3 and k[1] <= 1  # the well-predicted sequence drafts deeper
    # a drafter's own cost counts too: an expensive drafter drafts less
    costly = _Profile(0.9, 4, 1.0, 0.5)
    assert flat.depths([costly])[0] < 4
    # a gain within the cost model's error is not taken: one level at acceptance 0.5 promises 1.5 tokens for 1.47
    # forwards (+2%): none; for 1.4 forwards (+7%): one
    assert flat.depths([_Profile(0.5, 1, 1.0, 0.47)]) == [0]
    assert flat.depths([_Profile(0.5, 1, 1.0, 0.40)]) == [1]
    with pytest.raises(ValueError, match="auto, on, off"):
        Speculation("sometimes")


def test_calibration_measures_the_target():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    cost = ForwardCost()
    cost.calibrate(row_cost(target), rows=(1, 4), repeats=1)
    assert cost.known and cost(1) > 0 and cost(4) > 0


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_adaptive_and_no_speculation_decode_the_same_tokens(mode):
    target = quantize_model(tiny_model("qwen2", seed=0, vocab_size=VOCAB), "q4")
    draft = quantize_model(perturbed(tiny_model("qwen2", seed=0, vocab_size=VOCAB), 0.05, seed=2), "q4")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14)]
    specs = ["chain:k=4", "specinfer:width=2:depth=3", "lookup"]
    runs = [generate(target, p, drafter=build_drafter(s, None if s == "lookup" else draft), max_new_tokens=20,
                     eos_token_id=[]) for p, s in zip(prompts, specs)]
    alone = [g.token_ids for g in runs]
    # auto: rows that cost as much as a forward each: after the first step nobody drafts
    batch = Batch(target, speculation=Speculation(mode, _Dear()))
    got = [batch.add(p, build_drafter(s, None if s == "lookup" else draft), 20, eos_token_id=[])
           for p, s in zip(prompts, specs)]
    while len(batch):
        batch.step()
    results = [batch.result(i) for i in got]
    assert [r.token_ids for r in results] == alone
    drafted = [r.stats.draft_tokens for r in results]
    if mode == "off":
        assert drafted == [0, 0, 0]
    else:  # only the measuring drafts: the first two steps' and a probe every 8 steps
        assert sum(drafted) < sum(g.stats.draft_tokens for g in runs) / 2 and max(drafted) > 0
        assert results[0].stats.target_calls > 10  # mostly plain decoding
        # chain:k=4: two uncapped proposals (4 tokens each), then probes one level past its plan of none (1 token)
        probes = (results[0].stats.target_calls - 3) // 8
        assert probes >= 1 and drafted[0] == 2 * 4 + probes


def test_a_seeded_sampled_request_keeps_its_depth_and_its_draws():
    """Sampling draws depend on how deep a step drafted: a seeded request keeps its method's depth under auto (so the
    seed reproduces its output whatever the load), an unseeded one follows the load."""
    target = quantize_model(tiny_model("llama", seed=0, vocab_size=VOCAB), "q4")
    draft = quantize_model(perturbed(tiny_model("llama", seed=0, vocab_size=VOCAB), 0.05, seed=2), "q4")
    kwargs = dict(max_new_tokens=16, temperature=0.8, eos_token_id=[])
    want = generate(target, [3, 4, 5], drafter=build_drafter("chain:k=3", draft), seed=7, **kwargs).token_ids
    batch = Batch(target, speculation=Speculation("auto", _Dear()))  # drafting never pays
    seeded = batch.add([3, 4, 5], build_drafter("chain:k=3", draft), seed=7, **kwargs)
    free = batch.add([3, 4, 5], build_drafter("chain:k=3", draft), **kwargs)
    while len(batch):
        batch.step()
    assert batch.result(seeded).token_ids == want
    pinned, loose = batch.result(seeded).stats, batch.result(free).stats  # (the unseeded draws vary run to run)
    assert pinned.depth_reached[0] >= pinned.target_calls - 1  # drafted at every step that could commit a draft
    assert loose.depth_reached[0] <= loose.target_calls // 2  # only its probes


def test_generate_batch_takes_the_mode():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft = perturbed(tiny_model("llama", seed=0, vocab_size=VOCAB), 0.05, seed=2)
    out = generate_batch(target, [[3, 4, 5], [6, 7]], [build_drafter("chain:k=3", draft), None], max_new_tokens=6,
                         speculation="off", eos_token_id=[])
    assert all(r.stats.draft_tokens == 0 for r in out)
    with pytest.raises(ValueError, match="speculation must be one of"):
        generate_batch(target, [[3, 4]], speculation="maybe")


def test_shared_draft_forwards_make_drafting_cheaper_per_sequence():
    """Four sequences of one draft model whose draft level costs half a target forward: drafting alone (each
    sequence's levels its own forwards) pays for fewer levels than drafting in shared forwards (one forward per
    level for all four), where all four draft to the same depth; sequences of different draft models do not share."""
    flat = Speculation("auto", _cost({1: 1.0, 32: 1.0}))
    same = [_Profile(0.8, 4, 1.0, 0.5, model=1) for _ in range(4)]
    alone, shared = flat.depths(same), flat.depths(same, shared=True)
    assert sum(shared) > sum(alone) and len(set(shared)) == 1 and shared[0] >= 2
    mixed = [_Profile(0.8, 4, 1.0, 0.5, model=m) for m in range(4)]
    assert flat.depths(mixed, shared=True) == flat.depths(mixed)
    modelless = [_Profile(0.8, 4, 1.0, 0.5, model=None) for _ in range(4)]  # lookup: no draft model to share
    assert flat.depths(modelless, shared=True) == flat.depths(modelless)
    # a shared level costs the model's slowest per-level figure: a cheap sequence gets no deeper levels for free
    slow, cheap = _Profile(0.9, 4, 1.0, 0.4, model=1), _Profile(0.5, 4, 1.0, 0.01, model=1)
    k = flat.depths([slow, cheap], shared=True)
    assert k[1] <= max(k[0], 1)
    # a sequence fixed at depth 4 (probing) already pays for four shared levels: the others draft as deep for free
    probe = _Profile(0.8, 4, 1.0, 0.5, model=1)
    assert flat.depths(same[:3], fixed=[probe], shared=True) == [4] * 3


def _decode(batch: Batch, prompt: list[int], drafter, tokens: int = 24):
    index = batch.add(prompt, drafter, tokens, eos_token_id=[])
    while len(batch):
        batch.step()
    return batch.result(index)


def test_a_new_sequence_starts_drafting_only_where_it_pays_for_the_drafts_prefill():
    """A drafter's first proposal feeds the whole context to the draft model: under auto a sequence starts drafting
    only when its draft model's earlier sequences measured enough gain to pay that prefill over the tokens it may
    still commit. The first sequence of a model always starts (nothing measured), and one after eight turned down
    (fresh figures), then after sixteen (the wait doubles); outputs never change."""
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft = perturbed(tiny_model("llama", seed=0, vocab_size=VOCAB), 0.05, seed=2)
    prompt = [3, 4, 5, 6, 7]
    want = generate(target, prompt, max_new_tokens=24, eos_token_id=[]).token_ids

    dear = Batch(target, speculation=Speculation("auto", _Dear()))  # a draft row never pays
    runs = [_decode(dear, prompt, build_drafter("chain:k=3", draft)) for _ in range(27)]
    assert all(r.token_ids == want for r in runs)
    drafted = [i for i, r in enumerate(runs) if r.stats.draft_tokens > 0]
    # the first measures (its first proposal and the re-probes); the next seven decode plainly throughout; the
    # eighth turned down starts at its next step (fresh figures), and the count starts again, twice as long
    assert drafted == [0, 8, 24]

    flat = Speculation("auto", _Flat())
    batch = Batch(target, speculation=flat)
    _decode(batch, prompt, build_drafter("chain:k=3", draft))
    pool = next(iter(flat._pools.values()))
    assert pool.reached > 0 and pool.level_s is not None and pool.start_s_per_token is not None
    assert pool.length == 24  # its last step counted too (observed as it finished)
    pool.explore_after, pool.refused = 32, 40  # as after two explorations, an exploration due
    again = _decode(batch, prompt, build_drafter("chain:k=3", draft))
    assert again.token_ids == want and again.stats.depth_reached[0] >= again.stats.target_calls - 1
    # started by the rule (tried first), not as an exploration: drafting pays again, explorations at the first
    # rate, counted anew (as an exploration the wait would have doubled to 64)
    assert pool.explore_after == 8 and pool.refused == 0
    # a prefill dearer than what drafting can save over 24 tokens (at most ~0.7 s each): plain decoding throughout
    pool.start_s_per_token = 10.0
    late = _decode(batch, prompt, build_drafter("chain:k=3", draft))
    assert late.token_ids == want and late.stats.draft_tokens == 0
    # the horizon: at most what the model's sequences committed (24 here), however many tokens a request allows
    assert not flat._starts(_waiting(target, draft, prompt, 400), [], [], False)
    pool.length = 1000.0  # long answers: 400 tokens to go pay for the same prefill, 2 do not
    assert flat._starts(_waiting(target, draft, prompt, 400), [], [], False)
    assert not flat._starts(_waiting(target, draft, prompt, 2), [], [], False)


class _KnownDear(_Dear):
    """:class:`_Dear` as a batch that has measured its forwards: no draft row can pay, and the planner knows it."""

    known = True


def test_no_probe_or_exploration_where_drafting_could_not_pay_at_any_acceptance():
    """Probes (one level past the plan every few steps) and explorations (a turned-down sequence started for fresh
    figures) measure acceptance and costs; once the target's forward costs are known and not even an acceptance of
    0.95 could make a draft row pay, neither is made: the first sequence drafts its measuring proposals only, the
    others never start (with the costs unknown, as in the test above, they do); outputs never change."""
    from speculant.core.speculation import _OPTIMISTIC

    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft = perturbed(tiny_model("llama", seed=0, vocab_size=VOCAB), 0.05, seed=2)
    prompt = [3, 4, 5, 6, 7]
    want = generate(target, prompt, max_new_tokens=24, eos_token_id=[]).token_ids
    batch = Batch(target, speculation=Speculation("auto", _KnownDear()))
    runs = [_decode(batch, prompt, build_drafter("chain:k=3", draft)) for _ in range(12)]
    assert all(r.token_ids == want for r in runs)
    assert [i for i, r in enumerate(runs) if r.stats.draft_tokens > 0] == [0]
    assert runs[0].stats.draft_tokens <= 2 * 3  # its first two proposals (filling its cache, then measuring)
    # the rule itself: at 0.95 one row a whole forward never pays; at half a forward a row, a poor drafter does not
    # draft, but its probe could pay (its own acceptance is what the probe measures)
    poor = _Profile(0.3, 3, 1.0, 0.0)
    assert not Speculation("auto", _cost({1: 1.0, 2: 2.0}))._could_pay(poor, [], False)
    middle = Speculation("auto", _cost({1: 1.0, 3: 2.0}))
    assert middle.depths([poor]) == [0] and middle._could_pay(poor, [], False)
    assert Speculation("auto")._could_pay(poor, [], False)  # nothing measured: measure
    # draft forwards shared: drafting could pay for a sequence only together with its model's others (whose own
    # acceptance keeps them at 0 now): free rows, a shared level 0.3 of a forward
    flat = Speculation("auto", _cost({1: 1.0, 32: 1.0}))
    others, me = [_Profile(0.4, 3, 1.0, 0.3, model=1) for _ in range(3)], _Profile(0.1, 3, 1.0, 0.3, model=1)
    assert flat.depths(others + [me], shared=True) == [0] * 4
    assert not flat._could_pay(me, [(p, 0) for p in others], False)
    assert flat._could_pay(me, [(p, 0) for p in others], True)
    assert _OPTIMISTIC > 0.88  # above the 1.5B sibling's measured per-level acceptance


def _waiting(target, draft, prompt, tokens: int):
    """A sequence added to a throwaway batch, prefilled, that has not drafted yet."""
    batch = Batch(target, speculation="off")
    index = batch.add(prompt, build_drafter("chain:k=3", draft), tokens, eos_token_id=[])
    seq = batch._sequences[index]
    assert seq.draft_start is None
    return seq


def test_first_proposals_in_one_shared_step_divide_its_time_by_all_the_tokens_they_fed():
    """Two sequences starting to draft in the same shared draft forwards each timed the whole planning (both
    prefills): each records the tokens both fed, so the pooled prefill cost per token is the step's time over all
    of them."""
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    draft = perturbed(tiny_model("llama", seed=0, vocab_size=VOCAB), 0.05, seed=2)
    batch = Batch(target, speculation="on")
    short, long = [3, 4, 5], list(range(2, 40))
    for prompt in (short, long):
        batch.add(prompt, build_drafter("chain:k=2", draft), 8, eos_token_id=[])
    batch.step()
    assert batch.step_draft_forwards > 0  # the drafts ran together
    starts = [s.draft_start for s in batch._sequences.values()]
    assert [own for _, own, _, _ in starts] == [len(short), len(long)]
    # each timed the whole step: its time is divided by the tokens both fed (by its own, the short prompt's prefill
    # would read ~13x dearer per token)
    assert [fed for _, _, _, fed in starts] == [len(short) + len(long)] * 2
    # a drafter without a model (lookup) shares no forward: in the same shared step it keeps its own count
    mixed = Batch(target, speculation="on")
    middle = list(range(3, 20))
    for prompt, spec in ((short, "chain:k=2"), (long, "chain:k=2"), (middle, "lookup")):
        mixed.add(prompt, build_drafter(spec, None if spec == "lookup" else draft), 8, eos_token_id=[])
    mixed.step()
    assert mixed.step_draft_forwards > 0
    assert [s.draft_start[3] for s in mixed._sequences.values()] == [len(short) + len(long)] * 2 + [len(middle)]
