"""Tree drafters (SpecInfer, RSD-C, RSD-S, dynamic tree): the draft-side tree forward, draft-cache consistency
after commit, the shape of what each method hands the verifier, the Gumbel machinery, and the registry / CLI.

Losslessness is tested end to end in test_trees_distribution.py (sampling) and test_trees_greedy.py (greedy).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import chisq_pvalue

import speculant
from speculant import cli
from speculant.core.cache import SpecCache, cache_kwarg
from speculant.core.checks import num_layers
from speculant.drafters import (
    DecodeState,
    DynamicTreeDrafter,
    RSDCDrafter,
    RSDSDrafter,
    SpecInferDrafter,
    SpecTrDrafter,
)
from speculant.drafters.calibration import AcceptanceCalibrator
from speculant.drafters.registry import build_drafter, describe_methods, parse_method
from speculant.drafters.trees import gumbel_keys, truncated_gumbel
from speculant.core.sampling import make_generator, warp
from speculant.tiny_models import perturbed, tiny_model
from speculant.core.types import DraftTree, SamplingParams

VOCAB = 96
SPECS = ["chain:k=3", "specinfer:width=3:depth=3", "rsd-c:branching=3/2/1", "rsd-s:width=3:depth=3",
         "tree:budget=9:topk=3:depth=3"]
TREE_SPECS = SPECS[1:]


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


T1 = SamplingParams(temperature=1.0)


def _state(model, ids, params=T1, seed=0, new=20) -> DecodeState:
    return DecodeState(target=model, ids=list(ids), params=params, generator=make_generator(seed),
                       max_length=len(ids) + new, remaining=new)


def _prefix(n=9, seed=1) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _path(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.insert(0, tree.tokens[node])
        node = tree.parents[node]
    return out


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


# ------------------------------------------------------------------------------------ draft-side tree forward


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "gpt_neox", "phi"])
@pytest.mark.parametrize("trim", [None, "half"])
def test_level_forward_matches_sequential_paths(arch, trim):
    """Levels fed one batched forward each (tree mask over the draft cache) give, at every node, the logits of
    decoding its path token by token; the same with a trimmed LM head (the kept rows of the full logits)."""
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    keep = list(range(0, VOCAB, 2)) if trim else None
    drafter = RSDCDrafter(model, vocab_trim=keep if keep else 0)
    prefix = _prefix()
    state = _state(model, prefix)
    # levels (tokens, parents in feed order): two root children, three grandchildren, a chain below one of them
    levels = [([10, 11], [-1, -1]), ([12, 13, 15], [0, 0, 1]), ([14], [2]), ([16, 17], [5, 5])]
    with torch.inference_mode():
        drafter.begin(state)
        got = [drafter._start(state)[0]]
        for tokens, parents in levels:
            got.extend(drafter._feed(state, tokens, parents))
        fed = DraftTree(tokens=[t for lv in levels for t in lv[0]], parents=[p for lv in levels for p in lv[1]])
        assert drafter._cache.length == len(prefix) + len(fed)
        assert state.stats.draft_calls == 1 + len(levels)  # one forward per level
        for node in range(-1, len(fed)):
            ref = _last_logits(model, prefix + _path(fed, node))
            ref = ref if keep is None else ref[keep]
            torch.testing.assert_close(got[node + 1], ref, atol=1e-4, rtol=1e-4)


def test_chain_shaped_levels_use_the_causal_mask():
    """A fed tree that is a chain needs no explicit mask; its logits are still the sequential ones."""
    model = tiny_model("llama", seed=0, vocab_size=VOCAB)
    drafter = RSDCDrafter(model)
    prefix = _prefix(seed=4)
    state = _state(model, prefix)
    with torch.inference_mode():
        drafter.begin(state)
        drafter._start(state)
        a = drafter._feed(state, [20], [-1])[0]
        b = drafter._feed(state, [21, 22], [0, 1])  # two levels' worth at once: still a chain
        torch.testing.assert_close(a, _last_logits(model, prefix + [20]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b[1], _last_logits(model, prefix + [20, 21, 22]), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------- draft cache on commit


def _accept(tree: DraftTree, choice: str) -> list[int]:
    """An accepted path: none, the first child down to a leaf, or the last child down to depth 2."""
    path: list[int] = []
    node = -1
    while tree.children[node + 1] and choice != "none":
        kids = tree.children[node + 1]
        node = kids[0] if choice == "first-to-leaf" else kids[-1]
        path.append(node)
        if choice == "last-to-depth-2" and len(path) == 2:
            break
    return path


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_cache_after_commit_is_exactly_the_accepted_path(spec, temperature):
    """After commit the draft cache equals a prefill of the committed tokens it claims to hold (the fed nodes of
    the accepted path, compacted), and the next proposal continues from exactly the committed sequence."""
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    model = perturbed(target, scale=0.3, seed=3)
    params = SamplingParams(temperature=temperature)
    drafter = build_drafter(spec, model)
    for choice in ("first-to-leaf", "last-to-depth-2", "none"):
        state = _state(target, _prefix(seed=7), params, seed=11)
        with torch.inference_mode():
            drafter.begin(state)
            for step in range(3):
                tree = drafter.propose(state)
                base = len(state.ids)
                path = _accept(tree, choice)
                accepted = [tree.tokens[n] for n in path]
                state.ids.extend(accepted + [5 + step])  # + a bonus token
                state.remaining -= len(accepted) + 1
                drafter.commit(state, accepted)
                n = drafter._n_cached
                # every accepted node stays in the cache, except possibly a leaf (the deepest level is never fed;
                # the dynamic tree also keeps candidates it did not expand)
                if path and not tree.children[path[-1] + 1]:
                    assert base + len(path) - 1 <= n <= base + len(path), (choice, step)
                    if spec.split(":")[0] != "tree":
                        assert n == base + len(path) - (tree.max_depth == len(path)), (choice, step)
                else:
                    assert n == base + len(path), (choice, step)
                assert drafter._cache.length == n
                ref = SpecCache(num_layers(model))
                model(input_ids=torch.tensor([state.ids[:n]]), **cache_kwarg(model, ref), use_cache=True)
                for got, want in zip(drafter._cache.layers, ref.layers):
                    torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
            if temperature > 0 and not spec.startswith("tree"):  # the next root distribution is the draft's after the whole committed sequence
                tree = drafter.propose(state)
                want = warp(_last_logits(model, state.ids), params)
                torch.testing.assert_close(tree.draft_probs[0], want, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ what the verifier is handed


def _propose(spec: str, temperature: float, seed: int = 0, top_p=None) -> tuple[DraftTree, torch.nn.Module, list]:
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    model = perturbed(target, scale=0.3, seed=3)
    state = _state(target, _prefix(seed=seed), SamplingParams(temperature=temperature, top_p=top_p), seed=seed)
    drafter = build_drafter(spec, model)
    with torch.inference_mode():
        drafter.begin(state)
        return drafter.propose(state), model, state.ids


def _check_common(tree: DraftTree, model, ids, params: SamplingParams) -> None:
    for kids in tree.children:  # siblings are distinct tokens (commit and verification rely on it)
        toks = [tree.tokens[c] for c in kids]
        assert len(set(toks)) == len(toks)
    if tree.draft_probs is None:
        return
    assert tree.draft_probs.shape == (len(tree) + 1, VOCAB)
    with torch.inference_mode():
        for row in range(len(tree) + 1):
            if not tree.children[row]:
                continue  # a leaf: not read
            want = warp(_last_logits(model, ids + _path(tree, row - 1)), params)
            torch.testing.assert_close(tree.draft_probs[row], want, atol=1e-5, rtol=1e-4)
            assert all(float(tree.draft_probs[row, tree.tokens[c]]) > 0 for c in tree.children[row])


@pytest.mark.parametrize("top_p", [None, 0.5])
def test_specinfer_tree_and_draw_order(top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p)
    repeated = False
    for seed in range(4):
        tree, model, ids = _propose("specinfer:width=4:depth=3", 1.0, seed, top_p)
        assert tree.replacement and tree.max_depth == 3
        _check_common(tree, model, ids, params)
        draws = tree.draw_order
        assert len(draws[0]) == 4  # one i.i.d. draw per sequence at the root
        for row, kids in enumerate(tree.children):
            assert sorted(set(draws[row])) == kids  # every child drawn, nothing else
            if row:  # as many draws below a node as sequences went through it
                parent_row = tree.parents[row - 1] + 1
                through = draws[parent_row].count(row - 1)
                assert len(draws[row]) == (through if kids else 0)
        assert all(sum(d == k for d in tree.depths) <= 4 for k in range(1, 4))
        repeated |= any(len(d) > len(set(d)) for d in draws)
    # a peaked draft (top-p 0.5) repeats draws: duplicates merged, multiplicity kept in draw_order
    assert top_p is None or repeated


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rsd_c_tree(temperature):
    params = SamplingParams(temperature=temperature)
    tree, model, ids = _propose("rsd-c:branching=3/2/1", temperature)
    assert not tree.replacement
    assert [len(k) for k in tree.children[:1]] == [3] and len(tree) == 3 + 6 + 6
    assert all(len(tree.children[n + 1]) == {1: 2, 2: 1, 3: 0}[d] for n, d in enumerate(tree.depths))
    _check_common(tree, model, ids, params)
    if temperature == 0:  # deterministic: the top-b children of each node by draft logits
        assert tree.draft_probs is None
        with torch.inference_mode():
            for row, kids in enumerate(tree.children):
                if kids:
                    top = _last_logits(model, ids + _path(tree, row - 1)).topk(len(kids)).indices.tolist()
                    assert [tree.tokens[c] for c in kids] == top


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rsd_s_tree(temperature):
    params = SamplingParams(temperature=temperature)
    for seed in range(3):
        tree, model, ids = _propose("rsd-s:width=3:depth=4", temperature, seed)
        assert not tree.replacement and tree.max_depth == 4
        assert all(sum(d == k for d in tree.depths) == 3 for k in range(1, 5))  # W nodes per level (V >> W)
        _check_common(tree, model, ids, params)
        assert (tree.draft_probs is None) == (temperature == 0)
    if temperature == 0:  # beam search: the level-2 nodes are the 3 best 2-token sequences among the candidates
        with torch.inference_mode():
            lp0 = _last_logits(model, ids).log_softmax(-1)
            scores = {}
            for a in lp0.topk(3).indices.tolist():
                lp1 = _last_logits(model, ids + [a]).log_softmax(-1)
                for b in lp1.topk(3).indices.tolist():
                    scores[(a, b)] = float(lp0[a] + lp1[b])
        best = sorted(scores, key=scores.get, reverse=True)[:3]
        level2 = [tuple(_path(tree, n)) for n, d in enumerate(tree.depths) if d == 2]
        assert sorted(level2) == sorted(best)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dynamic_tree(temperature):
    params = SamplingParams(temperature=temperature)
    tree, model, ids = _propose("tree:budget=10:topk=3:depth=4:calibrate=0", temperature)
    assert tree.draft_probs is None and len(tree) == 10 and tree.max_depth <= 4
    _check_common(tree, model, ids, params)

    def logp(path):
        logits = _last_logits(model, ids + path)
        return logits.float().log_softmax(-1) if temperature == 0 else warp(logits, params).log()

    with torch.inference_mode():
        score = []  # cumulative draft log-prob of each node, from sequential forwards
        for n, par in enumerate(tree.parents):
            score.append((score[par] if par >= 0 else 0.0) + float(logp(_path(tree, par))[tree.tokens[n]]))
        root_top = logp([]).topk(3)
    # the root's children are its best candidates; any of the root's top 3 left out scores below every kept node
    kids = [tree.tokens[c] for c in tree.children[0]]
    assert kids == root_top.indices.tolist()[: len(kids)]
    for t, s in zip(root_top.indices.tolist(), root_top.values.tolist()):
        assert t in kids or s <= min(score) + 1e-4


def test_calibrator_learns_acceptance_rates_and_ranks_by_them():
    cal = AcceptanceCalibrator(bins=4, ranks=2, prior_weight=2.0)
    q = [[0.3, 0.3]]  # same draft probability, sibling ranks 0 and 1
    assert cal.log_accept(q) == [[pytest.approx(math.log(0.375))] * 2]  # the prior: the bin centre
    cal.update([0.3] * 8 + [0.3] * 8, [0] * 8 + [1] * 8, [True] * 8 + [False] * 8)
    after = [math.exp(x) for x in cal.log_accept(q)[0]]
    assert after == pytest.approx([(0.75 + 8) / 10, 0.75 / 10])
    assert cal.table()[0][1] == pytest.approx(after[0])


def test_calibrated_tree_learns_from_accepted_paths():
    """_learn records every child of each accepted node (root included): one hit per accepted node, misses for
    its siblings and for all children of the deepest accepted node. A calibration that trusts only the draft's
    favourite turns the tree into the greedy chain."""
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    drafter = build_drafter("tree:budget=9:topk=3:depth=3", target)
    state = _state(target, _prefix(), SamplingParams(temperature=0.0))
    with torch.inference_mode():
        drafter.begin(state)
        tree = drafter.propose(state)
        first = tree.children[0][0]
        below = tree.children[first + 1]
        bonus = next(t for t in range(VOCAB) if t not in [tree.tokens[c] for c in below])
        accepted = [tree.tokens[first], bonus]  # the first child accepted, then a bonus no child of it matches
        before = drafter.calibrator.trials.sum().item()
        drafter.commit(state, accepted)
        assert drafter.calibrator.trials.sum().item() - before == len(tree.children[0]) + len(below)
        assert drafter.calibrator.hits.sum().item() == pytest.approx(
            AcceptanceCalibrator().hits.sum().item() + 1)
        cal = drafter.calibrator
        cal.update([i / 100 for i in range(100)] * 2, [0] * 100 + [1] * 100, [True] * 100 + [False] * 100)
        cal.trials[1] += 1e6  # rank >= 1: accepted with probability ~0
        cal._log = None
        state.ids += accepted
        state.remaining -= 2
        drafter.budget = 3  # the three most likely nodes: the favourite path, not the siblings near the root
        chain = drafter.propose(state)
    assert chain.parents == [-1, 0, 1]
    assert [chain.tokens[i] for i in range(3)] == [
        int(_last_logits(target, state.ids + [chain.tokens[i] for i in range(j)]).argmax()) for j in range(3)]


def test_depth_is_capped_by_remaining_tokens():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    for spec in TREE_SPECS:
        drafter = build_drafter(spec, target)
        state = _state(target, _prefix(), SamplingParams(temperature=1.0), new=3)
        with torch.inference_mode():
            drafter.begin(state)
            assert drafter.propose(state).max_depth == 2, spec


# ------------------------------------------------------------------------------------------ Gumbel machinery


def test_gumbel_top_k_is_sampling_without_replacement():
    """The top-2 of log p + Gumbel, in order, is an ordered sample without replacement: P(a, b) = p_a p_b/(1-p_a)."""
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    n = 40000
    keys = gumbel_keys(p.expand(n, -1).contiguous(), make_generator(0))
    top = keys.topk(2, dim=-1).indices.numpy()
    counts = np.zeros((6, 6))
    np.add.at(counts, (top[:, 0], top[:, 1]), 1)
    q = p.double().numpy()
    expected = np.array([[0.0 if a == b else q[a] * q[b] / (1 - q[a]) for b in range(6)] for a in range(6)])
    assert chisq_pvalue(counts, expected) > 1e-4
    assert torch.isinf(keys[:, 5]).all()  # p = 0 is never drawn


def test_truncated_gumbel_matches_the_formula_and_conditions_the_max():
    g = torch.Generator().manual_seed(0)
    parent = torch.randn(50, 1, dtype=torch.float64, generator=g)
    keys = torch.randn(50, 6, dtype=torch.float64, generator=g) * 2
    top = keys.max(-1, keepdim=True).values
    got = truncated_gumbel(parent, keys, top)
    naive = -torch.log(torch.exp(-parent) - torch.exp(-top) + torch.exp(-keys))
    torch.testing.assert_close(got, naive)
    assert torch.equal(got.max(-1, keepdim=True).values, parent.expand(-1, 1))  # the maximum becomes the parent's
    assert (got <= parent).all() and (got.argsort(-1) == keys.argsort(-1)).all()  # order kept
    # extreme values stay finite and ordered; -inf keys (p = 0) stay -inf
    far = truncated_gumbel(torch.tensor([-40.0], dtype=torch.float64),
                           torch.tensor([3.0, 2.0, -200.0, -math.inf], dtype=torch.float64),
                           torch.tensor(3.0, dtype=torch.float64))
    assert far[0] == -40.0 and -40.0 >= far[1] > far[2] and far[3] == -math.inf and not far.isnan().any()


# ---------------------------------------------------------------------------------- registry, CLI, bench


def test_registry_builds_every_tree_method():
    model = tiny_model("llama", seed=0, vocab_size=VOCAB)
    assert parse_method("rsd-c:branching=2/1/1") == ("rsd-c", {"branching": [2, 1, 1]})
    cases = {
        "specinfer:width=2:depth=5": (SpecInferDrafter, {"width": 2, "depth": 5}),
        "spectr:width=3:depth=2": (SpecTrDrafter, {"width": 3, "depth": 2, "coupling": "kseq"}),
        "rsd-c:branching=4/1": (RSDCDrafter, {"branching": [4, 1]}),
        "rsd-s:width=5:depth=2:trim=0": (RSDSDrafter, {"width": 5, "depth": 2, "vocab_trim": 0}),
        "tree:budget=12:topk=2:depth=6": (DynamicTreeDrafter, {"budget": 12, "topk": 2, "depth": 6}),
    }
    for spec, (cls, attrs) in cases.items():
        drafter = build_drafter(spec, model, tokenizers_match=True)
        assert type(drafter) is cls and drafter.tokenizers_match is True
        for key, value in attrs.items():
            assert getattr(drafter, key) == value, (spec, key)
    text = describe_methods()
    for needle in ("specinfer:", "spectr:", "rsd-c:", "rsd-s:", "tree:", "branching (int/int/...", "default 2/2/1",
                   "budget (int, default 16)"):
        assert needle in text, needle
    for bad, needle in [("rsd-c:branching=2/x", "bad value"), ("rsd-c:branching=2/0", "branching factor"),
                        ("specinfer:width=0", "width"), ("tree:k=3", "unknown option"), ("rsd-s:depth=0", "depth")]:
        with pytest.raises(ValueError, match=needle):
            build_drafter(bad, model)
    assert speculant.RSDCDrafter is RSDCDrafter and "DynamicTreeDrafter" in speculant.__all__


def test_cli_generate_and_bench_with_tree_methods(code_models, capsys):
    """``speculant generate --method`` and ``run_bench`` (what ``speculant bench --methods`` calls) take the tree
    specs; greedy output equals plain decoding."""
    from speculant.bench import run_bench

    target_dir, draft_dir = code_models["target"], code_models["draft"]
    prompt = "def add(a, b):\n    return a + b\n\n"
    outs = {}
    for spec in ["ar", *TREE_SPECS]:
        code = cli.main(["generate", prompt, "--target", str(target_dir), "--draft", str(draft_dir), "--method",
                         spec, "--max-new-tokens", "16", "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs[spec] = json.loads(out)["token_ids"]
    assert all(ids == outs["ar"] for ids in outs.values()), outs
    code = cli.main(["generate", prompt, "--target", str(target_dir), "--draft", str(draft_dir), "--method",
                     "rsd-c:branching=2/2", "--max-new-tokens", "8", "--temperature", "1", "--seed", "3"])
    assert code == 0 and "method=rsd-c:branching=2/2 τ=" in capsys.readouterr().err

    target = tiny_model("llama", vocab_size=96, hidden=32, layers=2, context=256, init_std=0.5)
    res = run_bench(prompts=[{"input_ids": list(range(2, 14))}, {"input_ids": list(range(5, 17))}],
                    methods=",".join(TREE_SPECS), baselines="", target=target, draft=perturbed(target, 0.02),
                    max_new_tokens=12, warmup=0, progress=False)
    for spec in TREE_SPECS:
        s = res["methods"][spec]
        assert s["identical_to_ar"] == 1.0 and s["acceptance_length"] > 1.0, spec
        assert s["draft_cost_ratio"] > 0 and 0 < s["mbsu"] < s["acceptance_length"]
        assert s["draft_calls_per_step"] <= 3.0  # one draft forward per level


def test_calibration_restarts_when_the_sampling_settings_change():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    drafter = build_drafter("tree:budget=6:topk=2:depth=3", perturbed(target, 0.1))
    speculant.generate(target, _prefix(), drafter=drafter, max_new_tokens=12, eos_token_id=[])
    learned = drafter.calibrator
    assert learned.trials.sum() > AcceptanceCalibrator().trials.sum()
    speculant.generate(target, _prefix(), drafter=drafter, max_new_tokens=12, eos_token_id=[])
    assert drafter.calibrator is learned  # same settings: it keeps learning
    speculant.generate(target, _prefix(), drafter=drafter, max_new_tokens=12, temperature=0.8, seed=0,
                       eos_token_id=[])
    assert drafter.calibrator is not learned
