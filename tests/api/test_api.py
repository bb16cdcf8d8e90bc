"""The Python API's behaviour on good input: ``drafter=`` takes a model, a spec or a drafter; the stats count what
was emitted; padded vocabularies, training-mode models and seeds."""

from __future__ import annotations

import pytest
import torch

import speculant
from helpers import API_VOCAB as VOCAB
from helpers import api_target  # noqa: F401 (the target fixture)
from speculant.tiny_models import tiny_model


def test_the_wrapper_has_the_engine_defaults():
    """speculant.generate restates the engine's signature to document it; its defaults are the engine's own (the
    one definition, read by the session and the command-line help)."""
    import inspect

    from speculant.core import engine

    def defaults(fn):
        return {name: p.default for name, p in inspect.signature(fn).parameters.items()}

    ours, engines = defaults(speculant.generate), defaults(engine.generate)
    # the wrapper compiles response_format (with the tokenizer) into the engine's constraint
    assert ours.pop("response_format") is None and ours.pop("tokenizer") is None
    assert engines.pop("constraint") is None
    assert ours == engines


# ---------------------------------------------------------------------------------------------- drafter=


def test_draft_model_as_drafter_is_the_default_chain(target):
    """drafter=<a model> (what transformers' assistant_model= takes) drafts a chain with it."""
    draft = tiny_model("llama", seed=0, vocab_size=VOCAB, context=64)  # = target: everything is accepted
    kwargs = dict(max_new_tokens=12, eos_token_id=[])
    by_model = speculant.generate(target, [3, 4, 5], drafter=draft, **kwargs)
    by_drafter = speculant.generate(target, [3, 4, 5], drafter=speculant.DraftModelDrafter(draft), **kwargs)
    assert by_model.token_ids == by_drafter.token_ids == speculant.generate(target, [3, 4, 5], **kwargs).token_ids
    assert by_model.stats.draft_calls > 0 and by_model.stats.acceptance_length > 1
    assert by_model.stats.accepted_hist == by_drafter.stats.accepted_hist


@pytest.mark.parametrize("spec", ["lookup", "lookup:ngram=2:k=3", "mask-probe:masks=2", "ar"])
def test_spec_string_as_drafter(target, spec):
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]  # repeats: lookup finds drafts
    kwargs = dict(max_new_tokens=10, eos_token_id=[])
    gen = speculant.generate(target, prompt, drafter=spec, **kwargs)
    assert gen.token_ids == speculant.generate(target, prompt, **kwargs).token_ids  # lossless
    assert (gen.stats.draft_tokens > 0) == (spec != "ar")


class _CharTok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 7 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


def test_every_method_has_an_exported_python_entry_point(target):
    """build_drafter and the class each registry method builds are public names of speculant."""
    from speculant.drafters.registry import methods

    assert {"build_drafter", "PromptLookupDrafter", "MaskProbeDrafter", "load_draft"} <= set(speculant.__all__)
    from speculant.models.attached import build_attached

    feature = build_attached(target, [0], features=True)
    from speculant.models.confu_contemplation import add_contemplation

    confu = build_attached(target, [0], features=True)
    add_contemplation(confu, target.config, soft=2)
    special = {"eagle3": (feature, {}), "confu": (confu, {}),  # feature drafters; two tokenizers (any with encode/decode)
               "cross-vocab": (target, {"draft_tokenizer": _CharTok(), "target_tokenizer": _CharTok()})}
    for name, method in methods().items():
        draft, context = special.get(name, (target if method.needs_draft else None, {}))
        drafter = speculant.build_drafter(name, draft, **context)
        if drafter is None:
            assert name == "ar"
            continue
        cls = type(drafter).__name__
        assert cls in speculant.__all__ and getattr(speculant, cls) is type(drafter), name


# ---------------------------------------------------------------------------------------------- stats


def _hist_tokens(stats) -> int:
    return sum((m + 1) * n for m, n in enumerate(stats.accepted_hist))


