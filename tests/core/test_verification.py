"""Unit tests of the one verifier, ``speculant.core.verification.verify``, on hand-built distributions.

Greedy cases are checked exactly. Sampling cases are checked statistically: the drafts are drawn in the test
exactly as each rule assumes (numpy, independent of the library), the verifier is run many times with a fixed
seed, and the emitted tokens are compared with the exact target distribution by a chi-square goodness-of-fit
test. Seeds are fixed, so the tests are deterministic; the thresholds (p > 1e-4 to pass, p < 1e-6 for the
negative controls) leave a wide margin either way.

Sizes: each sampled rule runs :data:`RULE_N` times in the default suite and at its full size (12,000-20,000) in the
slow one (``make test-all``); the negative controls run at the default size too, so they show that it detects
those biases (:func:`test_rule_sample_size_has_the_stated_power` states its power).
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from helpers import chisq_pvalue, detectable_tv, sizes

from speculant.core.sampling import make_generator, nucleus, sample, warp
from speculant.core.types import DraftTree, SamplingParams, Verdict
from speculant.core.verification import kseq_rho, residual, verify

SAMPLE = SamplingParams(temperature=1.0)  # warp == plain softmax
GREEDY = SamplingParams(temperature=0.0)
PASS_P = 1e-4  # a correct verifier passes (fixed seeds: not flaky)
FAIL_P = 1e-6  # a wrong rule must be rejected at least this clearly
verify_module = importlib.import_module("speculant.core.verification")
RULE_N = 6000
"""Verifier runs per sampled rule in the default suite (the full sizes run under ``@pytest.mark.slow``)."""


def rule_sizes(n_full: int, *values, id: str = "n") -> list:
    """``(*values, RULE_N)`` for the default suite, ``(*values, n_full)`` for the slow one."""
    return sizes(n_full, *values, id=id, n_fast=RULE_N)


def test_rule_sample_size_has_the_stated_power():
    """RULE_N runs detect, with probability >= 0.99 at the tests' level, a first-token error of total-variation
    distance 0.05 (6 categories) and a joint error of 0.07 over the 25 cells of two tokens."""
    assert detectable_tv(RULE_N, categories=6) <= 0.05 and detectable_tv(RULE_N, categories=25) <= 0.07


# ----------------------------------------------------------------------------------------------- helpers


def _logits(*rows) -> torch.Tensor:
    """Target logits whose softmax is exactly the given probability rows ``[R, V]``."""
    return torch.tensor(np.log(np.asarray(rows, dtype=np.float64)), dtype=torch.float32)


_chisq_pvalue = chisq_pvalue


def _gumbel_top_k(rng: np.random.Generator, p: np.ndarray, k: int) -> list[int]:
    """k distinct tokens drawn sequentially without replacement from p, in draw order (Gumbel-top-k)."""
    with np.errstate(divide="ignore"):
        keys = np.log(p) + rng.gumbel(size=p.shape)
    order = np.argsort(-keys, kind="stable")
    return [int(t) for t in order[:k] if p[t] > 0]


def _iid(rng: np.random.Generator, p: np.ndarray, k: int) -> list[int]:
    return [int(t) for t in rng.choice(len(p), size=k, p=p)]


def _emitted(tree: DraftTree, verdict: Verdict) -> list[int]:
    return [tree.tokens[n] for n in verdict.accepted] + [verdict.bonus]


def _norm(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / x.sum()


# ------------------------------------------------------------------------------------------------ greedy


def test_greedy_chain_partial_acceptance():
    tree = DraftTree.chain([2, 3, 1])
    logits = torch.full((4, 5), -1.0)
    logits[0, 2] = 5.0  # target wants 2 after the root: node 0 accepted
    logits[1, 3] = 5.0  # wants 3 after node 0: node 1 accepted
    logits[2, 4] = 5.0  # wants 4 after node 1, draft says 1: rejected, correction 4
    logits[3, 0] = 5.0  # never reached
    assert verify(tree, logits, GREEDY) == Verdict([0, 1], 4)


@pytest.mark.parametrize(
    "first_choice, verdict",
    [(2, Verdict([0, 1], 0)), (4, Verdict([], 4))],  # full acceptance gives the bonus; first rejected
    ids=["full-acceptance-bonus", "first-rejected"],
)
def test_greedy_chain_ends(first_choice, verdict):
    tree = DraftTree.chain([2, 3])
    logits = torch.zeros(3, 5)
    logits[0, first_choice] = 1.0
    logits[1, 3] = 1.0
    logits[2, 0] = 1.0
    assert verify(tree, logits, GREEDY) == verdict


def test_greedy_branching_tree_follows_matching_branch():
    # root -> node 0 (tok 1) -> node 2 (tok 3);  root -> node 1 (tok 2) -> node 3 (tok 4)
    tree = DraftTree(tokens=[1, 2, 3, 4], parents=[-1, -1, 0, 1])
    logits = torch.zeros(5, 6)
    logits[0, 2] = 3.0  # root: argmax 2 = second child (node 1)
    logits[1, 3] = 3.0  # after node 0 (not on the path)
    logits[2, 4] = 3.0  # after node 1: argmax 4 = node 3
    logits[3, 0] = 3.0  # after node 2 (not on the path)
    logits[4, 5] = 3.0  # after node 3 (leaf): bonus 5
    assert verify(tree, logits, GREEDY) == Verdict([1, 3], 5)
    # the other branch, rejected at depth 2
    logits[0] = 0.0
    logits[0, 1] = 3.0  # root -> node 0
    logits[1] = 0.0
    logits[1, 5] = 3.0  # after node 0 wants 5, its child is 3: correction 5
    assert verify(tree, logits, GREEDY) == Verdict([0], 5)


def test_greedy_first_matching_sibling_is_followed():
    # two siblings with the same token (possible for deterministic trees): the first one wins
    tree = DraftTree(tokens=[2, 2, 0, 3], parents=[-1, -1, 0, 1])
    logits = torch.zeros(5, 4)
    logits[0, 2] = 2.0
    logits[1, 0] = 2.0  # node 0's child (node 2, tok 0) matches
    logits[2, 3] = 2.0  # node 1's child (node 3, tok 3) would match too, but node 1 is not followed
    logits[3, 1] = 2.0  # bonus after node 2
    logits[4, 2] = 2.0
    assert verify(tree, logits, GREEDY) == Verdict([0, 2], 1)


def test_greedy_empty_tree_returns_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    assert verify(DraftTree.empty(), logits, GREEDY) == Verdict([], 1)


def test_greedy_ignores_draft_probs_and_generator():
    probs = torch.full((3, 5), 0.2)
    tree = DraftTree.chain([2, 3], probs)
    logits = torch.zeros(3, 5)
    logits[0, 2] = 1.0
    logits[1, 1] = 1.0
    logits[2, 0] = 1.0
    assert verify(tree, logits, GREEDY) == Verdict([0], 1)
    assert verify(tree, logits, GREEDY, make_generator(3)) == Verdict([0], 1)


# ------------------------------------------------------------------------------- chain speculative sampling

# One draft node with draft token X: q(X)/p(X) = 0.15/0.5 = 0.3 exactly.
Q1 = np.array([0.15, 0.35, 0.10, 0.40])
P1 = np.array([0.50, 0.20, 0.20, 0.10])
X = 0
Q_AFTER = np.array([0.1, 0.2, 0.3, 0.4])  # target after the draft token (bonus row)


def _one_node_tree(token: int) -> tuple[DraftTree, torch.Tensor]:
    draft_probs = torch.tensor(np.stack([P1, np.full(4, 0.25)]), dtype=torch.float32)
    return DraftTree.chain([token], draft_probs), _logits(Q1, Q_AFTER)


@pytest.mark.parametrize("n", rule_sizes(20000))
def test_chain_partial_acceptance_rate_and_residual(n):
    tree, logits = _one_node_tree(X)
    gen = make_generator(1234)
    accepted = 0
    bonus_counts = np.zeros(4)
    rejected_counts = np.zeros(4)
    for _ in range(n):
        v = verify(tree, logits, SAMPLE, gen)
        if v.accepted:
            assert v.accepted == [0]
            accepted += 1
            bonus_counts[v.bonus] += 1
        else:
            rejected_counts[v.bonus] += 1
    ratio = Q1[X] / P1[X]
    assert ratio == pytest.approx(0.3)
    sigma = math.sqrt(ratio * (1 - ratio) / n)
    assert abs(accepted / n - ratio) < 4.5 * sigma, (accepted / n, ratio, sigma)
    # on rejection: y ~ norm((q - p)+) = [0, 1/3, 0, 2/3]
    res = _norm(np.clip(Q1 - P1, 0, None))
    np.testing.assert_allclose(res, [0, 1 / 3, 0, 2 / 3])
    assert _chisq_pvalue(rejected_counts, res) > PASS_P
    # after an accepted leaf: bonus ~ q(.|draft)
    assert _chisq_pvalue(bonus_counts, Q_AFTER) > PASS_P


@pytest.mark.parametrize("token", [1, 3])
def test_chain_draft_always_accepted_when_q_at_least_p(token):
    assert Q1[token] >= P1[token]
    tree, logits = _one_node_tree(token)
    gen = make_generator(7)
    verdicts = [verify(tree, logits, SAMPLE, gen) for _ in range(2000)]
    assert all(v.accepted == [0] for v in verdicts)


def test_chain_draft_accepted_when_q_equals_p():
    q = np.array([0.4, 0.3, 0.2, 0.1])
    tree = DraftTree.chain([1], torch.tensor(np.stack([q, q]), dtype=torch.float32))
    logits = _logits(q, q)
    gen = make_generator(8)
    # float32 softmax(log q) may differ from q by an ulp; the acceptance probability is then 1 - O(1e-7)
    accepted = sum(bool(verify(tree, logits, SAMPLE, gen).accepted) for _ in range(2000))
    assert accepted >= 1999


@pytest.mark.parametrize("n", rule_sizes(20000))
def test_chain_first_token_distribution_equals_q(n):
    rng = np.random.default_rng(11)
    gen = make_generator(11)
    first = np.zeros(4)
    second = np.zeros((4, 4))
    draft_probs = torch.tensor(np.stack([P1, np.full(4, 0.25)]), dtype=torch.float32)
    logits = _logits(Q1, Q_AFTER)
    for x in rng.choice(4, size=n, p=P1):
        tree = DraftTree.chain([int(x)], draft_probs)
        out = _emitted(tree, verify(tree, logits, SAMPLE, gen))
        first[out[0]] += 1
        if len(out) == 2:
            second[out[0], out[1]] += 1
    assert _chisq_pvalue(first, Q1) > PASS_P
    # when accepted, the bonus follows q(.|x) (here the same row whatever x)
    for x in range(4):
        if second[x].sum() >= 200:
            assert _chisq_pvalue(second[x], Q_AFTER) > PASS_P


@pytest.mark.parametrize("n", rule_sizes(20000))
def test_chain_two_tokens_joint_equals_target(n):
    """A chain of 2 drafted tokens: the first two emitted tokens follow q(a) q(b|a)."""
    rng = np.random.default_rng(5)
    V = 5
    q0 = rng.dirichlet(np.ones(V))
    qc = rng.dirichlet(np.ones(V), size=V)  # q(.|a)
    p0 = rng.dirichlet(np.ones(V))
    pc = rng.dirichlet(np.ones(V), size=V)
    q_leaf = np.full(V, 1.0 / V)
    gen = make_generator(5)
    counts = np.zeros((V, V))
    for _ in range(n):
        a = int(rng.choice(V, p=p0))
        b = int(rng.choice(V, p=pc[a]))
        tree = DraftTree.chain([a, b], torch.tensor(np.stack([p0, pc[a], q_leaf]), dtype=torch.float32))
        out = _emitted(tree, verify(tree, _logits(q0, qc[a], q_leaf), SAMPLE, gen))
        if len(out) == 1:  # rejected at the root: the next step would sample plainly from q(.|a)
            out.append(int(rng.choice(V, p=qc[out[0]])))
        counts[out[0], out[1]] += 1
    assert _chisq_pvalue(counts, q0[:, None] * qc) > PASS_P


# ------------------------------------------------------------------- recursive rejection at a branching node

# Draft and target disagree strongly, so the residual updates matter.
QM = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
PM = np.array([0.35, 0.05, 0.30, 0.10, 0.05, 0.15])
QM_LEAF = np.full(6, 1.0 / 6)


def _root_children_tree(draws: list[int], p: np.ndarray, replacement: bool, merge: bool,
                        coupling: str = "recursive") -> DraftTree:
    """Root with one child per draw (``merge=False``) or one per distinct token plus ``draw_order``."""
    if merge:
        tokens = list(dict.fromkeys(draws))
        draw_order = [[tokens.index(t) for t in draws]] + [[] for _ in tokens]
    else:
        tokens, draw_order = list(draws), None
    rows = np.stack([p] + [QM_LEAF] * len(tokens))
    return DraftTree(tokens=tokens, parents=[-1] * len(tokens), draft_probs=torch.tensor(rows, dtype=torch.float32),
                     replacement=replacement, draw_order=draw_order, coupling=coupling)


def _first_token_counts(n: int, seed: int, draw, replacement: bool, merge: bool, k: int, q=QM, p=PM,
                        coupling: str = "recursive"):
    rng = np.random.default_rng(seed)
    gen = make_generator(seed)
    counts = np.zeros(len(q))
    n_dups = 0
    for _ in range(n):
        draws = draw(rng, p, k)
        n_dups += len(set(draws)) < len(draws)
        tree = _root_children_tree(draws, p, replacement, merge, coupling)
        logits = _logits(q, *([QM_LEAF] * len(tree)))
        v = verify(tree, logits, SAMPLE, gen)
        assert len(v.accepted) <= 1
        counts[_emitted(tree, v)[0]] += 1
    return counts, n_dups


@pytest.mark.parametrize("k,n", [*rule_sizes(15000, 2, id="2"), pytest.param(3, 15000, id="3", marks=pytest.mark.slow)])
def test_rejection_without_replacement_marginal_is_q(k, n):
    counts, _ = _first_token_counts(n, 100 + k, _gumbel_top_k, replacement=False, merge=False, k=k)
    assert _chisq_pvalue(counts, QM) > PASS_P


@pytest.mark.parametrize("k,n", [*rule_sizes(15000, 2, id="2"), pytest.param(3, 15000, id="3", marks=pytest.mark.slow)])
def test_rejection_with_replacement_marginal_is_q(k, n):
    # i.i.d. siblings, each draw its own node (duplicates as separate siblings)
    counts, n_dups = _first_token_counts(n, 200 + k, _iid, replacement=True, merge=False, k=k)
    assert n_dups > n / 15
    assert _chisq_pvalue(counts, QM) > PASS_P


@pytest.mark.parametrize("n", rule_sizes(15000))
def test_rejection_with_replacement_draw_order_with_duplicates(n):
    # i.i.d. siblings merged into distinct nodes; draw_order keeps the draws (duplicates repeated)
    counts, n_dups = _first_token_counts(n, 300, _iid, replacement=True, merge=True, k=3)
    assert n_dups > n / 5
    assert _chisq_pvalue(counts, QM) > PASS_P


def test_draw_order_duplicate_is_rejected_but_updates_residual():
    # draws (x, y, x) with q(x) < p(x) and y with q(y) = 0: the second x can never be accepted, and a
    # rejection after it draws from the residual updated three times
    q = np.array([0.10, 0.00, 0.50, 0.40])
    p = np.array([0.50, 0.30, 0.10, 0.10])
    draft = torch.tensor(np.stack([p, p, p]), dtype=torch.float32)
    tree = DraftTree(tokens=[0, 1], parents=[-1, -1], draft_probs=draft, replacement=True,
                     draw_order=[[0, 1, 0], [], []])
    logits = torch.tensor(np.log(np.stack([np.clip(q, 1e-30, None), p, p])), dtype=torch.float32)
    gen = make_generator(9)
    n = 20000  # full size in the default suite: its last check (a residual missing one update) is a small bias
    accepted_first = 0
    rejected = np.zeros(4)
    for _ in range(n):
        v = verify(tree, logits, SAMPLE, gen)
        assert v.accepted in ([], [0]), v  # node 1 (q = 0) is never accepted
        if v.accepted:
            accepted_first += 1
        else:
            rejected[v.bonus] += 1
    # P(accept x at the first draw) = q(x)/p(x) = 0.2; the duplicate adds nothing
    sigma = math.sqrt(0.2 * 0.8 / n)
    assert abs(accepted_first / n - 0.2) < 4.5 * sigma
    # residuals: q2 = norm((q-p)+) = [0,0,.5,.4]/.9; q3 = norm((q2-p)+); q4 = norm((q3-p)+)
    r = q
    for _ in range(3):
        r = _norm(np.clip(r - p, 0, None))
    assert _chisq_pvalue(rejected, r) > PASS_P
    # ... which is detectably different from the residual that skips the duplicate's update
    r2 = q
    for _ in range(2):
        r2 = _norm(np.clip(r2 - p, 0, None))
    assert _chisq_pvalue(rejected, r2) < FAIL_P


# ------------------------------------------------------------------------------- SpecTr's K-SEQ coupling


def _g(beta: float, k: int) -> float:
    return k if beta == 0 else (1 - (1 - beta) ** k) / beta


def _beta(p: np.ndarray, q: np.ndarray, rho: float) -> float:
    return float(np.minimum(p, q / rho).sum())


@pytest.mark.parametrize("k", [2, 3, 5])
def test_kseq_rho_is_valid_and_near_the_root(k):
    rho = kseq_rho(torch.tensor(PM), torch.tensor(QM), k)
    assert 1.0 <= rho <= k
    assert _g(_beta(PM, QM, rho), k) <= rho + 1e-12  # valid: the residual is non-negative
    assert _g(_beta(PM, QM, rho), k) > rho - 1e-4 * k  # and the root of g(beta(rho)) = rho, not merely k
    assert kseq_rho(torch.tensor(PM), torch.tensor(QM), 1) == 1.0  # one draft: plain speculative sampling
    # p = q: the root is rho = 1 (every draw accepted), where g(beta(rho)) - rho is flat to order (rho - 1)^k
    assert kseq_rho(torch.tensor(QM), torch.tensor(QM), k) == pytest.approx(1.0, abs=1e-3)
    disjoint = kseq_rho(torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.3, 0.7]), k)
    assert disjoint == pytest.approx(k)


@pytest.mark.parametrize("k,n", [*rule_sizes(15000, 2, id="2"), pytest.param(3, 15000, id="3", marks=pytest.mark.slow)])
def test_kseq_marginal_is_q_and_acceptance_is_p_acc(k, n):
    """K i.i.d. draws merged with duplicates: the emitted token is distributed as q, and some draw is accepted
    with probability p_acc = 1 - (1 - beta(rho))^K, as the K-SEQ rule says."""
    rng = np.random.default_rng(900 + k)
    gen = make_generator(900 + k)
    counts, accepted, n_dups = np.zeros(len(QM)), 0, 0
    for _ in range(n):
        draws = _iid(rng, PM, k)
        n_dups += len(set(draws)) < len(draws)
        tree = _root_children_tree(draws, PM, replacement=True, merge=True, coupling="kseq")
        v = verify(tree, _logits(QM, *([QM_LEAF] * len(tree))), SAMPLE, gen)
        accepted += len(v.accepted)
        counts[_emitted(tree, v)[0]] += 1
    assert n_dups > n / 15
    assert _chisq_pvalue(counts, QM) > PASS_P
    rho = kseq_rho(torch.tensor(PM), torch.tensor(QM), k)
    p_acc = 1 - (1 - _beta(PM, QM, rho)) ** k
    assert abs(accepted / n - p_acc) < 4.5 * math.sqrt(p_acc * (1 - p_acc) / n)


def test_kseq_tree_needs_iid_siblings():
    with pytest.raises(ValueError, match="replacement"):
        DraftTree(tokens=[1], parents=[-1], draft_probs=torch.ones(2, 4) / 4, coupling="kseq")
    with pytest.raises(ValueError, match="coupling"):
        DraftTree(tokens=[1], parents=[-1], draft_probs=torch.ones(2, 4) / 4, replacement=True, coupling="optimal")


@pytest.mark.parametrize("n", rule_sizes(15000))
def test_negative_control_kseq_with_too_small_rho_is_detected(monkeypatch, n):
    """K-SEQ with rho = 1 for K = 3 drafts (g(beta) > rho, so the residual would be negative and is clipped):
    biased, and detected."""
    monkeypatch.setattr(verify_module, "kseq_rho", lambda p, q, k, **kw: 1.0)
    counts, _ = _first_token_counts(n, 950, _iid, replacement=True, merge=True, k=3, coupling="kseq")
    assert _chisq_pvalue(counts, QM) < FAIL_P


# Markov test tables for depth-2 trees: p(.|path) and q(.|path) depend on the last token only.
def _tables(seed: int, V: int):
    rng = np.random.default_rng(seed)
    return (rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V), size=V),
            rng.dirichlet(0.5 * np.ones(V)), rng.dirichlet(0.5 * np.ones(V), size=V))


def _build_tree(rng, branching, rule, p0, pc):
    """Draw a tree level by level: each node's children from p(.|node) as ``rule`` says (``kseq``: i.i.d. and
    merged, as ``with_merged``, verified by SpecTr's K-SEQ)."""
    tokens: list[int] = []
    parents: list[int] = []
    draw_order: list[list[int]] = [[]]
    frontier = [-1]
    for b in branching:
        nxt = []
        for node in frontier:
            p = p0 if node < 0 else pc[tokens[node]]
            draws = _gumbel_top_k(rng, p, b) if rule == "without" else _iid(rng, p, b)
            ids: dict[int, int] = {}
            order = []
            for t in draws:
                if rule in ("with_merged", "kseq") and t in ids:
                    order.append(ids[t])
                    continue
                ids[t] = len(tokens)
                order.append(len(tokens))
                tokens.append(t)
                parents.append(node)
                draw_order.append([])
                nxt.append(ids[t])
            draw_order[node + 1] = order
        frontier = nxt
    V = len(p0)
    rows = [p0] + [pc[t] for t in tokens]
    return DraftTree(tokens=tokens, parents=parents, draft_probs=torch.tensor(np.stack(rows), dtype=torch.float32),
                     replacement=rule != "without", draw_order=draw_order if rule in ("with_merged", "kseq") else None,
                     coupling="kseq" if rule == "kseq" else "recursive"), V


