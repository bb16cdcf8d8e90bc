"""KV-cache eviction: policies, CAOTE, the budgeted cache and block-wise prefill (speculant.kv)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from speculant.kv import (
    CAOTE,
    H2O,
    TOVA,
    BudgetCache,
    KeyDiff,
    KeyNorm,
    MassPolicy,
    Protect,
    QueryCapture,
    ScoreContext,
    ScorePolicy,
    SnapKV,
    Streaming,
    attention_probs,
    caote_scores,
    evict,
    parse_policy,
    pin_window,
    policy_names,
    prefill_blockwise,
)
from speculant.core.cache import cache_kwarg
from speculant.kv import budget as kv_budget
from speculant.kv.registry import POLICIES
from speculant.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

ALL_SPECS = [*POLICIES, "caote:h2o", "fastcaote:snapkv", "caote:keydiff", "protect:tova", "caote:protect:snapkv",
             "caote:h2o-acc", "snapkv:passes=2", "caote:snapkv:passes=2"]


@dataclass
class Fixed(ScorePolicy):
    """Test policy returning given scores."""

    scores: torch.Tensor

    def score(self, keys, values, ctx):
        return self.scores


@dataclass
class FixedMass(MassPolicy):
    """Test policy with a given base score and given pinned tokens."""

    base: torch.Tensor
    pins: torch.Tensor

    def mass(self, keys, values, ctx):
        return self.base

    def pinned(self, ctx):
        return self.pins


def _ids(n: int, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _filled_cache(t: int, heads: int = 3, dim: int = 4, layers: int = 2, seed: int = 0) -> BudgetCache:
    gen = torch.Generator().manual_seed(seed)
    cache = BudgetCache(layers, capacity=t)
    for layer in range(layers):
        cache.update(torch.randn(1, heads, t, dim, generator=gen), torch.randn(1, heads, t, dim, generator=gen), layer)
    return cache


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", context=2048)


# ---------------------------------------------------------------- selection and eviction


def test_evict_keeps_exactly_the_top_scores_per_head():
    t, n = 20, 7
    cache = _filled_cache(t)
    keys0, values0 = cache.layers[1].keys.clone(), cache.layers[1].values.clone()
    scores = torch.randint(0, 5, (1, 3, t), generator=torch.Generator().manual_seed(1)).float()  # many ties
    assert evict(cache, Fixed(scores), n) == t - n
    layer = cache.layers[1]
    assert layer.keys.shape == (1, 3, n, 4) and cache.length == n
    for h in range(3):
        kept = layer.positions[0, h].tolist()
        assert kept == sorted(kept)
        # exactly the top n, ties broken towards the earlier slot (stable, deterministic)
        ranked = sorted(range(t), key=lambda i: (-scores[0, h, i].item(), i))[:n]
        assert kept == sorted(ranked)
        assert torch.equal(layer.keys[0, h], keys0[0, h, kept])
        assert torch.equal(layer.values[0, h], values0[0, h, kept])


def test_evict_protects_the_last_tokens_and_validates():
    cache = _filled_cache(10)
    scores = torch.arange(10, 0, -1).float().expand(1, 3, 10)  # prefers the earliest
    evict(cache, Fixed(scores), 5, protect_last=2)
    assert cache.positions(0)[0, 0].tolist() == [0, 1, 2, 8, 9]
    with pytest.raises(ValueError, match="protect"):
        evict(cache, Fixed(scores), 2, protect_last=3)
    with pytest.raises(ValueError, match="needs attention"):
        evict(_filled_cache(10), H2O(), 5)


def test_budget_at_least_length_is_a_no_op():
    cache = _filled_cache(12)
    keys = cache.layers[0].keys.clone()
    assert evict(cache, KeyDiff(), 12) == 0
    assert torch.equal(cache.layers[0].keys, keys) and cache.positions(0)[0, 0].tolist() == list(range(12))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_blockwise_prefill_with_large_budget_matches_full_prefill(llama, spec):
    ids = _ids(150)
    with torch.no_grad():
        full = llama(input_ids=ids).logits[:, -1]
    cache = BudgetCache(2, capacity=160)
    last = prefill_blockwise(llama, ids, cache, parse_policy(spec), budget=160, block=32)
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-4)
    assert cache.length == 150 and cache.next_position == 150


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_budget_no_op_greedy_continuation_other_architectures(arch):
    model = tiny_model(arch, context=2048)
    ids = _ids(90, seed=3)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 90:].tolist()
        cache = BudgetCache(2, capacity=128)
        logits = prefill_blockwise(model, ids, cache, KeyDiff(), budget=128, block=16)
        out = []
        for _ in range(8):
            tok = int(logits.argmax(-1))
            out.append(tok)
            step = model(input_ids=torch.tensor([[tok]]), **cache_kwarg(model, cache),
                         position_ids=cache.position_ids(1), use_cache=True)
            logits = step.logits[:, -1]
            evict(cache, KeyDiff(), 128)
    assert out == ref


def test_evicted_cache_continues_with_original_positions(llama):
    """One block, then StreamingLLM eviction: decoding the next token from the small cache must equal a full
    forward in which the last query sees only the kept tokens (at their original positions)."""
    t, n, nxt = 64, 20, 7
    ids = _ids(t, seed=5)
    cache = BudgetCache(2, capacity=t + 1)
    prefill_blockwise(llama, ids, cache, Streaming(sinks=4), budget=n, block=t)
    kept = list(range(4)) + list(range(t - n + 4, t))
    assert cache.positions(1)[0, 1].tolist() == kept and cache.next_position == t
    with torch.no_grad():
        got = llama(input_ids=torch.tensor([[nxt]]), **cache_kwarg(llama, cache), position_ids=cache.position_ids(1)).logits
        allowed = torch.ones(t + 1, t + 1).tril().bool()
        allowed[t, :t] = False
        allowed[t, kept] = True
        mask = torch.zeros(1, 1, t + 1, t + 1).masked_fill(~allowed, torch.finfo(torch.float32).min)
        ref = llama(input_ids=torch.cat([ids, torch.tensor([[nxt]])], 1), attention_mask=mask).logits
    torch.testing.assert_close(got[0, -1], ref[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["keydiff", "caote:h2o", "snapkv", "caote:snapkv:passes=2"])
def test_peak_kv_bytes_bounded_by_budget_plus_block(llama, spec):
    n, b = 32, 16
    cache = BudgetCache(2, capacity=n + b)
    prefill_blockwise(llama, _ids(8 * n, seed=2), cache, parse_policy(spec), budget=n, block=b)
    per_token = 2 * 2 * 2 * 8 * 4  # layers * (k, v) * kv heads * head dim * fp32 bytes
    assert cache.length == n and cache.next_position == 8 * n
    assert cache.peak_nbytes <= (n + b) * per_token
    assert cache.allocated_nbytes() <= (n + b) * per_token  # the buffers never grew
    assert cache.nbytes() == n * per_token


def test_snapkv_two_passes_score_earlier_blocks_with_the_prompts_last_window(llama, monkeypatch):
    """passes=2: a first pass (scratch cache) ends with the last block's observation window; the second pass scores
    every block before the last by those queries' plain softmax over the block's cache (no causal mask: they come
    after every cached token) and its last block with its own window, as one pass does; the peak KV is one pass's."""
    ids, snap = _ids(100), SnapKV(window=8, passes=2)
    observers = {}
    with torch.no_grad():
        kv_budget._prefill_pass(llama, ids, BudgetCache(2, capacity=64), snap, 24, 32, False, (), None, None,
                                queries_out=observers)
    heads = llama.config.num_attention_heads
    dim = llama.config.hidden_size // heads
    assert sorted(observers) == [0, 1] and observers[0].shape == (1, heads, 4, dim)  # last block: 4 tokens < 8

    seen = []
    original = kv_budget.evict

    def spy(cache, policy, budget, protect_last=0, attn=None):
        seen.append(({i: layer.keys.clone() for i, layer in enumerate(cache.layers)}, attn))
        return original(cache, policy, budget, protect_last, attn)

    monkeypatch.setattr(kv_budget, "evict", spy)
    one, two = BudgetCache(2, capacity=64), BudgetCache(2, capacity=64)
    with torch.no_grad():
        prefill_blockwise(llama, ids, one, SnapKV(window=8), 24, block=32)
        seen.clear()
        prefill_blockwise(llama, ids, two, snap, 24, block=32)
    assert len(seen) == 8  # 4 blocks per pass
    scaling = llama.model.layers[0].self_attn.scaling
    for keys, attn in seen[4:7]:  # the second pass's blocks before the last
        for i, q in observers.items():
            k = keys[i].float().repeat_interleave(heads // keys[i].shape[1], dim=1)
            torch.testing.assert_close(attn[i], torch.softmax(q.float() @ k.transpose(-1, -2) * scaling, -1))
    assert seen[7][1][0].shape[2] == 4  # the last block: its own (causal) window
    assert two.peak_nbytes == one.peak_nbytes and two.length == 24 and two.next_position == 100
    with pytest.raises(ValueError, match="snapkv passes must be 1 or 2"):
        SnapKV(passes=0)


def test_engine_style_tree_step_keeps_path_positions_and_rollback():
    cache = _filled_cache(10)
    evict(cache, Streaming(sinks=2), 6)  # positions 0, 1, 6..9; next position 10
    base = cache.length
    for layer in range(2):  # root + a 4-node tree appended: slots 6..10
        cache.update(torch.zeros(1, 3, 5, 4), torch.zeros(1, 3, 5, 4), layer)
    cache.keep(base, [base, base + 2, base + 4])  # root, then accepted nodes 1 and 3 (a path)
    assert cache.positions(0)[0, 0].tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 12]
    assert cache.next_position == 13
    for layer in range(2):
        cache.update(torch.zeros(1, 3, 3, 4), torch.zeros(1, 3, 3, 4), layer)
    cache.crop(cache.length - 2)
    assert cache.next_position == 14 and cache.positions(1)[0, 2].tolist()[-1] == 13


