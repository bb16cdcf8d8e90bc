"""Tree drafting is lossless: SpecInfer, SpecTr, RSD-C, RSD-S and the dynamic tree sample exactly the target's joint.

The setting and the helpers are core/test_sampling_distribution.py's: a tiny random target over 5 tokens, a perturbed
draft, thousands of seeded ``speculant.generate`` runs of 3 new tokens (a full first step of a depth-2 tree plus
its bonus, or a rejection and the steps after it: draft and target cache compaction), compared with the exact
target joint by chi-square tests of the joint, every pair of positions and the first token (p > 1e-4 to pass).
Siblings are drawn as each rule assumes (i.i.d. for SpecInfer and SpecTr, without replacement for RSD); the dynamic tree is a
deterministic draft (deterministic-draft rule). Negative controls: RSD's without-replacement siblings verified
with the with-replacement rule, and SpecInfer's duplicate draws dropped, must be detected (p < 1e-6).
"""

from __future__ import annotations

import pytest

from helpers import sizes
from test_sampling_distribution import (  # noqa: F401 (models: the target/draft fixture)
    FAIL_P,
    PASS_P,
    exact_joint,
    models,
    pvalues,
    sample_counts,
)

from speculant.drafters.registry import build_drafter
from speculant.drafters.trees import RSDCDrafter, RSDSDrafter, SpecInferDrafter
from speculant.core.types import SamplingParams

T1 = SamplingParams(temperature=1.0)
TOP_P = SamplingParams(temperature=1.0, top_p=0.8)
N = 1800  # generations per setting in the full-size (slow) runs; N_FAST in the default suite


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


def _check(target, make_drafter, params: SamplingParams, n_tokens: int, n: int, seed0: int, depth: int,
           min_share: float = 0.02) -> None:
    expected = exact_joint(target, params, n_tokens)
    counts, hist, _ = sample_counts(target, make_drafter, params, n_tokens, n, seed0)
    steps = hist.sum()
    # the draft is neither useless nor perfect: root rejections, full acceptances and partial ones all happen
    mean_accepted = float((hist * range(len(hist))).sum() / steps)
    assert 0.15 < mean_accepted / depth < 0.9, hist
    assert hist[0] > min_share * steps and hist[depth] > min_share * steps, hist
    bad = {name: p for name, p in pvalues(counts, expected).items() if not p > PASS_P}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad} (hist {hist})"


CASES = [  # top-p with every rule in the slow suite; in the default one with the deterministic tree only
    *sizes(N, "specinfer:width=3:depth=2", T1, 1, id="specinfer-temp1"),
    *sizes(N, "specinfer:width=3:depth=2", TOP_P, 2, id="specinfer-topp0.8", fast=False),
    *sizes(N, "spectr:width=3:depth=2", T1, 9, id="spectr-temp1"),
    *sizes(N, "spectr:width=3:depth=2", TOP_P, 10, id="spectr-topp0.8", fast=False),
    *sizes(N, "rsd-c:branching=3/2", T1, 3, id="rsd-c-temp1"),
    *sizes(N, "rsd-c:branching=3/2", TOP_P, 4, id="rsd-c-topp0.8", fast=False),
    *sizes(N, "rsd-s:width=3:depth=2", T1, 5, id="rsd-s-temp1"),
    *sizes(N, "rsd-s:width=3:depth=2", TOP_P, 6, id="rsd-s-topp0.8", fast=False),
    *sizes(N, "tree:budget=6:topk=3:depth=2", T1, 7, id="tree-temp1"),
    *sizes(N, "tree:budget=6:topk=3:depth=2", SamplingParams(temperature=0.7, top_p=0.8), 8,
           id="tree-temp0.7-topp0.8"),
]


@pytest.mark.parametrize("spec,params,seed,n", CASES)
def test_tree_matches_target_distribution(models, spec, params, seed, n):  # noqa: F811
    target, draft = models
    _check(target, lambda: build_drafter(spec, draft), params, n_tokens=3, n=n, seed0=100_000 * seed, depth=2)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["specinfer:width=3:depth=3", "rsd-c:branching=2/2/1", "rsd-s:width=2:depth=3",
                                  "tree:budget=15:topk=3:depth=3"])
@pytest.mark.parametrize("params", [T1, TOP_P], ids=["temp1", "topp0.8"])
def test_deeper_trees_match_target_distribution(models, spec, params):  # noqa: F811
    """Depth-3 trees, the joint of 4 tokens (625 cells), many samples. Whole depth-3 paths are accepted less
    often here (about 1% of the steps for the deterministic tree), hence the lower floor."""
    target, draft = models
    _check(target, lambda: build_drafter(spec, draft), params, n_tokens=4, n=10_000, seed0=9_000_000, depth=3,
           min_share=0.005)


# -------------------------------------------------------------------------------------- negative controls


def _with_replacement_rule(tree):
    """Biased: the siblings were drawn without replacement, the verifier is told they were i.i.d."""
    tree.replacement = True


def _duplicates_dropped(tree):
    """Biased: SpecInfer's repeated i.i.d. draws are forgotten (each child verified once, as if drawn once)."""
    tree.draw_order = None


def _corrupt_proposals(cls, monkeypatch, bug):
    """Every tree ``cls`` proposes is altered by ``bug`` before the verifier sees it."""
    original = cls.propose

    def propose(self, state):
        tree = original(self, state)
        bug(tree)
        return tree

    monkeypatch.setattr(cls, "propose", propose)


@pytest.mark.parametrize("spec,cls,bug", [
    ("rsd-c:branching=3/2", RSDCDrafter, _with_replacement_rule),
    ("rsd-s:width=3:depth=2", RSDSDrafter, _with_replacement_rule),
    ("specinfer:width=4:depth=2", SpecInferDrafter, _duplicates_dropped),
], ids=["rsd-c-with-replacement", "rsd-s-with-replacement", "specinfer-duplicates-dropped"])
def test_negative_control_wrong_rule_is_detected(models, monkeypatch, spec, cls, bug):  # noqa: F811
    # 1,500 samples, more than N_FAST: dropping SpecInfer's duplicate draws is a small bias (its first-token
    # p-value is 1.05e-6 at 1,200 samples, just above FAIL_P)
    target, draft = models
    _corrupt_proposals(cls, monkeypatch, bug)
    counts, _, _ = sample_counts(target, lambda: build_drafter(spec, draft), T1, 3, 1500, seed0=77)
    p = pvalues(counts, exact_joint(target, T1, 3))
    assert min(p.values()) < FAIL_P, f"the bias went undetected (p-values {p})"