@pytest.mark.parametrize("rule,n", [p for rule in ["without", "with", "with_merged", "kseq"]
                                    for p in rule_sizes(12000, rule, id=rule)])
def test_rejection_tree_depth2_joint_equals_target(rule, n):
    q0, qc, p0, pc = _tables(42, 5)
    rng = np.random.default_rng(17)
    gen = make_generator(17)
    counts = np.zeros((5, 5))
    for _ in range(n):
        tree, V = _build_tree(rng, (3, 2), rule, p0, pc)
        rows = [q0] + [qc[t] for t in tree.tokens]
        out = _emitted(tree, verify(tree, _logits(*rows), SAMPLE, gen))
        if len(out) == 1:
            out.append(int(rng.choice(V, p=qc[out[0]])))
        counts[out[0], out[1]] += 1
    assert _chisq_pvalue(counts, q0[:, None] * qc) > PASS_P


# -------------------------------------------------------------------------------------- negative controls


@pytest.mark.parametrize("n", rule_sizes(15000))
def test_negative_control_wrong_rule_is_detected(n):
    """Siblings drawn WITHOUT replacement but verified by the WITH-replacement rule: biased, and detected."""
    counts, _ = _first_token_counts(n, 400, _gumbel_top_k, replacement=True, merge=False, k=3)
    assert _chisq_pvalue(counts, QM) < FAIL_P