# ---------------------------------------------------------------- CAOTE


def test_caote_score_equals_brute_force_output_change():
    gen = torch.Generator().manual_seed(0)
    alpha = torch.rand(2, 3, 9, generator=gen)
    alpha /= alpha.sum(-1, keepdim=True)
    v = torch.randn(2, 3, 9, 5, generator=gen)
    x = (alpha[..., None] * v).sum(2)  # [B, H, Dv]
    brute = torch.empty_like(alpha)
    for j in range(9):
        a = alpha.clone()
        a[..., j] = 0
        x_minus = (a[..., None] * v).sum(2) / a.sum(-1, keepdim=True)  # output with j removed, renormalised
        brute[..., j] = (x - x_minus).norm(dim=-1)
    torch.testing.assert_close(caote_scores(alpha, v), brute)
    # the wrapper normalises an unnormalised attention mass to alpha first
    wrapped = CAOTE(FixedMass(alpha * 7.0, torch.zeros(2, 3, 9, dtype=torch.bool))).score(torch.zeros(2, 3, 9, 4), v, ScoreContext(positions=torch.zeros(2, 3, 9)))
    torch.testing.assert_close(wrapped, brute)
    fast = caote_scores(alpha, v, fast=True)
    torch.testing.assert_close(fast, alpha / (1 - alpha) * (v.mean(2, keepdim=True) - v).norm(dim=-1))
    # pinned tokens (a recent window) stay in alpha and in X: the unpinned scores are still the exact output
    # change of removing that token from the full attention, and the pinned ones are kept (+inf)
    pins = torch.zeros(2, 3, 9, dtype=torch.bool)
    pins[..., -3:] = True
    ctx = ScoreContext(positions=torch.arange(9).expand(2, 3, 9))
    got = CAOTE(FixedMass(alpha * 3.0, pins)).score(torch.zeros(2, 3, 9, 4), v, ctx)
    torch.testing.assert_close(got[..., :6], brute[..., :6])
    assert (got[..., 6:] == math.inf).all()
    # ... which differs from leaving the pinned tokens' mass out of alpha
    rest = alpha.masked_fill(pins, 0.0)
    assert not torch.allclose(got[..., :6], caote_scores(rest / rest.sum(-1, keepdim=True), v)[..., :6])


