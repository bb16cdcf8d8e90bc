"""A draft-model tree with the prompt-lookup chain merged in (``lookup=N``): exact, and both drafts are verified."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.models.attached import build_attached
from speculant.drafters.base import DecodeState
from speculant.drafters.lookup import lookup_continuation
from speculant.drafters.model_lookup import ModelWithLookup
from speculant.tiny_models import perturbed, tiny_model
from speculant.core.types import SamplingParams

from helpers import sizes

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=1)
    return target, perturbed(target, 0.3, seed=2)


@pytest.mark.parametrize("spec", ["chain:k=3:lookup=6", "tree:lookup=5", "tree:budget=6:depth=2:lookup=8"])
def test_greedy_equals_plain_decoding(pair, spec):
    target, draft = pair
    plain = speculant.generate(target, REPEATING, max_new_tokens=40, eos_token_id=[])
    gen = speculant.generate(target, REPEATING, drafter=speculant.build_drafter(spec, draft), max_new_tokens=40,
                             eos_token_id=[])
    assert gen.token_ids == plain.token_ids


def test_feature_drafter_with_lookup_equals_plain_decoding(pair):
    target, _ = pair
    feature = build_attached(target, [0], features=True)
    plain = speculant.generate(target, REPEATING, max_new_tokens=30, eos_token_id=[])
    drafter = speculant.build_drafter("chain:k=2:lookup=5", feature)
    assert isinstance(drafter, ModelWithLookup) and drafter.uses_target_hidden
    gen = speculant.generate(target, REPEATING, drafter=drafter, max_new_tokens=30, eos_token_id=[])
    assert gen.token_ids == plain.token_ids


def test_the_tree_holds_the_inner_draft_and_the_lookup_chain(pair):
    target, draft = pair
    inner = speculant.build_drafter("chain:k=3", draft)
    drafter = ModelWithLookup(speculant.build_drafter("chain:k=3", draft), k=4)
    state = lambda: DecodeState(target=target, ids=list(REPEATING), params=SamplingParams(),  # noqa: E731
                                generator=torch.Generator(), max_length=60, remaining=40)
    s1, s2 = state(), state()
    inner.begin(s1)
    drafter.begin(s2)
    own = inner.propose(s1)
    merged = drafter.propose(s2)
    assert merged.tokens[: len(own)] == own.tokens and merged.parents[: len(own)] == own.parents
    chain = lookup_continuation(REPEATING, 3, 4)
    assert chain == [7, 8, 9, 5]
    node, path = -1, []
    for tok in chain:  # the lookup chain is a path from the root
        node = next(c for c in merged.children[node + 1] if merged.tokens[c] == tok)
        path.append(node)
    assert len(path) == 4 and merged.draft_probs is None


@pytest.mark.parametrize("n", sizes(2000, id="n"))
@pytest.mark.parametrize("spec", ["tree:budget=4:topk=2:depth=2:lookup=3", "chain:k=2:lookup=3"])
def test_sampling_with_lookup_merged_matches_the_target_distribution(spec, n):
    """The dynamic tree drafts deterministically; a sampled chain with lookup merged in drops its q and is verified
    as a deterministic draft (point masses); steps without a lookup match keep speculative sampling. Both give
    the target's distribution."""
    from test_sampling_distribution import VOCAB, exact_joint, pvalues, sample_counts

    target = tiny_model("llama", vocab_size=VOCAB, init_std=0.2, seed=0)
    draft = perturbed(target, scale=0.3, seed=5)
    params = SamplingParams(temperature=1.0)
    counts, hist, drafted = sample_counts(target, lambda: speculant.build_drafter(spec, draft), params, 3, n,
                                          seed0=4242)
    assert hist[1:].sum() > 100  # drafts were accepted
    bad = {name: p for name, p in pvalues(counts, exact_joint(target, params, 3)).items() if not p > 1e-4}
    assert not bad, f"empirical distribution differs from the target's: p-values {bad}"


def test_a_sampled_chain_with_a_lookup_match_drops_its_draft_distribution(pair):
    """On a repeating prompt the lookup branch is merged into the sampled chain: that step's tree has no q."""
    big, small = pair
    chain = speculant.build_drafter("chain:k=2:lookup=4", small)
    trees = []
    original = chain.propose

    def spy(state):
        trees.append(original(state))
        return trees[-1]

    chain.propose = spy
    gen = speculant.generate(big, REPEATING, drafter=chain, max_new_tokens=8, temperature=0.7, seed=0)
    assert len(gen.token_ids) == 8
    assert any(t.draft_probs is None and len(t.tokens) > 2 for t in trees)