@pytest.mark.parametrize("n", rule_sizes(15000))
def test_negative_control_dropped_duplicates_are_detected(n):
    """i.i.d. siblings whose draw_order lost the duplicate draws: the residual misses updates, detected."""
    rng = np.random.default_rng(500)
    gen = make_generator(500)
    q = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    p = np.array([0.70, 0.05, 0.10, 0.05, 0.05, 0.05])  # peaked: duplicates of token 0 are frequent
    counts = np.zeros(6)
    for _ in range(n):
        draws = list(dict.fromkeys(_iid(rng, p, 3)))  # duplicates dropped
        tree = _root_children_tree(draws, p, replacement=True, merge=True)
        v = verify(tree, _logits(q, *([QM_LEAF] * len(tree))), SAMPLE, gen)
        counts[_emitted(tree, v)[0]] += 1
    assert _chisq_pvalue(counts, q) < FAIL_P


def test_negative_control_ignoring_the_draft_is_detected():
    """Accepting every draft token (i.e. emitting p, not q) is detected by the same test."""
    rng = np.random.default_rng(600)
    counts = np.bincount(rng.choice(6, size=15000, p=PM), minlength=6)
    assert _chisq_pvalue(counts, QM) < FAIL_P


# ----------------------------------------------------------------------------------- deterministic drafts


