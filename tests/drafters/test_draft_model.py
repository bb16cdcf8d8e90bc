"""The draft-model drafter (``DraftModelDrafter``) checks what it is given: ``k`` and a loaded draft model, each
mistake a one-line ValueError."""

from __future__ import annotations

import pytest

import speculant
from speculant.tiny_models import tiny_model


def test_bad_k():
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        speculant.DraftModelDrafter(tiny_model("llama"), k=0)


@pytest.mark.parametrize("bad", ["some/path", None, 3])
def test_draft_model_drafter_wants_a_loaded_model(bad):
    with pytest.raises(ValueError) as err:
        speculant.DraftModelDrafter(bad)
    message = str(err.value)
    assert "expects a loaded draft model (torch.nn.Module)" in message and type(bad).__name__ in message
    assert "speculant.load_pretrained" in message and "speculant.load_draft" in message and "\n" not in message
