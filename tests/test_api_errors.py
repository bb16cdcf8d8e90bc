"""Bad input gets a one-line ValueError naming the problem; padded vocabularies still work."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.testing import tiny_model

VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, vocab_size=VOCAB, context=64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=list(range(2, 60)), max_new_tokens=10), "exceeds the target model's context of 64"),
        (dict(input_ids=[], max_new_tokens=4), "prompt is empty"),
        (dict(input_ids=torch.zeros((2, 5), dtype=torch.long), max_new_tokens=4), "batch size 2 is not supported"),
        (dict(input_ids=[3, 4], max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(input_ids=[3, 4], max_new_tokens=4, temperature=-0.5), "temperature must be >= 0"),
        (dict(input_ids=[3, 4], max_new_tokens=4, temperature=1.0, top_p=0.0), "top_p must be in (0, 1]"),
        (dict(input_ids=[3, 4], max_new_tokens=4, temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
        (dict(input_ids=[3, 4], max_new_tokens=4, temperature=1.0, top_k=0), "top_k must be a positive integer"),
        (dict(input_ids=torch.tensor([[0.5, 1.0]]), max_new_tokens=4), "integer token ids"),
        (dict(input_ids=[3, 4], max_new_tokens=4, eos_token_id="x"), "eos_token_id must be"),
        (dict(input_ids=[3, VOCAB + 4, 5], max_new_tokens=4), f"token id {VOCAB + 4} is outside the target model's "
                                                              f"vocabulary of {VOCAB} tokens"),
        (dict(input_ids=torch.tensor([3, -1]), max_new_tokens=4), "token id -1 is outside"),
        (dict(input_ids=[3, 4], max_new_tokens=4, eos_token_id=[1, 500]), "eos_token_id: token id 500 is outside"),
        (dict(input_ids=[3, 4], max_new_tokens=4, temperature=1.0, seed=2**70), "seed 1180591620717411303424 is out "
                                                                              "of range"),
        (dict(input_ids=[3, 4], max_new_tokens=4, drafter=5), "drafter must be a Drafter, a draft model"),
        (dict(input_ids=[3, 4], max_new_tokens=4, drafter="tree:budget=16"), "method 'tree' needs a draft model"),
        (dict(input_ids=[3, 4], max_new_tokens=4, drafter="some/draft-dir"), "is not a method spec"),
        (dict(input_ids=[3, 4], max_new_tokens=4, drafter="lookup:k=0"), "k must be an integer >= 1"),
    ],
)
def test_bad_generate_arguments(target, kwargs, message):
    with pytest.raises(ValueError) as err:
        speculant.generate(target, **kwargs)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_k():
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        speculant.DraftModelDrafter(tiny_model("llama"), k=0)


def test_seed_range_is_torchs():
    """The largest and smallest seeds torch takes still work; one past them is a one-line error, not torch's."""
    for seed in (2**64 - 1, -(2**63)):
        speculant.SamplingParams(temperature=1.0, seed=seed)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="out of range: torch takes seeds from -2\\*\\*63 to 2\\*\\*64 - 1"):
            speculant.SamplingParams(temperature=1.0, seed=seed)


@pytest.mark.parametrize("bad", ["some/path", None, 3])
def test_draft_model_drafter_wants_a_loaded_model(bad):
    with pytest.raises(ValueError) as err:
        speculant.DraftModelDrafter(bad)
    message = str(err.value)
    assert "expects a loaded draft model (torch.nn.Module)" in message and type(bad).__name__ in message
    assert "speculant.load_pretrained" in message and "speculant.load_draft" in message and "\n" not in message


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


def test_every_method_has_an_exported_python_entry_point(target):
    """build_drafter and the class each registry method builds are public names of speculant."""
    from speculant.drafters.registry import methods

    assert {"build_drafter", "PromptLookupDrafter", "MaskProbeDrafter", "load_draft"} <= set(speculant.__all__)
    for name, method in methods().items():
        drafter = speculant.build_drafter(name, target if method.needs_draft else None)
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


# ---------------------------------------------------------------------------------------------- no-op warnings


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Forget the warnings already given in this process (each is given once) and capture new ones."""
    import speculant.core.checks

    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    caplog.set_level("WARNING", logger="speculant")
    return caplog


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_top_k_top_p_with_greedy_warn_once(target, fresh_warnings):
    for _ in range(2):
        speculant.generate(target, [3, 4], max_new_tokens=2, top_k=5, top_p=0.9)
    assert _warnings(fresh_warnings) == ["top_k / top_p have no effect with greedy decoding (temperature 0)"]
    speculant.generate(target, [3, 4], max_new_tokens=2, temperature=1.0, top_k=5, seed=0)
    speculant.generate(target, [3, 4], max_new_tokens=2, top_p=1.0)  # 1.0 is "no filter"
    assert len(_warnings(fresh_warnings)) == 1


def test_trim_not_below_vocab_warns(target, fresh_warnings):
    draft = tiny_model("llama", seed=1, vocab_size=VOCAB, context=64)
    for trim in (VOCAB, 10 * VOCAB):
        speculant.generate(target, [3, 4], drafter=speculant.build_drafter(f"chain:trim={trim}", draft),
                           max_new_tokens=4)
    assert len(_warnings(fresh_warnings)) == 2
    assert all("has no effect, the full LM head is used" in w and f"({VOCAB} tokens)" in w
               for w in _warnings(fresh_warnings))


def test_nested_caote_warns(target, fresh_warnings):
    speculant.generate(target, list(range(2, 20)), max_new_tokens=2, kv_policy="caote:keydiff", kv_budget=8)
    assert _warnings(fresh_warnings) == []
    speculant.generate(target, list(range(2, 20)), max_new_tokens=2, kv_policy="fastcaote:caote:keydiff",
                       kv_budget=8)
    (warning,) = _warnings(fresh_warnings)
    assert "'fastcaote:caote:keydiff' nests CAOTE 2 times" in warning


def test_vocab_mismatch(target):
    other = tiny_model("llama", seed=1, vocab_size=50)
    with pytest.raises(ValueError, match="does not match the target's"):
        speculant.generate(target, [3, 4], drafter=speculant.DraftModelDrafter(other), max_new_tokens=4)


def test_draft_context_too_short(target):
    short = tiny_model("llama", seed=1, vocab_size=VOCAB, context=16)
    with pytest.raises(ValueError, match="draft model's context of 16"):
        speculant.generate(target, list(range(2, 14)), drafter=speculant.DraftModelDrafter(short), max_new_tokens=8)


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