@pytest.mark.parametrize("n", rule_sizes(15000))
def test_deterministic_draft_tree_joint_equals_target(n):
    q0, qc, _, _ = _tables(3, 5)
    # fixed tree: root -> 1 (-> 0, 3), root -> 4 (-> 4); root -> 2
    tree = DraftTree(tokens=[1, 4, 2, 0, 3, 4], parents=[-1, -1, -1, 0, 0, 1])
    logits = _logits(*([q0] + [qc[t] for t in tree.tokens]))
    rng = np.random.default_rng(3)
    gen = make_generator(3)
    counts = np.zeros((5, 5))
    n_depth2 = 0
    for _ in range(n):
        out = _emitted(tree, verify(tree, logits, SAMPLE, gen))
        n_depth2 += len(out) == 3
        if len(out) == 1:
            out.append(int(rng.choice(5, p=qc[out[0]])))
        counts[out[0], out[1]] += 1
    assert n_depth2 > n / 30
    assert _chisq_pvalue(counts, q0[:, None] * qc) > PASS_P


@pytest.mark.parametrize("n", rule_sizes(15000))
def test_deterministic_chain_marginal_is_q(n):
    tree = DraftTree.chain([1])
    logits = _logits(QM, QM_LEAF)
    gen = make_generator(4)
    counts = np.zeros(6)
    accepted = 0
    for _ in range(n):
        v = verify(tree, logits, SAMPLE, gen)
        accepted += bool(v.accepted)
        counts[_emitted(tree, v)[0]] += 1
    assert _chisq_pvalue(counts, QM) > PASS_P
    sigma = math.sqrt(QM[1] * (1 - QM[1]) / n)
    assert abs(accepted / n - QM[1]) < 4.5 * sigma  # a point-mass draft is accepted with probability q(x)


