"""The Python API's mistakes: bad input to ``generate`` gets a one-line ValueError naming the problem (arguments,
prompts, draft/target mismatches), and settings without effect warn once."""

from __future__ import annotations

import pytest
import torch

import speculant
from helpers import API_VOCAB as VOCAB
from helpers import api_target  # noqa: F401 (the target fixture)
from speculant.tiny_models import tiny_model


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


def test_vocab_mismatch(target):
    other = tiny_model("llama", seed=1, vocab_size=50)
    with pytest.raises(ValueError, match="does not match the target's"):
        speculant.generate(target, [3, 4], drafter=speculant.DraftModelDrafter(other), max_new_tokens=4)


def test_draft_context_too_short(target):
    short = tiny_model("llama", seed=1, vocab_size=VOCAB, context=16)
    with pytest.raises(ValueError, match="draft model's context of 16"):
        speculant.generate(target, list(range(2, 14)), drafter=speculant.DraftModelDrafter(short), max_new_tokens=8)


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
