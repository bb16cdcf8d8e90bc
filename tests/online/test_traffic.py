"""The traffic memory (earlier requests' tokens drafted like prompt lookup): lookup, its bound, its state, and that
drafting from it stays exact, greedy and sampled, alone and inside online adaptation."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.core.engine import generate
from speculant.core.types import SamplingParams
from speculant.online import OnlineAdapter, OnlineConfig
from speculant.online.traffic import SCORINGS, TrafficMemory, WithTraffic
from speculant.tiny_models import perturbed, tiny_model

from helpers import sizes


def test_the_latest_occurrence_of_the_longest_suffix_is_continued_within_its_request():
    memory = TrafficMemory(ngram=3, scoring="recent")
    assert memory.continuation([1, 2, 3], 4) == []  # empty memory
    memory.add([1, 2, 3, 4, 5, 6])
    memory.add([9, 2, 3, 7, 8])
    assert len(memory) == 11 and memory.requests == 2
    assert memory.continuation([0, 2, 3], 4) == [7, 8]  # latest "2 3", and not past its request's end
    assert memory.continuation([1, 2, 3], 4) == [4, 5, 6]  # the longer suffix "1 2 3" wins over the later "2 3"
    assert memory.continuation([5, 3], 1) == [7]  # "5 3" unknown: the 1-gram "3", latest
    assert memory.continuation([8], 3) == []  # 8 ends its request: nothing followed it
    assert memory.continuation([42], 3) == []
    memory.add([8, 1])  # n-grams never span two requests
    assert memory.continuation([7, 8], 2) == [1]  # "7 8" -> the end; the 1-gram "8" -> 1 in the third request


def test_frequent_scoring_walks_what_most_often_followed_the_longest_known_suffix():
    memory = TrafficMemory(ngram=2, scoring="frequent")
    for ids in ([1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 7, 8], [1, 2, 3, 4]):
        memory.add(ids)
    recent = TrafficMemory(ngram=2, scoring="recent")
    for ids in ([1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 7, 8], [1, 2, 3, 5]):
        recent.add(ids)
    assert recent.continuation([1, 2], 2) == [3, 5]  # the latest occurrence's continuation
    # "1 2" was followed by 3 three times; "2 3" by 4 twice and 5 once; "3 4" ends its requests
    assert memory.continuation([1, 2], 4) == [3, 4]
    assert memory.continuation([0, 2], 1) == [3]  # "0 2" unknown: "2" -> 3 (3 times) over 7 (once)
    memory.add([9, 2, 7, 8])  # "2 7" twice now, "2 3" still 3 times: counts, not recency, decide
    assert memory.continuation([5, 2], 1) == [3]
    memory.add([6, 3, 5])
    assert memory.continuation([2, 3], 1) == [4]  # "2 3" -> 4 twice, 5 once: "3" alone is not consulted
    memory.add([1, 2, 3, 5])  # now a tie on "2 3" (4 twice, 5 twice): the one that reached the count last
    assert memory.continuation([2, 3], 1) == [5]
    short = TrafficMemory(ngram=3, min_ngram=2)
    short.add([1, 2, 3, 4])
    assert short.continuation([1, 2], 2) == [3, 4]  # a context shorter than ngram: its own 2-gram is found


def test_frequent_ties_go_to_the_continuation_that_reached_the_count_last():
    memory = TrafficMemory(ngram=2, min_score=0)
    for last in (7, 8, 9):
        memory.add([1, 2, last])
    assert memory.continuation([1, 2], 1) == [9]  # 7, 8, 9 once each: 9 reached 1 last
    memory.add([1, 2, 7])
    assert memory.continuation([1, 2], 1) == [7]  # 7 twice
    memory.add([1, 2, 8])
    assert memory.continuation([1, 2], 1) == [8]  # 7 and 8 twice: 8 reached 2 last
    memory.add([5, 1, 2, 9])  # the latest occurrence of "1 2" is followed by 9 (once more: 2), which ties again
    assert memory.continuation([1, 2], 1) == [9]
    memory.add([1, 2, 6])  # the latest continuation is 6 (once): not a tie with the leaders
    assert memory.continuation([1, 2], 1) == [9]


def test_frequent_chains_end_where_their_estimated_chance_falls_below_min_score():
    # each share is count / (total + 1), the chain ends where their product falls below the bound
    once = TrafficMemory(ngram=2, min_score=0.3)
    once.add([1, 2, 3, 4, 5])
    assert once.continuation([1, 2], 4) == [3]  # 1/2, then 1/4 < 0.3
    unbounded = TrafficMemory(ngram=2, min_score=0)
    unbounded.add([1, 2, 3, 4, 5])
    assert unbounded.continuation([1, 2], 4) == [3, 4, 5]  # "4 5" ends its request: nothing follows
    once.add([1, 2, 3, 4, 5])
    assert once.continuation([1, 2], 4) == [3, 4]  # 2/3, then 4/9 >= 0.3, then 8/27 < 0.3
    once.add([1, 2, 3, 4, 5])  # 3/4, 9/16, 27/64 >= 0.3
    assert once.continuation([1, 2], 4) == [3, 4, 5]
    half = TrafficMemory(ngram=2, min_score=0.5)
    half.add([1, 2, 3])
    assert half.continuation([1, 2], 2) == [3]  # exactly 1/2: kept (the bound is inclusive)
    above = TrafficMemory(ngram=2, min_score=0.51)
    above.add([1, 2, 3])
    assert above.continuation([1, 2], 2) == []  # one observation is not enough for more than 1/2


def test_the_memory_settings_share_one_default_and_bad_ones_are_refused():
    from speculant.online.traffic import MIN_SCORE, SCORINGS
    from speculant.serve.settings import TRAFFIC_SCORINGS, ServeSettings
    from speculant.serve.worker import online_config

    assert TRAFFIC_SCORINGS == SCORINGS  # the server names them without importing torch
    assert ServeSettings().online_traffic_min_score == OnlineConfig().traffic_min_score == MIN_SCORE
    assert ServeSettings().online_traffic_scoring == OnlineConfig().traffic_scoring == TrafficMemory().scoring
    custom = ServeSettings(online=True, online_every=5, online_min_held=2, online_min_z=0.5, online_traffic=6,
                           online_traffic_min_ngram=2, online_traffic_scoring="recent", online_traffic_min_score=0.3,
                           online_distill=False)
    assert online_config(custom) == OnlineConfig(update_every=5, min_held=2, min_z=0.5, traffic=6, traffic_min_ngram=2,
                                                 traffic_scoring="recent", traffic_min_score=0.3, distill=False)
    tree = ServeSettings(online=True, online_traffic=6, online_traffic_tree=12)
    assert online_config(tree) == OnlineConfig(traffic=6, traffic_tree=12)
    assert ServeSettings().online_traffic_tree == OnlineConfig().traffic_tree == 0
    for bad in (-0.1, 1.0, True, "0.5"):
        with pytest.raises(ValueError, match="min_score"):
            TrafficMemory(min_score=bad)
    with pytest.raises(ValueError, match="scoring"):
        TrafficMemory(scoring="often")
    with pytest.raises(ValueError, match="traffic_scoring"):
        OnlineConfig(traffic=8, traffic_scoring="often")
    with pytest.raises(ValueError, match="traffic_min_score"):
        OnlineConfig(traffic=8, traffic_min_score=float("nan"))


@pytest.mark.parametrize("scoring", SCORINGS)
def test_the_counts_follow_eviction_and_a_reload(scoring):
    memory = TrafficMemory(ngram=2, max_tokens=40, scoring=scoring, min_score=0)
    for i in range(30):
        memory.add([100 + i, 1, 2, 3 if i < 20 else 4])  # early requests continue "1 2" with 3, late ones with 4
    assert memory.continuation([1, 2], 1) == [4]  # the requests that had 3 are gone
    index, counts, best = {}, {}, {}
    for a, b in zip(memory._starts, memory._starts[1:] + [len(memory)]):
        memory._index_request(memory._tokens, a, b, index, counts, best)
    assert (memory._index, memory._counts, memory._best) == (index, counts, best)  # exactly what is held
    assert bool(index) == (scoring == "recent") and bool(counts) == bool(best) == (scoring == "frequent")
    again = TrafficMemory(ngram=2, max_tokens=40, scoring=scoring, min_score=0)
    again.load_state_dict(memory.state_dict())
    assert (again._index, again._counts, again._best) == (memory._index, memory._counts, memory._best)


def test_the_memory_stays_within_its_bound_and_forgets_the_oldest_requests():
    memory = TrafficMemory(ngram=2, max_tokens=100)
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        memory.add([1000 + i] + torch.randint(0, 50, (int(torch.randint(5, 30, (1,), generator=g)),),
                                              generator=g).tolist())
        assert len(memory) <= 100
    assert memory.continuation([1000], 3) == []  # the first request is gone, and so is its index
    assert memory.continuation([1059], 1) != []  # the last one is there
    held = {t for t in memory._tokens}
    assert {k[0] for k in memory._counts} <= held and memory._counts.keys() == memory._best.keys()
    assert all(sum(follow.values()) == memory._best[key][2] for key, follow in memory._counts.items())
    memory.add(list(range(500)))  # longer than the bound: its last 100 tokens
    assert len(memory) == 100 and memory.continuation([450], 2) == [451, 452]


def test_the_state_round_trips_and_bad_values_are_refused():
    memory = TrafficMemory()
    for ids in ([1, 2, 3, 4], [5, 2, 3, 9], [7, 7, 7]):
        memory.add(ids)
    again = TrafficMemory()
    again.load_state_dict(memory.state_dict())
    assert again._tokens == memory._tokens and again._starts == memory._starts
    assert (again._index, again._counts, again._best) == (memory._index, memory._counts, memory._best)
    for starts in ([0, 9, 4], [1, 4, 8], [0, 4, 11], []):
        with pytest.raises(ValueError, match="inconsistent"):
            again.load_state_dict({**memory.state_dict(), "starts": torch.tensor(starts, dtype=torch.int64)})
    with pytest.raises(ValueError, match="vocabulary"):
        again.load_state_dict(memory.state_dict(), vocab_size=8)  # the state holds token id 9
    with pytest.raises(ValueError, match="incomplete"):
        again.load_state_dict({**memory.state_dict(), "tokens": torch.tensor([1.0, 2.0])})
    with pytest.raises(ValueError, match="incomplete"):
        again.load_state_dict({"tokens": [1, 2]})
    assert again._tokens == memory._tokens  # a refused state changes nothing
    with pytest.raises(ValueError, match="max_tokens"):
        TrafficMemory(max_tokens=0)
    with pytest.raises(ValueError, match="traffic"):
        OnlineConfig(traffic=-1)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="traffic_min_ngram"):
            OnlineConfig(traffic=4, traffic_min_ngram=bad)


def test_the_memory_tree_holds_the_best_scoring_continuations_side_by_side():
    memory = TrafficMemory(ngram=2, min_score=0)
    assert memory.tree([1, 2], 3, 4) == []  # empty memory
    for ids in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 6], [1, 2, 5, 7]):
        memory.add(ids)
    # "1 2" -> 3 (3 times, score 3/5), 5 (once, 1/5); "2 3" -> 4 (twice), 6 (once): "1 2 3 4" scores 3/5 * 2/4
    assert memory.tree([1, 2], 1, 8) == [[3], [5]]  # one deep: both continuations side by side
    assert memory.tree([1, 2], 2, 2) == [[3, 4]]  # the two best nodes: 3 (0.6), then 3 4 (0.3) over 5 (0.2)
    full = memory.tree([1, 2], 3, 100)
    assert sorted(map(tuple, full)) == [(3, 4), (3, 6), (5, 7)]  # every path (4 and 6, 7 end their requests)
    assert [p[0] for p in memory.tree([1, 2], 3, 100)][0] == 3
    for budget in range(1, 6):  # at most budget nodes, each a distinct prefix of a path
        nodes = {tuple(p[:j]) for p in memory.tree([1, 2], 3, budget) for j in range(1, len(p) + 1)}
        assert len(nodes) == min(budget, 5)
    assert memory.continuation([1, 2], 3) in full  # the chain is one of the tree's paths
    bounded = TrafficMemory(ngram=2, min_score=0.25)
    for ids in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 6], [1, 2, 5, 7]):
        bounded.add(ids)
    assert bounded.tree([1, 2], 3, 100) == [[3, 4]]  # 5 (0.2) and 3 6 (0.15) fall below the bound
    recent = TrafficMemory(ngram=2, scoring="recent")
    recent.add([1, 2, 3, 4])
    assert recent.tree([1, 2], 3, 8) == [[3, 4]]  # recent scoring: its chain
    with pytest.raises(ValueError, match="budget"):
        memory.tree([1, 2], 3, 0)
    with pytest.raises(ValueError, match="node budget"):
        WithTraffic(speculant.build_drafter("lookup"), memory, k=4, tree=-1)
    with pytest.raises(ValueError, match="traffic_tree"):
        OnlineConfig(traffic=8, traffic_tree=-1)
    with pytest.raises(ValueError, match="frequent"):
        OnlineConfig(traffic=8, traffic_tree=8, traffic_scoring="recent")


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=1)
    return target, perturbed(target, 0.3, seed=2)


def test_drafting_from_earlier_requests_is_exact_and_accepted(pair):
    """A memory holding the target's own earlier answer drafts it again: τ rises, the output is plain decoding's."""
    target, draft = pair
    prompt = [3, 4, 5, 6, 7]
    plain = generate(target, prompt, None, max_new_tokens=40, eos_token_id=[])
    memory = TrafficMemory()
    alone = generate(target, prompt, speculant.build_drafter("chain:k=2", draft), max_new_tokens=40, eos_token_id=[])
    memory.add(prompt + plain.token_ids)
    drafter = WithTraffic(speculant.build_drafter("chain:k=2", draft), memory, k=8)
    gen = generate(target, prompt, drafter, max_new_tokens=40, eos_token_id=[])
    assert gen.token_ids == plain.token_ids == alone.token_ids
    assert gen.stats.target_calls < alone.stats.target_calls / 2  # the memory's chain was accepted
    branching = WithTraffic(speculant.build_drafter("chain:k=2", draft), memory, k=8, tree=12)
    gen = generate(target, prompt, branching, max_new_tokens=40, eos_token_id=[])
    assert gen.token_ids == plain.token_ids and gen.stats.target_calls < alone.stats.target_calls / 2
    other = [9, 8, 7]  # another prompt: whatever is drafted, plain's output; mask probes' trees go unmerged
    want = generate(target, other, None, max_new_tokens=30, eos_token_id=[]).token_ids
    noise = torch.Generator().manual_seed(0)
    for _ in range(30):  # contexts followed by several continuations: the tree branches
        memory.add(torch.randint(0, 12, (20,), generator=noise).tolist())
    assert any(len(memory.tree(list(t), 4, 16)) > 1 for t in torch.randint(0, 12, (20, 2), generator=noise).tolist())
    for inner in ("lookup", "mask-probe"):
        for nodes in (0, 16):
            drafter = WithTraffic(speculant.build_drafter(inner), memory, k=4, tree=nodes)
            assert generate(target, other, drafter, max_new_tokens=30, eos_token_id=[]).token_ids == want


@pytest.mark.parametrize("tree,n", [*sizes(2000, 0, id="chain"), *sizes(2000, 12, id="tree")])
def test_sampling_with_the_traffic_chain_matches_the_target_distribution(tree, n):
    """The memory's chain (or its tree) is a deterministic draft merged into a sampled chain (which then drops its
    q): the deterministic-draft rule keeps the target's distribution."""
    from test_sampling_distribution import PROMPT, VOCAB, exact_joint, pvalues, sample_counts

    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    draft = perturbed(target, scale=0.3, seed=5)
    params = SamplingParams(temperature=1.0)
    memory = TrafficMemory()
    g = torch.Generator().manual_seed(3)
    for seed in range(20):  # the target's own sampled continuations of the test's prompt, and noise
        memory.add(PROMPT + generate(target, PROMPT, None, max_new_tokens=3, temperature=1.0, seed=seed,
                                     eos_token_id=[]).token_ids)
        memory.add(torch.randint(0, VOCAB, (8,), generator=g).tolist())
    assert memory.continuation(PROMPT, 3)  # the prompt's continuation is drafted from the memory
    assert not tree or len(memory.tree(PROMPT, 3, tree)) > 1  # the tree branches there
    counts, hist, drafted = sample_counts(
        target, lambda: WithTraffic(speculant.build_drafter("chain:k=2", draft), memory, k=3, tree=tree), params, 3,
        n, seed0=99)
    assert hist[1:].sum() > 100  # drafts were accepted
    bad = {name: p for name, p in pvalues(counts, exact_joint(target, params, 3)).items() if not p > 1e-4}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