@pytest.mark.parametrize("k", [4, 6])
def test_stats_count_only_emitted_tokens_after_early_stop(target, k):
    """Draft = target: every draft token is accepted. A stop token in the middle of an accepted block ends the
    generation there; the histogram and per-position acceptance count what was emitted, so τ = mean(m + 1)."""
    draft = tiny_model("llama", seed=0, vocab_size=VOCAB, context=64)
    prompt, block = [3, 4, 5], k + 1
    free = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(draft, k=k),
                              max_new_tokens=3 * block, eos_token_id=[])
    assert free.stats.accepted_hist[k] == free.stats.target_calls == 3  # all accepted: k + 1 tokens per step
    # a stop token inside the second block (not at its bonus position, not seen before)
    stop_at = next(i for i in range(block + 1, 2 * block - 1) if free.token_ids[i] not in free.token_ids[:i])
    stop = free.token_ids[stop_at]
    gen = speculant.generate(target, prompt, drafter=speculant.DraftModelDrafter(draft, k=k),
                             max_new_tokens=3 * block, eos_token_id=stop)
    assert gen.token_ids == free.token_ids[: stop_at + 1]
    stats = gen.stats
    assert stats.new_tokens == stop_at + 1 == _hist_tokens(stats)
    assert stats.acceptance_length == pytest.approx(_hist_tokens(stats) / sum(stats.accepted_hist))
    cut = stop_at - block  # draft tokens emitted before the stop token in the second step
    assert stats.accepted_hist[k] == 1 and stats.accepted_hist[cut] == 1 and sum(stats.accepted_hist) == 2
    assert stats.position_acceptance == [1.0] * k  # nothing recorded as rejected: it was all accepted
    assert stats.depth_reached[: cut + 1] == [2] * cut + [1] and stats.depth_reached[cut:] == [1] * (k - cut)


def test_stats_identity_holds_at_max_new_tokens(target):
    draft = tiny_model("llama", seed=0, vocab_size=VOCAB, context=64)
    for n in range(1, 9):
        stats = speculant.generate(target, [3, 4, 5], drafter=speculant.RSDCDrafter(draft, branching=[2, 2, 1]),
                                   max_new_tokens=n, eos_token_id=[]).stats
        assert stats.new_tokens == n == _hist_tokens(stats)


# ---------------------------------------------------------------------------------------------- models and seeds


@pytest.mark.parametrize("target_vocab, draft_vocab", [(256, 258), (258, 256)])
def test_padded_vocabularies_still_work(target_vocab, draft_vocab):
    """Embedding matrices that differ by padding rows (as Qwen models' do) are compatible and still exact."""
    t = tiny_model("qwen2", seed=0, vocab_size=target_vocab)
    d = tiny_model("qwen2", seed=0, vocab_size=draft_vocab)
    prompt = [5, 9, 33, 100]
    ref = t.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=20,
                     do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    for temperature in (0.0, 1.0):
        gen = speculant.generate(t, prompt, drafter=speculant.DraftModelDrafter(d, k=3), max_new_tokens=20,
                                 temperature=temperature, seed=0, eos_token_id=[])
        assert len(gen.token_ids) == 20
        if temperature == 0.0:
            assert gen.token_ids == ref


def test_training_mode_model_is_switched_to_eval():
    m = tiny_model("llama", seed=0, vocab_size=VOCAB).train()
    a = speculant.generate(m, [3, 4, 5], max_new_tokens=10, eos_token_id=[]).token_ids
    assert not m.training
    assert a == speculant.generate(m, [3, 4, 5], max_new_tokens=10, eos_token_id=[]).token_ids


def test_sampling_is_seeded(target):
    draft = tiny_model("llama", seed=4, vocab_size=VOCAB, context=64)
    run = lambda seed: speculant.generate(target, [3, 4, 5], drafter=speculant.DraftModelDrafter(draft, k=3),
                                          max_new_tokens=20, temperature=1.0, seed=seed, eos_token_id=[]).token_ids
    assert run(1) == run(1)
    assert run(1) != run(2)