def test_caote_keeps_inner_protection():
    s = torch.tensor([[[0.5, math.inf, 0.2, 0.3]]])
    out = CAOTE(Fixed(s)).score(torch.zeros(1, 1, 4, 2), torch.randn(1, 1, 4, 2), ScoreContext(torch.zeros(1, 1, 4)))
    assert out[0, 0, 1] == math.inf and torch.isfinite(out[0, 0, [0, 2, 3]]).all()


def test_caote_over_h2o_uses_the_recent_windows_attention():
    """caote:h2o: alpha is the accumulated attention of every token, the pinned recent window's included."""
    t, budget = 8, 4
    gen = torch.Generator().manual_seed(3)
    acc = torch.rand(1, 2, t, generator=gen)
    v = torch.randn(1, 2, t, 3, generator=gen)
    ctx = ScoreContext(positions=torch.arange(t).expand(1, 2, t), accumulated=acc, budget=budget)
    got = CAOTE(H2O()).score(torch.zeros(1, 2, t, 3), v, ctx)
    want = caote_scores(acc / acc.sum(-1, keepdim=True), v)
    torch.testing.assert_close(got[..., :6], want[..., :6])
    assert (got[..., 6:] == math.inf).all()  # recent window: int(0.5 * 4) = 2 tokens


