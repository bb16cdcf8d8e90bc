"""Bad input gets a one-line ValueError naming the problem; padded vocabularies still work."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant.testing import tiny_model

VOCAB = 96


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