def test_sampling_empty_tree_samples_q():
    gen = make_generator(13)
    logits = _logits(QM)
    counts = np.zeros(6)
    for _ in range(10000):
        v = verify(DraftTree.empty(), logits, SAMPLE, gen)
        assert v.accepted == []
        counts[v.bonus] += 1
    assert _chisq_pvalue(counts, QM) > PASS_P


def test_sampling_respects_warping():
    """q and p are the WARPED distributions: with top_k=2 only the target's two best tokens are emitted, in
    proportion q^(1/T), whatever the draft proposes."""
    params = SamplingParams(temperature=0.7, top_k=2)
    logits = _logits(QM, QM_LEAF)
    p_draft = np.array([0.05, 0.40, 0.35, 0.10, 0.05, 0.05])  # its top-2 {1, 2} overlaps the target's {1, 3}
    p = warp(torch.tensor(np.log(p_draft), dtype=torch.float32), params).double().numpy()
    assert p[1] > 0 and p[2] > 0 and p[[0, 3, 4, 5]].sum() == 0
    rng = np.random.default_rng(12)
    gen = make_generator(12)
    counts = np.zeros(6)
    for x in rng.choice(6, size=8000, p=p / p.sum()):
        tree = DraftTree.chain([int(x)], torch.tensor(np.stack([p, QM_LEAF]), dtype=torch.float32))
        counts[_emitted(tree, verify(tree, logits, params, gen))[0]] += 1
    expected = np.zeros(6)
    w = QM[[1, 3]] ** (1 / 0.7)
    expected[[1, 3]] = w / w.sum()
    assert _chisq_pvalue(counts, expected) > PASS_P


