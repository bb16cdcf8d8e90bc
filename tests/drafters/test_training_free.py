"""Training-free drafting: prompt lookup and ESP mask-token probing (no draft model).

Greedy output equals transformers' greedy decoding across architectures; attaching mask probes to a forward
does not change the tree nodes' logits; probe slots never remain in the KV cache; sampling keeps the target's
distribution (both drafts are deterministic, verified by the deterministic-draft rule).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import record_caches, sizes
from test_greedy import hf_greedy
from test_sampling_distribution import (
    PASS_P,
    PROMPT,
    exact_joint,
    pvalues,
    sample_counts,
)

import speculant
import speculant.core.sequence
from speculant.core.cache import SpecCache, cache_kwarg
from speculant.core.checks import num_layers
from speculant.drafters.base import DecodeState
from speculant.drafters.lookup_probe import LookupProbeDrafter
from speculant.drafters.lookup import merge_chain
from speculant.drafters.lookup import PromptLookupDrafter, lookup_continuation
from speculant.drafters.mask_probe import MaskProbeDrafter
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import ARCHITECTURES, tiny_model
from speculant.core.tree import TreeAttention
from speculant.core.types import DraftTree, GenerationStats, Probes, SamplingParams

VOCAB = 96
# repetitive prompts, so that lookup finds matches and the target's own loops are copied
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 4, 9, 3, 4, 9, 3, 11, 12, 13, 9, 3], [40]]
SPECS = ["lookup:ngram=2:k=3", "mask-probe", "mask-probe:masks=3:tree=2/2/1:init=last",
         "mask-probe:budget=6:init=random", "mask-probe:ema=0.5", "hybrid", "hybrid:budget=5:ngram=2:k=4:ema=1"]


def test_lookup_continuation():
    assert lookup_continuation([1, 2, 3, 9, 1, 2], ngram=3, k=2) == [3, 9]
    assert lookup_continuation([1, 2, 7, 1, 2, 8, 1, 2], ngram=2, k=3) == [8, 1, 2]  # the most recent match
    assert lookup_continuation([4, 5, 6], ngram=3, k=4) == []
    assert lookup_continuation([1, 2, 3, 4, 2], ngram=1, k=2) == [3, 4]  # falls back to shorter n-grams


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch):
    target = tiny_model(arch, seed=0, vocab_size=VOCAB)
    taus = {}
    for prompt in PROMPTS:
        ref = hf_greedy(target, prompt, 24)
        for spec in SPECS:
            gen = speculant.generate(target, prompt, drafter=build_drafter(spec), max_new_tokens=24,
                                     eos_token_id=[])
            assert gen.token_ids == ref, f"{arch} {spec} prompt={prompt}"
            taus[spec] = max(taus.get(spec, 0.0), gen.stats.acceptance_length)
    assert taus["lookup:ngram=2:k=3"] > 1.0  # the repetitive prompts do get lookup hits: drafts are accepted, not just offered


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_node_logits_unchanged_by_attached_masks(arch):
    """The tree rows of a forward with probe slots equal the same forward without them."""
    target = tiny_model(arch, seed=1, vocab_size=VOCAB)
    prefix = [3, 14, 15, 9, 2, 6]
    tree = DraftTree(tokens=[5, 3, 5, 8], parents=[-1, 0, -1, 2])
    hidden = target.get_input_embeddings().weight.shape[1]
    probes = Probes(anchors=[0, 1, 2, 3, 4], length=2, embeds=torch.randn(10, hidden))
    outs = []
    with torch.inference_mode():
        for with_probes in (False, True):
            cache = SpecCache(num_layers(target), capacity=64)
            target(input_ids=torch.tensor([prefix[:-1]]), **cache_kwarg(target, cache), use_cache=True)
            inputs = torch.tensor([[prefix[-1], *tree.tokens]])
            attn = TreeAttention(target.dtype, target.device)
            if with_probes:
                ext = DraftTree(tokens=[0] * 14, parents=tree.parents + probes.parents(len(tree)))
                mask, pos = attn.build(ext, cache.length)
                out = target(inputs_embeds=speculant.core.sequence._with_probes(target, inputs, probes),
                             attention_mask=mask, position_ids=pos, **cache_kwarg(target, cache), use_cache=True)
            else:
                mask, pos = attn.build(tree, cache.length)
                out = target(input_ids=inputs, attention_mask=mask, position_ids=pos, **cache_kwarg(target, cache),
                             use_cache=True)
            outs.append(out.logits[0, : len(tree) + 1])
    # float noise only (different matmul shapes); a visibility leak would move logits by O(1)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[1].argmax(-1), outs[0].argmax(-1))


def test_mask_slots_never_stay_in_the_cache(monkeypatch):
    """After a mask-probe generation the target cache equals a fresh prefill of the committed tokens (all but
    the last): probe slots and rejected nodes are gone, the accepted path is in place."""
    caches = record_caches(monkeypatch, speculant.core.sequence, "SpecCache")
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    prompt = PROMPTS[1]
    gen = speculant.generate(target, prompt, drafter=MaskProbeDrafter(masks=2, tree=[3, 2]), max_new_tokens=20,
                             eos_token_id=[])
    ids = prompt + gen.token_ids
    (cache,) = caches
    assert cache.length == len(ids) - 1
    fresh = SpecCache(num_layers(target), capacity=64)
    with torch.inference_mode():
        target(input_ids=torch.tensor([ids[:-1]]), **cache_kwarg(target, fresh), use_cache=True)
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_mask_probe_drafts_from_the_masks():
    """The static tree is built from the masks' top candidates with parent-repeat pruning, and every node and the
    root carry ``masks`` probe slots."""
    drafter = MaskProbeDrafter(masks=2, tree=[2, 2])
    drafter._guesses = torch.log_softmax(torch.tensor([[5.0, 4.0, 3.0, 0.0], [0.0, 1.0, 3.0, 2.0]]), -1)
    tokens, parents = drafter._static_tree(root=0, depth=2)
    # mask 1: 0 (= the root, pruned), 1, 2; mask 2 under 1: 2, 3; under 2: 3, 1 (2 pruned)
    assert tokens == [1, 2, 2, 3, 3, 1] and parents == [-1, -1, 0, 0, 1, 1]
    dyn = MaskProbeDrafter(masks=2, budget=3)
    dyn._guesses = drafter._guesses
    tokens, parents = dyn._dynamic_tree(root=0, depth=2)
    assert tokens == [1, 2, 2] and parents == [-1, -1, 0]  # best 2 at depth 1, then the best 1 extension


def test_hybrid_merges_the_lookup_chain_into_the_mask_tree():
    tokens, parents = merge_chain([1, 2, 2, 3], [-1, -1, 0, 0], [1, 3, 7, 8])
    # 1 and 1->3 exist: reused; 7 and 8 appended under them
    assert tokens == [1, 2, 2, 3, 7, 8] and parents == [-1, -1, 0, 0, 3, 4]
    assert merge_chain([1], [-1], [4]) == ([1, 4], [-1, -1])
    drafter = LookupProbeDrafter(masks=2, tree=[2, 1], ngram=2, k=3)
    state = DecodeState(target=tiny_model("llama", vocab_size=VOCAB), ids=[5, 1, 2, 5, 1],
                        params=SamplingParams(temperature=0.0), generator=None, max_length=30, remaining=20,
                        stats=GenerationStats())
    drafter.begin(state)
    drafter._guesses = torch.log_softmax(torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0, 0.0], [0.0, 1.0, 3.0, 2.0, 0, 0]]),
                                         -1)
    tree = drafter.propose(state)
    # mask tree (the root token 1 pruned): 0 (-> 2), 2 (-> 3); the lookup continuation of "5 1" is "2 5 1": it
    # shares the root's child 2, then 5 and 1 are appended below it
    assert tree.tokens == [0, 2, 2, 3, 5, 1] and tree.parents == [-1, -1, 0, 1, 1, 4]
    assert tree.probes.anchors == list(range(7))  # every node, lookup ones included, carries its masks


@pytest.mark.parametrize("n", sizes(2500, id="n"))
@pytest.mark.parametrize("drafter", ["lookup", "mask-probe", "hybrid"])
def test_sampling_keeps_the_target_distribution(drafter, n):
    target = tiny_model("llama", vocab_size=5, init_std=0.2, seed=0)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    # a self-repeating prompt so that lookup proposes (and sometimes loses) drafts
    made = {"lookup": lambda: PromptLookupDrafter(ngram=2, k=2), "mask-probe": lambda: MaskProbeDrafter(masks=2),
            "hybrid": lambda: LookupProbeDrafter(masks=2, ngram=2, k=2)}
    expected = exact_joint(target, params, 3)
    counts, hist, drafted = sample_counts(target, made[drafter], params, 3, n, seed0=31)
    assert drafted > 0 and hist[1:].sum() > 0  # drafts were proposed and some accepted
    bad = {k: p for k, p in pvalues(counts, expected).items() if not p > PASS_P}
    assert not bad, bad
    assert PROMPT and np.isclose(counts.sum(), n)


def test_bad_options():
    for kwargs, msg in [({"tree": [1, 2, 3], "masks": 2}, "tree must be"), ({"tree": [2], "budget": 4}, "not both"),
                        ({"init": "zeros"}, "init must be"), ({"masks": 0}, "masks"), ({"ema": 0.0}, "ema")]:
        with pytest.raises(ValueError, match=msg):
            MaskProbeDrafter(**kwargs)
    with pytest.raises(ValueError, match="ngram"):
        PromptLookupDrafter(ngram=0)
