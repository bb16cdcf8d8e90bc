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


# ----------------------------------------------------------------------------------------------- window=


WINDOW_SPECS = ("chain:k=3", "specinfer:width=2:depth=3", "tree:topk=2:depth=3", "rsd-c:branching=2/1",
                "chain:k=2:lookup=4")


def _window_pair():
    import torch

    from speculant.tiny_models import perturbed

    target = tiny_model("llama", vocab_size=96, context=512)
    draft = perturbed(target, 0.05, seed=2)
    g = torch.Generator().manual_seed(0)
    return target, draft, torch.randint(2, 96, (120,), generator=g).tolist()


@pytest.mark.parametrize("spec", WINDOW_SPECS)
@pytest.mark.parametrize("window", [8, 40])
def test_a_draft_reading_the_prompts_last_tokens_only_is_still_exact(spec, window):
    """``window=N``: the draft model reads the prompt's last N tokens (as if the text began there); greedy output
    is plain decoding's, with and without the prefix cache (the windowed context's blocks are its own)."""
    from speculant.core.engine import generate
    from speculant.core.prefix_cache import PrefixCache
    from speculant.drafters.registry import build_drafter

    target, draft, ids = _window_pair()
    plain = generate(target, ids, max_new_tokens=30)
    cache = PrefixCache(1 << 24, block=8)
    for prefixes in (None, cache, cache):
        got = generate(target, ids, drafter=build_drafter(f"{spec}:window={window}", draft), max_new_tokens=30,
                       prefix_cache=prefixes)
        assert got.token_ids == plain.token_ids
        assert got.stats.draft_tokens > 0  # it drafted
    assert got.stats.draft_cached_tokens == (window - 1) // 8 * 8  # the window but its root, in whole blocks


def test_a_bad_window_is_a_one_line_error():
    from speculant.drafters.registry import build_drafter

    _, draft, _ = _window_pair()
    with pytest.raises(ValueError, match="window"):
        build_drafter("chain:k=3:window=-1", draft)
    with pytest.raises(ValueError, match="window"):
        build_drafter("chain:k=3:window=x", draft)
