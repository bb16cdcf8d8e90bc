"""The models a benchmark runs: the target (and its tokenizer) and the draft, by name or in process.

Names are anything :func:`speculant.models.loading.resolve_model` takes (model directories, bundled and packaged names,
``.gguf`` files, cached Hub ids). A draft is loaded with :func:`speculant.models.loading.load_draft`, so an attached
drafter (:mod:`speculant.models.attached`: no tokenizer, the target's embedding and LM head) works like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..models.attached import is_attached
from ..models.loading import check_model_dir, draft_context, load_draft, load_model_dir, resolve_model

__all__ = ["load_bench_draft", "load_bench_target"]


def _in_process(model: torch.nn.Module) -> str:
    return f"<in-process {type(model).__name__}>"


def load_bench_target(model: str | Path | torch.nn.Module, dtype: torch.dtype | str | None = None,
                      device: torch.device | None = None) -> tuple[torch.nn.Module, Any, str]:
    """``(model, tokenizer or None, description)`` from a loaded module (left on its device) or any name
    :func:`resolve_model` takes (loaded, then moved to ``device`` when one is given)."""
    if isinstance(model, torch.nn.Module):
        return model.eval(), None, _in_process(model)
    path = check_model_dir(resolve_model(model))
    m, tok = load_model_dir(path, dtype)
    return (m if device is None else m.to(device)), tok, str(path)


def load_bench_draft(draft: str | Path | torch.nn.Module, target: torch.nn.Module, target_tok: Any = None,
                     dtype: torch.dtype | str | None = None,
                     device: torch.device | None = None) -> tuple[torch.nn.Module, dict, str]:
    """``(draft model, drafter context, description)``: a loaded module (left on its device), or a name /
    directory loaded with :func:`speculant.models.loading.load_draft` (an attached drafter shares the target's embedding
    and tokenizer), then moved to ``device`` when one is given. The context says whether the tokenizers match
    when both are known."""
    if isinstance(draft, torch.nn.Module):
        return draft.eval(), {}, _in_process(draft)
    path = check_model_dir(resolve_model(draft))
    model = load_draft(path, target, dtype)
    if device is not None:
        model = model.to(device)
    if target_tok is None and not is_attached(path):
        return model, {}, str(path)
    return model, draft_context(path, target_tok), str(path)
