"""The forms a prompt comes in (a list, a tensor, a numpy array, a tokenizer's output) and the arguments' types:
``speculant.generate`` and ``Session.generate`` take the same inputs through one conversion
(:func:`speculant.core.checks.as_id_list`) and answer a wrong type with a one-line ValueError naming the argument,
never an error from inside the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

import speculant
from speculant.core.checks import as_id_list
from speculant.tiny_models import tiny_model

VOCAB = 96
PROMPT = [3, 4, 5, 6]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, vocab_size=VOCAB, context=64)


@pytest.fixture(scope="module")
def session(target):
    return speculant.load(target, method="ar")


@pytest.fixture(scope="module")
def reference(target):
    return speculant.generate(target, PROMPT, max_new_tokens=4).token_ids


FORMS = {
    "list": PROMPT,
    "tuple": tuple(PROMPT),
    "nested list": [PROMPT],
    "tensor 1-D": torch.tensor(PROMPT),
    "tensor [1, T]": torch.tensor([PROMPT]),
    "int32 tensor": torch.tensor(PROMPT, dtype=torch.int32),
    "numpy 1-D": np.array(PROMPT),
    "numpy [1, T]": np.array([PROMPT]),
    "numpy uint16": np.array(PROMPT, dtype=np.uint16),
    "numpy ints in a list": [np.int64(t) for t in PROMPT],
    "BatchEncoding (lists)": BatchEncoding({"input_ids": [PROMPT], "attention_mask": [[1] * len(PROMPT)]}),
    "BatchEncoding (unbatched)": BatchEncoding({"input_ids": PROMPT}),
    "BatchEncoding (pt)": BatchEncoding({"input_ids": torch.tensor([PROMPT])}),
    "BatchEncoding (np)": BatchEncoding({"input_ids": np.array([PROMPT])}),
    "dict": {"input_ids": torch.tensor([PROMPT]), "attention_mask": torch.ones(1, len(PROMPT))},
}


@pytest.mark.parametrize("form", list(FORMS))
def test_as_id_list_takes_every_form(form):
    ids = as_id_list(FORMS[form])
    assert ids == PROMPT and all(type(t) is int for t in ids)


@pytest.mark.parametrize("form", ["numpy [1, T]", "BatchEncoding (lists)", "dict", "numpy ints in a list"])
def test_both_entry_points_take_them(target, session, reference, form):
    assert speculant.generate(target, FORMS[form], max_new_tokens=4).token_ids == reference
    assert session.generate(FORMS[form], max_new_tokens=4).token_ids == reference


BAD_PROMPTS = [
    (torch.zeros((2, 5), dtype=torch.long), "batch size 2 is not supported"),
    (np.zeros((3, 5), dtype=np.int64), "batch size 3 is not supported"),
    (BatchEncoding({"input_ids": [[1, 2], [3, 4]]}), "batch size 2 is not supported"),
    ([[1, 2], [3, 4]], "batch size 2 is not supported"),
    (np.array([1.0, 2.0]), "integer token ids"),
    (torch.tensor([True, False]), "integer token ids"),
    ([1, 2.0], "integer token ids"),
    ([True, 2], "integer token ids"),
    ({"attention_mask": [1, 1]}, "without an 'input_ids' entry"),
    ("hello", "input_ids must be"),
    (5, "input_ids must be"),
    (np.array([], dtype=np.int64), "prompt is empty"),
    (BatchEncoding({"input_ids": []}), "prompt is empty"),
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS)
def test_bad_prompts(target, prompt, message):
    with pytest.raises(ValueError) as err:
        speculant.generate(target, prompt, max_new_tokens=4)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "input_ids" in str(err.value) or "prompt" in str(err.value)


@pytest.mark.parametrize("prompt, message", [p for p in BAD_PROMPTS if not isinstance(p[0], str)])
def test_bad_prompts_session(session, prompt, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        session.generate(prompt, max_new_tokens=4)


BAD_ARGS = [
    (dict(stream=5), "stream must be a callable"),
    (dict(stream="print"), "stream must be a callable"),
    (dict(max_new_tokens=4.0), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(max_new_tokens="4"), "max_new_tokens must be an integer"),
    (dict(eos_token_id="2"), "eos_token_id must be"),
    (dict(eos_token_id=2.0), "eos_token_id must be"),
    (dict(eos_token_id=[2, "3"]), "eos_token_id must be"),
    (dict(temperature="1"), "temperature must be"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be"),
    (dict(temperature=1.0, seed="1"), "seed must be"),
    (dict(logprobs=-1), "logprobs must be"),
    (dict(logprobs=True), "logprobs must be"),
    (dict(logprobs=2.0), "logprobs must be"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ARGS)
def test_bad_argument_types(target, session, kwargs, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    for call in (lambda: speculant.generate(target, PROMPT, **kwargs), lambda: session.generate(PROMPT, **kwargs)):
        with pytest.raises(ValueError) as err:
            call()
        assert message in str(err.value) and "\n" not in str(err.value)


def test_kv_block_type_is_checked_without_eviction(target):
    with pytest.raises(ValueError, match="kv_block must be an integer"):
        speculant.generate(target, PROMPT, max_new_tokens=4, kv_block="2")


def test_numpy_eos_ids(target, reference):
    """Stop ids may come as numpy integers too (e.g. read from an array); the stop token ends the output."""
    stop = reference[1]
    out = speculant.generate(target, PROMPT, max_new_tokens=4, eos_token_id=np.array([stop])).token_ids
    assert out == reference[: reference.index(stop) + 1]


def test_stream_still_gets_ids_only(target, reference):
    seen = []
    speculant.generate(target, PROMPT, max_new_tokens=4, stream=seen.append)
    assert [t for step in seen for t in step] == reference