@pytest.mark.parametrize("vocab", [6, 4_097, 5_120, 9_000])  # one block, a 1-token last block, whole blocks, ...
def test_sample_draws_the_distribution_and_never_a_zero(vocab):
    """``sample`` inverts the float64 CDF; over a large vocabulary in two levels (block sums, then inside the
    drawn block). The mass sits on 12 tokens spread over every block (the short last one included) and on a
    thin spread over all the others (pooled in the test); every 3rd token has probability 0 and is never drawn."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(vocab, generator=g) * 1e-4  # [V]
    heavy = torch.linspace(0, vocab - 1, 12).long()
    probs[heavy] = torch.rand(12, generator=g) + 0.5
    probs[torch.arange(1, vocab, 3)] = 0.0
    probs = probs / probs.sum()
    gen = make_generator(7)
    draws = np.array([sample(probs, gen) for _ in range(6000)])
    assert probs[torch.from_numpy(draws)].min() > 0
    p = probs.double().numpy()
    keep = np.zeros(vocab, bool)
    keep[heavy.numpy()] = True
    keep &= p > 0
    counts = np.append(np.bincount(draws, minlength=vocab)[keep], (~keep[draws]).sum())
    assert _chisq_pvalue(counts, np.append(p[keep], p[~keep].sum())) > PASS_P
    for bad in (torch.zeros(vocab), torch.full((vocab,), float("nan"))):
        with pytest.raises(ValueError, match="cannot sample"):
            sample(bad, gen)


def _nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = logits.softmax(-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = sorted_probs.double().cumsum(-1) - sorted_probs.double()
    keep = before < top_p
    keep[..., 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


@pytest.mark.parametrize("vocab", [5, 300, 20_000])
def test_nucleus_sorts_only_the_head_and_keeps_what_a_full_sort_keeps(vocab):
    """top-p's kept set from a partial sort (64 tokens, then 8 times as many while a row's head holds less than
    top_p) equals the full sort's, for peaked and flat rows (flat ones need the head to grow)."""
    g = torch.Generator().manual_seed(vocab)
    sizes = []
    for scale in (0.2, 1.0, 4.0):
        logits = torch.randn(3, vocab, generator=g) * scale  # [3, V]
        for top_p in (0.05, 0.5, 0.9, 0.999):
            got = nucleus(logits, top_p)
            assert torch.equal(got, _nucleus_by_full_sort(logits, top_p)), (scale, top_p)
            sizes.append(int(got.sum(-1).max()))
    assert min(sizes) >= 1 and (vocab < 1000 or max(sizes) > 8 * 64)  # the head grew twice at least
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)  # top-k first, then the nucleus of what is left
    logits = torch.randn(2, vocab, generator=g)
    probs = warp(logits, params)
    assert ((probs > 0).sum(-1) <= 20).all()
    kth = logits.topk(min(20, vocab)).values[..., -1:]  # [2, 1]
    assert torch.equal(probs > 0, nucleus(logits.masked_fill(logits < kth, float("-inf")) / 0.7, 0.9))