# ---------------------------------------------------------------- policies


def _ctx(t: int, heads: int = 2, attn=None, acc=None, budget=None) -> ScoreContext:
    return ScoreContext(positions=torch.arange(t).expand(1, heads, t), accumulated=acc, attn=attn, budget=budget)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_policy_scores_have_the_right_shape(spec):
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 11, 4, generator=gen), torch.randn(1, 2, 11, 6, generator=gen)
    attn = torch.rand(1, 4, 3, 11, generator=gen).softmax(-1)  # 4 query heads over 2 KV heads
    ctx = _ctx(11, attn=attn, acc=torch.rand(1, 2, 11, generator=gen), budget=6)
    policy = parse_policy(spec)
    scores = policy.score(keys, values, ctx)
    assert scores.shape == (1, 2, 11) and not scores.isnan().any()
    base, pinned = policy.parts(keys, values, ctx)
    assert base.shape == pinned.shape == (1, 2, 11) and pinned.dtype == torch.bool and torch.isfinite(base).all()
    torch.testing.assert_close(base.masked_fill(pinned, math.inf), scores.float())


def test_keydiff_prefers_the_outlier_key():
    keys = torch.zeros(1, 2, 8, 3)
    keys[..., 0] = torch.linspace(1, 3, 8)  # all along e1, different norms
    keys[0, :, 5] = torch.tensor([0.0, 2.0, 0.0])  # the outlier
    for policy in (KeyDiff(), KeyDiff(raw_mean=True)):
        s = policy.score(keys, torch.zeros(1, 2, 8, 3), _ctx(8))
        assert (s.argmax(-1) == 5).all()
        assert torch.allclose(s[..., [0, 1, 2, 3, 4, 6, 7]], s[..., :1])  # same direction, same score


def test_streaming_keeps_sinks_and_recent():
    cache = _filled_cache(30, heads=2)
    evict(cache, Streaming(sinks=3), 8)
    assert cache.positions(0)[0, 1].tolist() == [0, 1, 2, 25, 26, 27, 28, 29]


def test_knorm_keeps_low_norm_keys():
    keys = torch.ones(1, 1, 5, 2) * torch.tensor([3.0, 0.5, 2.0, 0.1, 1.0])[None, None, :, None]
    order = KeyNorm().score(keys, keys, _ctx(5, heads=1)).argsort(-1, descending=True)
    assert order[0, 0].tolist() == [3, 1, 4, 2, 0]