def test_online_adaptation_fills_the_memory_drafts_from_it_and_keeps_it_across_a_restart(pair, tmp_path):
    target, draft = pair
    config = OnlineConfig(update_every=1000, traffic=6, traffic_tokens=4096)  # no distillation: the memory only
    adapter = OnlineAdapter(speculant.load(target=target, draft=draft, method="chain:k=2"), config,
                            state_dir=tmp_path)
    prompt = [3, 4, 5, 6, 7]
    plain = generate(target, prompt, None, max_new_tokens=40, eos_token_id=[]).token_ids
    first = adapter.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert adapter.traffic.requests == 1 and len(adapter.traffic) == len(prompt) + 40
    again = adapter.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert first.token_ids == again.token_ids == plain
    assert again.stats.target_calls < first.stats.target_calls / 2
    adapter.stop()  # saves
    resumed = OnlineAdapter(speculant.load(target=target, draft=draft, method="chain:k=2"), config,
                            state_dir=tmp_path)
    assert resumed.traffic._tokens == adapter.traffic._tokens and resumed.traffic._counts == adapter.traffic._counts
    assert resumed.traffic.continuation(prompt, 6) == adapter.traffic.continuation(prompt, 6) != []
    resumed_run = resumed.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert resumed_run.token_ids == plain and resumed_run.stats.target_calls < first.stats.target_calls / 2