def test_warp_keeps_top_k_ties_and_gives_the_probabilities_of_the_kept_logits():
    """Top-k keeps every token tied with the k-th logit; without a tie the fast path (work on the k values only)
    gives the probabilities of a softmax over the kept logits, after top-p too."""
    probs = warp(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [True, True, True, False]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 500, generator=g) * 2  # [3, V], no ties
    for top_p in (None, 0.3, 0.9):
        params = SamplingParams(temperature=0.8, top_k=25, top_p=top_p)
        scaled = logits / 0.8
        kept = scaled >= scaled.topk(25).values[..., -1:]
        if top_p is not None:
            kept &= _nucleus_by_full_sort(scaled.masked_fill(~kept, float("-inf")), top_p)
        want = scaled.masked_fill(~kept, float("-inf")).softmax(-1)
        torch.testing.assert_close(warp(logits, params), want, rtol=1e-6, atol=1e-7)


def test_sample_refuses_rows():
    with pytest.raises(ValueError, match="one distribution"):
        sample(torch.full((1, 4), 0.25), make_generator(0))


@pytest.mark.parametrize("vocab", [4, 5_000])
def test_a_draw_rounded_onto_the_end_takes_the_last_token_with_probability(vocab, monkeypatch):
    """u * total can round up to the total itself: the draw then lands past every token, and ``sample`` takes the
    last token with any probability (the tail here has none, a whole block of it at 5,000 tokens)."""
    probs = torch.zeros(vocab)
    probs[: vocab // 4] = 1.0 / (vocab // 4)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones(1, dtype=torch.float64))
    assert sample(probs, make_generator(0)) == vocab // 4 - 1


# ----------------------------------------------------------------------------------- determinism, errors


def _verdicts(seed: int, n: int = 60) -> list[Verdict]:
    q0, qc, p0, pc = _tables(8, 5)
    rng = np.random.default_rng(0)  # the same trees for every seed
    trees = [_build_tree(rng, (2, 2), "without", p0, pc)[0] for _ in range(n)]
    gen = make_generator(seed)
    return [verify(t, _logits(*([q0] + [qc[x] for x in t.tokens])), SAMPLE, gen) for t in trees]


def test_same_seed_same_verdicts():
    assert _verdicts(21) == _verdicts(21)


def test_different_seeds_differ():
    assert _verdicts(21) != _verdicts(22)


def test_wrong_logits_shape_raises():
    tree = DraftTree.chain([1, 2])
    with pytest.raises(ValueError):
        verify(tree, torch.zeros(2, 5), GREEDY)  # needs N + 1 = 3 rows
    with pytest.raises(ValueError):
        verify(tree, torch.zeros(4, 5), SAMPLE, make_generator(0))
    with pytest.raises(ValueError):
        verify(tree, torch.zeros(3 * 5), GREEDY)  # 1-D
    with pytest.raises(ValueError):
        verify(tree, torch.zeros(1, 3, 5), GREEDY)  # batched
    with pytest.raises(ValueError):
        verify(DraftTree.empty(), torch.zeros(5), GREEDY)


def test_sampling_without_generator_raises():
    tree = DraftTree.chain([1], torch.full((2, 4), 0.25))
    with pytest.raises(ValueError):
        verify(tree, torch.zeros(2, 4), SAMPLE)


def test_draft_token_with_zero_draft_probability_raises():
    p = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.25] * 4])
    tree = DraftTree.chain([1], p)
    with pytest.raises(ValueError):
        verify(tree, torch.zeros(2, 4), SAMPLE, make_generator(0))


