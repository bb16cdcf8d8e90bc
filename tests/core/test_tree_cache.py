"""Tree attention masks, position ids and the in-place KV cache, checked against real models."""

from __future__ import annotations

import inspect

import pytest
import torch

from speculant.core.cache import SpecCache, cache_kwarg, output_cache
from speculant.core.checks import num_layers
from speculant.tiny_models import tiny_model
from speculant.core.tree import TreeAttention, ancestor_matrix
from speculant.core.types import DraftTree

VOCAB = 96
# root -> a, b ; a -> c, d ; c -> e ; b -> f     (node indices 0..5)
BRANCHY = DraftTree(tokens=[10, 11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2, 1])


def test_draft_tree_structure():
    t = BRANCHY
    assert t.depths == [1, 1, 2, 2, 3, 2]
    assert t.children == [[0, 1], [2, 3], [5], [4], [], [], []]
    assert t.max_depth == 3 and not t.is_chain()
    assert DraftTree.chain([5, 6, 7]).is_chain() and DraftTree.chain([5, 6, 7]).parents == [-1, 0, 1]
    with pytest.raises(ValueError):
        DraftTree(tokens=[1, 2], parents=[1, -1])  # a parent must precede its child


def test_ancestor_matrix():
    chain = ancestor_matrix((-1, 0, 1))
    assert torch.equal(chain, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    vis = ancestor_matrix(tuple(BRANCHY.parents))
    # node 4 (row 5) sees root, 0, 2, itself
    assert vis[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    # node 5 (row 6) sees root, 1, itself
    assert vis[6].nonzero().flatten().tolist() == [0, 2, 6]


def test_mask_buffer_reuse_equals_fresh_build():
    reused = TreeAttention(torch.float32, torch.device("cpu"))
    steps = [(BRANCHY, 7), (DraftTree.chain([1, 2, 3]), 12), (BRANCHY, 9), (DraftTree.chain([4]), 300)]
    for tree, cache_len in steps:
        m1, p1 = reused.build(tree, cache_len)
        m2, p2 = TreeAttention(torch.float32, torch.device("cpu")).build(tree, cache_len)
        assert torch.equal(m1, m2) and torch.equal(p1, p2)
        q = len(tree) + 1
        assert m1.shape == (1, 1, q, cache_len + q)
        assert (m1[..., :cache_len] == 0).all()  # the whole cache is visible
        assert p1[0].tolist() == [cache_len + d for d in [0] + tree.depths]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "gpt_neox", "phi"])
def test_tree_forward_matches_sequential_paths(arch):
    """One forward over [root] + tree gives, at each node, the logits of decoding its path token by token."""
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    prefix = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    root = prefix[-1]
    cache = SpecCache(num_layers(model))
    with torch.inference_mode():
        model(input_ids=torch.tensor([prefix[:-1]]), **cache_kwarg(model, cache), use_cache=True)
        mask, pos = TreeAttention(model.dtype, model.device).build(BRANCHY, cache.length)
        out = model(input_ids=torch.tensor([[root] + BRANCHY.tokens]), **cache_kwarg(model, cache),
                    attention_mask=mask, position_ids=pos, use_cache=True).logits[0]
        for node in range(-1, len(BRANCHY)):
            path = []
            n = node
            while n >= 0:
                path.insert(0, BRANCHY.tokens[n])
                n = BRANCHY.parents[n]
            ref = model(input_ids=torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(out[node + 1], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cache_keep_leaves_exactly_the_accepted_path(arch):
    """After a tree forward, keeping root + an accepted path makes the cache equal to a prefill of that path."""
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    prefix = torch.randint(2, VOCAB, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        cache = SpecCache(num_layers(model), capacity=4)  # tiny capacity: exercises growth too
        model(input_ids=torch.tensor([prefix[:-1]]), **cache_kwarg(model, cache), use_cache=True)
        start = cache.length
        mask, pos = TreeAttention(model.dtype, model.device).build(BRANCHY, start)
        model(input_ids=torch.tensor([[prefix[-1]] + BRANCHY.tokens]), **cache_kwarg(model, cache),
              attention_mask=mask, position_ids=pos, use_cache=True)
        accepted = [1, 5]  # b -> f: non-contiguous slots
        cache.keep(start, [start] + [start + 1 + n for n in accepted])
        path = prefix + [BRANCHY.tokens[n] for n in accepted]
        assert cache.length == len(path)
        ref = SpecCache(num_layers(model))
        model(input_ids=torch.tensor([path]), **cache_kwarg(model, ref), use_cache=True)
        for got, want in zip(cache.layers, ref.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        # decoding continues identically from the compacted cache
        nxt = model(input_ids=torch.tensor([[7]]), **cache_kwarg(model, cache), use_cache=True).logits[0, -1]
        full = model(input_ids=torch.tensor([path + [7]])).logits[0, -1]
        torch.testing.assert_close(nxt, full, atol=1e-4, rtol=1e-4)


def test_growing_layer_append_crop_keep():
    cache = SpecCache(num_layers=1, capacity=2)
    layer = cache.layers[0]
    k = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1)
    layer.update(k[:, :, :3], -k[:, :, :3])
    layer.update(k[:, :, 3:10], -k[:, :, 3:10])  # grows past capacity, keeps content
    assert cache.length == 10 and layer.keys.flatten().tolist() == list(range(10))
    cache.crop(-2)
    assert layer.keys.flatten().tolist() == list(range(8))
    cache.crop(6)
    assert layer.values.flatten().tolist() == [-float(i) for i in range(6)]
    cache.keep(2, [3, 5])
    assert layer.keys.flatten().tolist() == [0, 1, 3, 5]
    cache.keep(2, [2, 3])  # contiguous: a crop, nothing moves
    assert layer.keys.flatten().tolist() == [0, 1, 3, 5]
    assert cache.nbytes() == 2 * 4 * 4
    with pytest.raises(ValueError):
        cache.crop(9)


def test_cache_kwarg_follows_the_forward_signature():
    """The cache goes in under the name the model's forward declares (``cache`` from transformers 5.24,
    ``past_key_values`` before) and comes back from the output under either name."""
    model = tiny_model("llama")
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = SpecCache(num_layers(model))
    assert cache_kwarg(model, cache) == {name: cache}
    out = model(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwarg(model, cache), use_cache=True)
    assert output_cache(out) is cache and cache.get_seq_length() == 3
    assert output_cache({"past_key_values": cache}) is cache and output_cache({"cache": cache}) is cache
    assert output_cache({"input_ids": None}) is None