def test_attention_policies_rank_by_attention():
    t = 6
    attn = torch.full((1, 4, 2, t), 0.01)
    attn[:, :, -1, 2] = 0.9  # the last query looks at token 2
    attn[:, :, 0, 4] = 0.9  # an earlier query looks at token 4
    keys = torch.zeros(1, 2, t, 4)
    assert (TOVA().score(keys, keys, _ctx(t, attn=attn)).argmax(-1) == 2).all()
    snap = SnapKV(window=2, kernel=1).score(keys, keys, _ctx(t, attn=attn))
    assert (snap[..., -2:] == math.inf).all() and (snap[..., :4].argmax(-1) == 2).all()
    acc = torch.tensor([0.1, 3.0, 0.2, 0.0, 1.0, 0.5]).expand(1, 2, t)
    pure = H2O(recent_fraction=0.0).score(keys, keys, _ctx(t, acc=acc))
    torch.testing.assert_close(pure, acc)  # h2o-acc: the accumulated attention alone
    assert torch.equal(parse_policy("h2o-acc").score(keys, keys, _ctx(t, acc=acc)), pure)
    h2o = H2O().score(keys, keys, _ctx(t, acc=acc, budget=4))  # recent window int(0.5 * 4) = 2
    assert (h2o[..., -2:] == math.inf).all() and torch.equal(h2o[..., :4], acc[..., :4])
    with pytest.raises(ValueError, match="budget"):
        H2O().score(keys, keys, _ctx(t, acc=acc))
    prot = Protect(H2O(recent_fraction=0.0), sinks=1, recent=1).score(keys, keys, _ctx(t, acc=acc))
    assert prot[0, 0, 0] == math.inf and prot[0, 0, -1] == math.inf and prot[0, 0, 3] == 0.0
    # Protect's parts keep the inner base (the attention mass) of the tokens it pins
    base, pinned = Protect(H2O(), sinks=1, recent=1).parts(keys, keys, _ctx(t, acc=acc, budget=2))
    torch.testing.assert_close(base, acc)
    assert pinned[0, 0].tolist() == [True, False, False, False, False, True]


def test_pin_window():
    pos = torch.tensor([[[0, 1, 5, 9, 12, 13]]])
    assert pin_window(pos, sinks=2, recent=2)[0, 0].tolist() == [True, True, False, False, True, True]
    assert not pin_window(pos).any()


def test_h2o_keeps_the_recent_half_of_the_budget_and_the_heavy_hitters():
    """Evicted through evict() (which passes the budget): budget 6 = 3 recent tokens + the 3 heaviest older
    ones. Without the window (h2o-acc) the fresh tokens, which have accumulated little, are evicted."""
    t = 12
    acc = torch.tensor([5.0, 0.1, 4.0, 0.2, 0.3, 3.0, 0.1, 2.5, 0.2, 0.0, 0.1, 0.0])
    for policy, kept in ((H2O(), [0, 2, 5, 9, 10, 11]), (H2O(recent_fraction=0.0), [0, 2, 3, 4, 5, 7])):
        cache = _filled_cache(t, heads=2)
        for layer in cache.layers:
            layer.accumulated.copy_(acc.expand(1, 2, t))
        evict(cache, policy, 6, attn={})
        assert cache.positions(0)[0, 1].tolist() == kept
    with pytest.raises(ValueError, match="recent_fraction"):
        H2O(recent_fraction=1.5)


def test_random_is_seeded():
    keys = torch.zeros(1, 2, 9, 4)
    a = parse_policy("random").score(keys, keys, _ctx(9))
    assert torch.equal(a, parse_policy("random").score(keys, keys, _ctx(9)))
    assert a.shape == (1, 2, 9)


def test_parse_policy_and_names():
    p = parse_policy("caote:h2o")
    assert isinstance(p, CAOTE) and isinstance(p.inner, H2O) and not p.fast and p.needs_attention
    q = parse_policy("fastcaote:protect:keydiff")
    assert q.fast and isinstance(q.inner, Protect) and isinstance(q.inner.inner, KeyDiff) and not q.needs_attention
    assert q.name == "fastcaote:protect:keydiff"
    assert "keydiff" in policy_names() and "caote:" in policy_names()
    with pytest.raises(ValueError, match="unknown KV policy"):
        parse_policy("nope")
    with pytest.raises(ValueError, match="wrapper"):
        parse_policy("bad:h2o")
    # options after the base policy set its int/float/bool fields
    w = parse_policy("caote:snapkv:window=32:kernel=3")
    assert isinstance(w.inner, SnapKV) and (w.inner.window, w.inner.kernel) == (32, 3) and w.inner.queries == 32
    for bad, message in [("snapkv:size=3", "unknown option 'size' of KV policy 'snapkv'.*its options: window, kernel"),
                         ("snapkv:window=x", "bad value 'x' for option 'window' of KV policy 'snapkv': expected int"),
                         ("window=3:snapkv", "expected \\[wrapper:\\]\\*policy"),
                         ("snapkv:window=3:window=4", "given twice"),
                         ("speckv:passes=3", "passes must be 1 or 2")]:
        with pytest.raises(ValueError, match=message):
            parse_policy(bad)