def test_residual_properties():
    q = torch.tensor([0.1, 0.4, 0.3, 0.2])
    p = torch.tensor([0.3, 0.1, 0.3, 0.3])
    q_before, p_before = q.clone(), p.clone()
    r = residual(q, p)
    assert torch.equal(q, q_before) and torch.equal(p, p_before)  # inputs untouched
    assert float(r.sum()) == pytest.approx(1.0)
    assert bool((r >= 0).all())
    assert torch.allclose(r, torch.tensor([0.0, 1.0, 0.0, 0.0]))  # only token 1 has q > p
    q2 = torch.tensor([0.5, 0.3, 0.2, 0.0])
    p2 = torch.tensor([0.2, 0.2, 0.3, 0.3])
    assert torch.allclose(residual(q2, p2), torch.tensor([0.75, 0.25, 0.0, 0.0]))
    # identical distributions: no residual mass, falls back to q
    assert torch.allclose(residual(q, q.clone()), q)
    # q = p', the residual is zero wherever q <= p
    r3 = residual(p, q)
    assert bool((r3[q >= p] == 0).all())
    # the identity behind speculative sampling: min(p, q) + (1 - sum min(p, q)) * residual == q
    beta = torch.minimum(p, q).sum()
    assert torch.allclose(torch.minimum(p, q) + (1 - beta) * residual(q, p), q, atol=1e-6)


@pytest.mark.parametrize("coupling", ["recursive", "kseq"])
def test_draft_token_with_zero_draft_probability_is_an_error(coupling):
    """A drafted token must have p > 0 (it was drawn from p): otherwise the drafter is inconsistent."""
    p = np.array([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    tree = _root_children_tree([0, 1], p, replacement=True, merge=False, coupling=coupling)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify(tree, _logits(QM_LEAF, QM_LEAF, QM_LEAF), SAMPLE, make_generator(0))
