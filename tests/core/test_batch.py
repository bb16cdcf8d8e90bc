"""Batched decoding (speculant.core.batch, engine.generate_batch / generate_steps): several sequences, one
verification forward per step, each sequence with its own drafter, cache and settings, equals each prompt decoded
alone, token for token; sequences join and leave between steps; the step iterator can stop early."""

from __future__ import annotations

import pytest
import torch

from speculant.core.batch import Batch
from speculant.core.cache import SpecCache
from speculant.core.engine import generate, generate_batch, generate_steps
from speculant.core.llama_forward import LlamaForward, Segment
from speculant.core.quant import quantize_model
from speculant.core.types import SamplingParams
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import perturbed, tiny_model

VOCAB = 96
SPECS = (None, "chain:k=3", "specinfer:width=2:depth=3", "lookup", "chain:k=2")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = (1, 7, 19, 4, 12, 30)
    out = []
    for i in range(n):
        p = torch.randint(2, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
        out.append(p + p[: len(p) // 2])  # some repetition: lookup finds drafts
    return out


def _pair(arch: str, kind: str, dtype=torch.float32):
    target = tiny_model(arch, seed=0, vocab_size=VOCAB, dtype=dtype)
    draft = perturbed(tiny_model(arch, seed=0, vocab_size=VOCAB, dtype=dtype), 0.05, seed=2)
    if kind != "none":
        quantize_model(target, kind)
        quantize_model(draft, kind)
    return target, draft


def _drafter(spec, draft):
    return None if spec is None else build_drafter(spec, None if spec == "lookup" else draft)


@pytest.mark.parametrize("arch, kind, dtype", [("llama", "q4", torch.float32), ("qwen2", "q4", torch.bfloat16),
                                               ("qwen2", "none", torch.float32), ("mistral", "int8", torch.float32)])
def test_a_batch_decodes_each_prompt_as_it_decodes_alone(arch, kind, dtype):
    """Five prompts of different lengths, each with its own method (plain, chain, tree, lookup), budgets that end
    at different steps and a stop token: the batch's greedy output is each prompt's own, token for token."""
    target, draft = _pair(arch, kind, dtype)
    prompts = _prompts(len(SPECS))
    budgets = [9, 24, 17, 31, 5]
    alone = [generate(target, p, drafter=_drafter(s, draft), max_new_tokens=n, eos_token_id=[7])
             for p, s, n in zip(prompts, SPECS, budgets)]
    batch = Batch(target)
    indices = [batch.add(p, _drafter(s, draft), n, eos_token_id=[7]) for p, s, n in zip(prompts, SPECS, budgets)]
    sizes = []
    while len(batch):
        sizes.append(len(batch))
        events = batch.step()
        assert [e.sequence for e in events] == [i for i in indices if i in [e.sequence for e in events]]
    for i, want in zip(indices, alone):
        got = batch.result(i)
        assert got.token_ids == want.token_ids, (i, SPECS[i])
        assert got.finish_reason == want.finish_reason in ("stop", "length")
        assert got.stats.target_calls == want.stats.target_calls
    assert sizes[0] == len(SPECS) and sizes[-1] < len(SPECS)  # sequences left as they finished
    assert sum(g.stats.accepted_hist[1:] != [] and sum(g.stats.accepted_hist[1:]) > 0 for g in alone) >= 2


def test_sampling_in_a_batch_draws_what_each_sequence_draws_alone():
    """Each sequence keeps its own generator (its seed): with row-independent q4 weights its sampled tokens are the
    same in a batch as alone, so the batch samples each sequence's distribution exactly."""
    target, draft = _pair("llama", "q4")
    prompts = _prompts(3, seed=1)
    specs = ("chain:k=3", None, "specinfer:width=2:depth=2")
    kwargs = dict(max_new_tokens=20, temperature=0.9, top_p=0.95, eos_token_id=[])
    alone = [generate(target, p, drafter=_drafter(s, draft), seed=10 + i, **kwargs).token_ids
             for i, (p, s) in enumerate(zip(prompts, specs))]
    got = generate_batch(target, prompts, [_drafter(s, draft) for s in specs], seed=[10, 11, 12], **kwargs)
    assert [g.token_ids for g in got] == alone
    assert len({tuple(a) for a in alone}) == 3


def test_sequences_join_and_leave_between_steps():
    target, draft = _pair("qwen2", "q4")
    p1, p2, p3 = _prompts(3, seed=2)
    want = [generate(target, p, drafter=_drafter("chain:k=3", draft), max_new_tokens=16, eos_token_id=[]).token_ids
            for p in (p1, p2, p3)]
    batch = Batch(target)
    a = batch.add(p1, _drafter("chain:k=3", draft), 16)
    batch.step()
    batch.step()
    b = batch.add(p2, _drafter("chain:k=3", draft), 16)  # joins a running batch
    batch.step()
    c = batch.add(p3, _drafter("chain:k=3", draft), 16)
    cancelled = batch.cancel(b)  # leaves before it finished
    assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == want[1][: len(cancelled.token_ids)]
    assert batch.active == [a, c]
    while len(batch):
        batch.step()
    assert batch.result(a).token_ids == want[0] and batch.result(c).token_ids == want[2]


def test_the_step_iterator_yields_what_generate_returns_and_can_stop():
    target, draft = _pair("llama", "q4")
    prompt = _prompts(1, seed=3)[0]
    whole = generate(target, prompt, drafter=_drafter("chain:k=3", draft), max_new_tokens=24, eos_token_id=[])
    steps = generate_steps(target, prompt, drafter=_drafter("chain:k=3", draft), max_new_tokens=24,
                           eos_token_id=[], logprobs=2)
    with pytest.raises(ValueError, match="not finished"):
        steps.result
    events = list(steps)
    assert [t for e in events for t in e.tokens] == whole.token_ids
    assert events[-1].done and events[-1].finish_reason == "length" and not any(e.done for e in events[:-1])
    assert sum(e.accepted for e in events) == sum(i * c for i, c in enumerate(whole.stats.accepted_hist))
    assert all(len(e.logprobs) == len(e.tokens) for e in events)
    assert steps.result.token_ids == whole.token_ids and steps.result.finish_reason == "length"
    early = generate_steps(target, prompt, drafter=_drafter("chain:k=3", draft), max_new_tokens=24, eos_token_id=[])
    first = next(early)
    result = early.close()
    assert result.finish_reason == "cancelled" and result.token_ids == first.tokens
    assert list(early) == [] and early.result is result


def test_bad_batches_are_one_line_value_errors():
    target, draft = _pair("llama", "q4")
    shared = _drafter("chain:k=2", draft)
    with pytest.raises(ValueError, match="its own drafter"):
        generate_batch(target, [[3, 4], [5, 6]], [shared, shared])
    with pytest.raises(ValueError, match="one drafter \\(or None\\) per prompt"):
        generate_batch(target, [[3, 4], [5, 6]], [None])
    with pytest.raises(ValueError, match="non-empty list"):
        generate_batch(target, [])
    with pytest.raises(ValueError, match="one per prompt"):
        generate_batch(target, [[3, 4], [5, 6]], seed=[1, 2, 3])
    with pytest.raises(ValueError, match="input_ids"):
        generate_batch(target, [[3, 4], [VOCAB + 5]])
    with pytest.raises(ValueError, match="no sequence 9"):
        Batch(target).result(9)


@pytest.mark.parametrize("kind", ["q4", "none"])
def test_the_batched_lean_forward_gives_each_sequence_its_own_bits(kind):
    """hidden_batch over three sequences (a prompt, a chain, a tree with out-of-order positions) equals three
    separate forwards: bit for bit with q4 weights (through the compiled layer loop and through the per-layer
    path), to float rounding with float weights."""
    model = tiny_model("qwen2", hidden=64, heads=4, kv_heads=2, vocab_size=128)
    if kind != "none":
        quantize_model(model, kind)
    lean = LlamaForward(model)
    ids = torch.randint(2, 128, (3, 30), generator=torch.Generator().manual_seed(4))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)

    def caches():
        out = []
        for i, n in enumerate((0, 11, 20)):
            cache = SpecCache(2, capacity=8)
            if n:
                lean(ids[i : i + 1, :n], cache)
            out.append(cache)
        return out

    def segments(cs):
        mask = torch.cat([torch.ones(4, 20, dtype=torch.bool), tree], 1)[None, None]
        return [Segment(cs[0], ids[0:1, :9]), Segment(cs[1], ids[1:2, 11:14]),
                Segment(cs[2], ids[2:3, 20:24], positions=torch.tensor([[20, 21, 22, 22]]), mask=mask)]

    alone_caches = caches()
    alone = [lean.hidden_batch([s])[0] for s in segments(alone_caches)]
    batched_caches = caches()
    together = lean.hidden_batch(segments(batched_caches))
    for a, b in zip(alone, together):
        if kind == "none":
            torch.testing.assert_close(a, b)
        else:
            assert torch.equal(a, b)
    for ca, cb in zip(alone_caches, batched_caches):
        assert ca.length == cb.length
        for la, lb in zip(ca.layers, cb.layers):
            if kind == "none":
                torch.testing.assert_close(la.keys, lb.keys)
            else:
                assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    if kind != "none":  # the per-layer path (no compiled layer loop) gives the same bits
        lean._table_for, lean._table = torch.float32, None
        lean._q4_table = lambda dtype: None
        per_layer = lean.hidden_batch(segments(caches()))
        assert all(torch.equal(a, b) for a, b in zip(per_layer, together))


def test_the_batch_counts_its_rows():
    target, draft = _pair("llama", "q4")
    batch = Batch(target)
    batch.add([3, 4, 5], _drafter("chain:k=3", draft), 8)
    batch.add([6, 7], None, 8)
    batch.step()
    assert batch.rows == (1 + 3) + 1 and batch.steps == 1
    assert isinstance(SamplingParams(), SamplingParams)


def test_the_public_entry_points_resolve_drafters_per_prompt(code_models):
    import speculant

    target, draft = _pair("llama", "q4")
    prompts = _prompts(3, seed=6)
    want = [speculant.generate(target, p, drafter=draft, max_new_tokens=12, eos_token_id=[]).token_ids
            for p in prompts]
    got = speculant.generate_batch(target, prompts, drafter=draft, max_new_tokens=12, eos_token_id=[])
    assert [g.token_ids for g in got] == want  # a chain drafter built per prompt over the draft model
    mixed = speculant.generate_batch(target, prompts, drafter=["lookup", None, draft], max_new_tokens=12,
                                     eos_token_id=[])
    assert [g.token_ids for g in mixed] == want and mixed[1].stats.draft_tokens == 0
    with pytest.raises(ValueError, match="serves one prompt"):
        speculant.generate_batch(target, prompts, drafter=build_drafter("chain:k=2", draft))
    with pytest.raises(ValueError, match="one per prompt"):
        speculant.generate_batch(target, prompts, drafter=["lookup"])
    steps = speculant.generate_steps(target, prompts[0], drafter="lookup", max_new_tokens=12, eos_token_id=[])
    assert [t for e in steps for t in e.tokens] == want[0]
    # a session batches text prompts through the chat template, each stopping at its end of turn
    session = speculant.load(code_models["target"], code_models["draft"], method="chain:k=3", quantization="q4")
    texts = ["def add(a, b):", "print('hi')"]
    alone = [session.generate(t, max_new_tokens=10, raw=True).token_ids for t in texts]
    together = session.generate_batch(texts, max_new_tokens=10, raw=True)
    assert [g.token_ids for g in together] == alone


def test_every_method_and_feature_drafters_batch_as_they_run_alone():
    """The other methods in one batch, each sequence as alone: RSD and SpecTr trees, the dynamic tree, mask probing
    (probe slots as input embeddings in the batched forward), hybrid lookup, and feature (EAGLE-style) drafters that
    read the target's states, one of them a lower layer's (taps: the batched forward hands each sequence its rows)."""
    from speculant.drafters.feature import FeatureDrafter
    from speculant.models.attached import build_attached

    target = tiny_model("llama", seed=2, vocab_size=VOCAB)
    draft = perturbed(tiny_model("llama", seed=2, vocab_size=VOCAB), 0.05, seed=3)
    feature = build_attached(target, [1], features=True)
    tapped = build_attached(target, [0], features=True, taps=[0])
    for d in (feature, tapped):
        with torch.no_grad():
            for p in d.parameters():
                if p.requires_grad:
                    p.add_(0.2 * torch.randn_like(p))
    makers = [lambda: build_drafter("rsd-c", draft), lambda: build_drafter("spectr", draft),
              lambda: build_drafter("tree", draft), lambda: build_drafter("mask-probe"),
              lambda: build_drafter("hybrid"), lambda: FeatureDrafter(feature, k=3),
              lambda: FeatureDrafter(tapped, k=2), lambda: None]
    prompts = _prompts(len(makers), seed=9)
    alone = [generate(target, p, drafter=m(), max_new_tokens=18, eos_token_id=[]).token_ids
             for p, m in zip(prompts, makers)]
    got = generate_batch(target, prompts, [m() for m in makers], max_new_tokens=18, eos_token_id=[])
    assert [g.token_ids for g in got] == alone
    assert sum(g.stats.draft_tokens for g in got) > 0


def test_the_sequences_draft_forwards_run_together():
    """Four chain drafters over one q4 draft model in a batch: each draft level of all the sequences runs as one
    forward of the draft model (the batch counts fewer draft forwards than the sequences asked for), every output is
    each prompt's own and each sequence drafted what it drafts alone (q4 rows are row independent); the same batch
    with shared drafting off runs every draft forward alone."""
    target, draft = _pair("llama", "q4")
    prompts = _prompts(4, seed=5)
    alone = [generate(target, p, drafter=_drafter("chain:k=3", draft), max_new_tokens=20, eos_token_id=[])
             for p in prompts]
    for shared in (True, False):
        batch = Batch(target)
        batch.batch_drafts = shared
        indices = [batch.add(p, _drafter("chain:k=3", draft), 20, eos_token_id=[]) for p in prompts]
        while len(batch):
            batch.step()
        got = [batch.result(i) for i in indices]
        assert [g.token_ids for g in got] == [a.token_ids for a in alone]
        assert [g.stats.accepted_hist for g in got] == [a.stats.accepted_hist for a in alone]
        assert [g.stats.draft_calls for g in got] == [a.stats.draft_calls for a in alone]
        if shared:
            assert batch.draft_segments <= sum(g.stats.draft_calls for g in got)  # a lone drafter drafts alone
            assert batch.draft_segments >= 3 * batch.draft_forwards  # about four sequences per forward
        else:
            assert batch.draft_forwards == batch.draft_segments == 0


def test_shared_draft_forwards_wait_for_every_planner_and_pass_errors_on():
    """ForwardBatcher: forwards requested by several planning coroutines run together once every one waits or is
    done (a plan that needs no forward or fails first holds nobody up), each caller gets its own rows (the bits of a
    forward alone), and an error raised by a plan or by a shared forward reaches the caller after every plan
    ended."""
    from speculant.core.draft_batch import active, plan_together

    model = quantize_model(tiny_model("qwen2", hidden=64, heads=4, kv_heads=2, vocab_size=128), "q4")
    lean = LlamaForward(model, active_batcher=active)  # as llama_forward_for builds it
    ids = torch.randint(2, 128, (3, 12), generator=torch.Generator().manual_seed(7))
    want = [lean.hidden(ids[i : i + 1, : 4 + i], SpecCache(2, capacity=16)) for i in range(3)]

    def planner(i: int, levels: int):
        def plan():
            cache, out = SpecCache(2, capacity=32), []
            out.append(lean.hidden(ids[i : i + 1, : 4 + i], cache))
            for j in range(1, levels):
                out.append(lean.hidden(ids[i : i + 1, 4 + i + j - 1 : 4 + i + j], cache))
            return out
        return plan

    results, batcher = plan_together([planner(0, 3), planner(1, 1), lambda: "no forward", planner(2, 2)])
    assert results[2] == "no forward"
    for i, r in zip((0, 1, 3), (results[0], results[1], results[3])):
        assert torch.equal(r[0], want[(0, 1, None, 2)[i]])
    assert batcher.segments == 3 + 1 + 2 and batcher.forwards == 3  # first level together, then the deeper ones
    alone = LlamaForward(model)  # built without a batcher: it runs at once, inside plan_together too
    results, batcher = plan_together([lambda: alone.hidden(ids[:1, :4], SpecCache(2, capacity=8))])
    assert torch.equal(results[0], want[0]) and batcher.forwards == batcher.segments == 0

    def failing():
        raise RuntimeError("this drafter broke")

    with pytest.raises(RuntimeError, match="this drafter broke"):
        plan_together([planner(0, 2), failing, planner(1, 2)])
    bad = Segment(SpecCache(2, capacity=8), torch.tensor([[500]]))  # an id outside the vocabulary: the forward fails

    def bad_plan():
        return lean.hidden(bad.input_ids, bad.cache)

    with pytest.raises(IndexError):
        plan_together([planner(0, 2), bad_plan])
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()  # the caller's modes, restored

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # not an error of a plan: it ends them all at once, suspended ones too
        plan_together([planner(0, 3), interrupted, planner(1, 2)])
    import gc

    gc.collect()
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert lean.hidden(ids[:1, :4], SpecCache(2, capacity=8)).shape == (1, 4, 64)  # no batcher left behind