def test_the_memory_alone_serves_any_method_without_a_draft_model(pair, tmp_path):
    """distill=False: no draft model trained (here none at all: prompt lookup), the memory still drafts and persists."""
    target, _ = pair
    config = OnlineConfig(distill=False, traffic=6)
    adapter = OnlineAdapter(speculant.load(target=target, method="lookup"), config, state_dir=tmp_path)
    prompt = [3, 4, 5, 6, 7]
    plain = generate(target, prompt, None, max_new_tokens=40, eos_token_id=[]).token_ids
    first = adapter.generate(prompt, max_new_tokens=40, eos_token_id=[])
    again = adapter.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert first.token_ids == again.token_ids == plain
    assert again.stats.target_calls < first.stats.target_calls / 2
    assert len(adapter.buffer) == 0 and not adapter.due()  # nothing recorded for training, no update due
    with pytest.raises(ValueError, match="does not distil"):
        adapter.update()
    adapter.stop()  # saves (no drafter parameters)
    resumed = OnlineAdapter(speculant.load(target=target, method="lookup"), config, state_dir=tmp_path)
    assert resumed.traffic._tokens == adapter.traffic._tokens
    with pytest.raises(ValueError, match="adapts nothing"):
        OnlineConfig(distill=False)
    two = OnlineAdapter(speculant.load(target=target, method="lookup"),
                        OnlineConfig(distill=False, traffic=6, traffic_min_ngram=2), state_dir=tmp_path)
    assert two.traffic.min_ngram == 2 and two.traffic._tokens == adapter.traffic._tokens  # resumed at its own setting
    assert two.traffic.continuation([prompt[-1]], 4) == []  # one token of context: too short to draft from now
    assert adapter.traffic.continuation([prompt[-1]], 4)  # where n-grams of 1 did
    branching = OnlineAdapter(speculant.load(target=target, method="lookup"),
                              OnlineConfig(distill=False, traffic=6, traffic_tree=12, traffic_min_score=0.01),
                              state_dir=tmp_path)
    assert branching.drafter().inner.tree == 12  # the served drafter merges the memory's tree
    grown = branching.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert grown.token_ids == plain and grown.stats.target_calls < first.stats.target_calls / 2
    with pytest.raises(ValueError, match="traffic_tree needs traffic"):
        OnlineConfig(traffic_tree=8)
    with pytest.raises(ValueError, match="traffic_tree"):
        OnlineConfig(traffic=8, traffic_tree=2.5)
    with pytest.raises(ValueError, match="draft model"):
        OnlineAdapter(speculant.load(target=target, method="lookup"), OnlineConfig(traffic=6))