# ---------------------------------------------------------------- attention from captured queries


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_captured_queries_give_the_models_attention(arch):
    model = tiny_model(arch, context=2048)
    ids = _ids(24, seed=4)
    cache = BudgetCache(2, capacity=24)
    with torch.no_grad(), QueryCapture(model, last=5) as cap:
        model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True)
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            ref = model(input_ids=ids, output_attentions=True).attentions  # per layer [B, H_q, T, T]
    finally:
        model.config._attn_implementation = "sdpa"
    for layer in range(2):
        got = attention_probs(cap.queries[layer], cache.layers[layer].keys, cap.scaling(layer))
        torch.testing.assert_close(got, ref[layer][:, :, -5:], rtol=1e-4, atol=1e-5)


def test_attention_policies_reject_unsupported_architectures():
    with pytest.raises(ValueError, match="attention-based KV policies"):
        QueryCapture(tiny_model("gpt2"))


# ---------------------------------------------------------------- evaluation and CLI


class CharTokenizer:
    """A stand-in tokenizer for the tiny models: one id per character."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + ord(c) % 90 for c in text]}

    def __len__(self):
        return 96


def _small_eval_config(**kw):
    from speculant.bench.kv_fidelity import EvalConfig

    base = {"policies": "keydiff,caote:h2o", "seq_len": 96, "tail": 6, "retrieval_pairs": 3,
            "retrieval_examples": 2, "memory_lengths": "64,256", "block": 16, "files": 2}
    return EvalConfig(**{**base, **kw})


def test_eval_with_budget_above_length_matches_the_full_cache(llama):
    from speculant.bench.kv_fidelity import run_eval

    report = run_eval(llama, CharTokenizer(), _small_eval_config(budgets="512"))
    assert [r["policy"] for r in report["results"]] == ["keydiff", "caote:h2o"]
    for r in report["results"]:
        assert r["top1_agreement"] == 1.0 and abs(r["kl"]) < 1e-4 and abs(r["nll_ratio"] - 1) < 1e-4
        assert r["files"] == 2 and len(r["per_file"]) == 2 and r["positions"] == 12
        assert len({f["name"] for f in r["per_file"]}) == 2  # two different held-out modules
        assert r["retrieval_accuracy"] == r["full_retrieval_accuracy"]
        assert abs(r["retrieval_answer_nll"] - r["full_retrieval_answer_nll"]) < 1e-3


def test_eval_small_budget_bounds_memory(llama):
    from speculant.bench.kv_fidelity import run_eval

    report = run_eval(llama, CharTokenizer(), _small_eval_config(policies="streaming", budget_fraction=0.25))
    (r,) = report["results"]
    assert r["budget"] == 24 and 0 <= r["top1_agreement"] <= 1 and r["kl"] >= -1e-6
    per_token = 2 * 2 * 2 * 8 * 4
    short, long = report["memory"]
    assert short["budget"] == 16 and long["full_peak_kv_bytes"] == 256 * per_token
    assert long["budget_peak_kv_bytes"] <= (16 + 16) * per_token


def test_eval_reports_the_mean_over_texts_and_each_text(llama):
    from speculant.bench.kv_fidelity import fidelity, run_eval

    texts = {"a": "def f(x):\n    return x + 1\n" * 5, "b": "import os\nprint(os.getcwd())\n" * 4}
    report = run_eval(llama, CharTokenizer(), _small_eval_config(policies="streaming", budgets="20", tail=10), texts)
    (r,) = report["results"]
    assert [f["name"] for f in r["per_file"]] == ["a", "b"] and r["positions"] == 20
    for f in r["per_file"]:  # each text's numbers are fidelity() on that text alone
        ids = torch.tensor([CharTokenizer()(texts[f["name"]])["input_ids"][:96]])
        one = fidelity(llama, ids, parse_policy("streaming"), 20, tail=10, block=16)
        assert f["top1_agreement"] == one.top1_agreement and f["kl"] == pytest.approx(one.kl, rel=1e-5)
    for key in ("kl", "top1_agreement", "nll_ratio"):
        assert r[key] == pytest.approx(sum(f[key] for f in r["per_file"]) / 2)
    assert r["kl"] > 0 and r["kl_se"] > 0 and r["top1_agreement_se"] >= 0


@pytest.mark.parametrize("fmt", ["repeat", "lookup"])
def test_retrieval_prompts_ask_for_one_entry(fmt):
    import re

    from speculant.bench.kv_fidelity import retrieval_prompts

    examples = retrieval_prompts(n_pairs=10, n_examples=5, seed=1, fmt=fmt)
    assert examples == retrieval_prompts(n_pairs=10, n_examples=5, seed=1, fmt=fmt)  # seeded
    for prompt, answer in examples:
        table = dict(re.findall(r'^    "(\w+)": "(\d+)",$', prompt.split("}")[0], flags=re.MULTILINE))
        assert len(table) == 10
        key = re.findall(r'"(\w+)"', prompt.splitlines()[-1])[-1]
        assert answer == table[key] + '"'
        if fmt == "repeat":  # the query line is the entry's exact prefix
            assert prompt.endswith(f'    "{key}": "') and f'    "{key}": "{answer},' in prompt
        else:
            assert prompt.endswith(f'assert table["{key}"] == "')
    with pytest.raises(ValueError, match="retrieval format"):
        retrieval_prompts(fmt="nope")


def test_kv_eval_cli_json(llama, monkeypatch, capsys, tmp_path):
    import argparse
    import json

    import speculant.models.loading
    from speculant.commands import kv_eval

    monkeypatch.setattr(speculant.models.loading, "resolve_model", lambda name: name)
    monkeypatch.setattr(speculant.models.loading, "check_model_dir", lambda path: path)  # resolved by the session
    monkeypatch.setattr(speculant.models.loading, "load_model_dir",
                        lambda path, dtype=None, quantization=None: (llama, CharTokenizer()))
    parser = argparse.ArgumentParser()
    kv_eval.add_arguments(parser)
    args = parser.parse_args(["--policies", "snapkv", "--budgets", "32,48", "--seq-len", "80", "--tail", "4",
                              "--files", "2", "--retrieval-pairs", "3", "--retrieval-examples", "1",
                              "--memory-lengths", "64", "--block", "16", "--json", "--out", str(tmp_path)])
    assert kv_eval.run(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["policy"], r["budget"]) for r in report["results"]] == [("snapkv", 32), ("snapkv", 48)]
    for key in ("top1_agreement", "kl", "nll_ratio", "retrieval_accuracy", "per_file", "top1_agreement_se"):
        assert key in report["results"][0]
    assert set(report["memory"][0]) >= {"prompt_tokens", "full_peak_kv_bytes", "budget_peak_kv_bytes"}
    assert json.loads((tmp_path / "kv_results.json").read_text())["results"] == report["results"]
    for bad in (["--policies", "nope"], ["--budgets", "0"], ["--budget-fraction", "2"], ["--files", "0"],
                ["--retrieval-format", "nope"]):
        with pytest.raises(ValueError):
            kv_eval.run(parser.parse_args(bad))


def test_caote_over_a_signed_score_keeps_its_ranking():
    """KeyDiff's base (-cos to the mean key) is negative for almost every key of a real model (keys share a bias):
    clamping it at 0 would give every token alpha 0 and CAOTE would evict at random. A score that is not an
    attention mass is shifted to start at 0, so the most distinct key keeps the largest alpha and is kept."""
    from speculant.kv.caote import CAOTE
    from speculant.kv.policies import H2O, KeyDiff, ScoreContext

    g = torch.Generator().manual_seed(0)
    t, d = 64, 16
    bias = torch.ones(d) * 3.0
    keys = (bias + 0.3 * torch.randn(1, 1, t, d, generator=g))  # [1, 1, T, D]: every cosine to the mean > 0
    keys[0, 0, 17] = torch.randn(d, generator=g) - bias  # one distinct key
    values = torch.randn(1, 1, t, d, generator=g)
    ctx = ScoreContext(torch.arange(t).view(1, 1, t), layer=0, budget=16)
    base = KeyDiff().score(keys, values, ctx)
    assert (base[0, 0] < 0).sum() >= t - 1  # the regime of a real model's keys
    caote = CAOTE(KeyDiff()).score(keys, values, ctx)
    assert int(caote[0, 0].argmax()) == 17 and float(caote[0, 0].max()) > 0
    assert int((caote[0, 0] > 0).sum()) >= t - 1  # every token but the least distinct keeps a ranking
    assert not KeyDiff().mass_base and H2O().mass_base and CAOTE(H2O()).mass_base
