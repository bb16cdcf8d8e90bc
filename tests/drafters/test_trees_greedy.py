"""Greedy (temperature 0) tree drafting must be token-identical to transformers' own greedy ``generate``.

Every tree method, every architecture, the three acceptance regimes of core/test_greedy.py (draft = target: all
accepted; an unrelated random draft: none; a perturbed draft: partial), and every ``max_new_tokens`` near a
tree's depth (the depth is cut to what can still be committed).
"""

from __future__ import annotations

import pytest
from test_greedy import hf_greedy, models, prompts  # noqa: F401 (models: the per-architecture fixture)

import speculant
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import tiny_model

VOCAB = 96
N = 24
# spec -> depth (levels)
METHODS = {
    "specinfer:width=3:depth=3": 3,
    "spectr:width=2:depth=3": 3,
    "rsd-c:branching=3/2/1": 3,
    "rsd-s:width=2:depth=4": 4,
    "tree:budget=10:topk=3:depth=4": 4,
    "tree:budget=10:topk=3:depth=4:calibrate=0": 4,
}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.mark.parametrize("regime", ["all", "none", "partial"])
def test_tree_greedy_matches_transformers(models, regime):  # noqa: F811
    arch, pair = models
    target, draft = pair["all"], pair[regime]
    refs = [(prompt, hf_greedy(target, prompt, N)) for prompt in prompts(seed=len(arch))[1:]]
    taus = {}
    for spec, depth in METHODS.items():
        for prompt, ref in refs:
            gen = speculant.generate(target, prompt, drafter=build_drafter(spec, draft), max_new_tokens=N,
                                     eos_token_id=[])
            assert gen.token_ids == ref, f"{arch} {regime} {spec} prompt={prompt}"
            assert gen.stats.draft_calls <= depth * gen.stats.target_calls  # one draft forward per level
            taus.setdefault(spec, []).append(gen.stats.acceptance_length)
    # the regime is what it claims to be, so each branch of the verifier and of the draft cache is exercised
    for spec, depth in METHODS.items():
        tau = min(taus[spec])
        if regime == "all":
            # top-b children always hold the target's choice; beams and the dynamic tree may prune it
            assert tau >= (0.8 if spec.startswith("rsd-c") else 0.6) * (depth + 1), (spec, taus[spec])
        elif regime == "none":
            assert max(taus[spec]) < 1.35, (spec, taus[spec])
    if regime == "partial":
        assert all(1.1 < max(t) < d + 0.9 for (spec, d), t in zip(METHODS.items(), taus.values())), taus


def test_max_new_tokens_is_exact_at_every_budget():
    target = tiny_model("qwen3", seed=0, vocab_size=VOCAB)
    prompt = prompts(seed=8)[2]
    ref = hf_greedy(target, prompt, 9)
    for spec in METHODS:
        drafter = build_drafter(spec, target)
        for n in range(1, 10):
            assert speculant.generate(target, prompt, drafter=drafter, max_new_tokens=n,
                                      eos_token_id=[]).token_ids == ref[:n], (spec, n)
