"""What a forward costs in weights read, and the memory-bound speed-up (MBSU) built on it.

MBSU = τ / (c·γ + 1), where

* ``c`` = parameters a draft forward reads / parameters a target forward reads;
* ``γ`` = draft forwards per target forward, *measured* (``draft_calls / target_calls`` of the run), so it is the
  draft depth a method actually ran, shortened drafts near the end of a generation included.

"Parameters a forward reads": every parameter of the model except the input-embedding table, of which a forward
reads only the rows of its input tokens (when the embedding is tied to the LM head, the head reads all of it, so
it counts). A drafter may declare its own figure (the capability ``params_per_forward`` of
:class:`speculant.core.drafting.Drafter`, e.g. a draft with a trimmed LM head); where it declares none, the
nn.Modules held in the drafter's attributes are counted, and a drafter holding none costs 0.
"""

from __future__ import annotations

import torch

from ..core.drafting import capability
from ..core.quant import ATTR

__all__ = ["drafter_models", "drafter_params_per_forward", "mbsu", "param_bytes", "params_per_forward"]


def _unique_params(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    return {id(p): p for p in model.parameters()}


def params_per_forward(model: torch.nn.Module) -> int:
    """Parameters one forward of ``model`` reads: all of them, less an untied input-embedding table."""
    params = _unique_params(model)
    total = sum(p.numel() for p in params.values())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    if isinstance(emb_w, torch.Tensor) and (out is None or getattr(out, "weight", None) is not emb_w):
        total -= emb_w.numel()
    return total


def param_bytes(*models: torch.nn.Module | None) -> int:
    """Bytes of the distinct parameters and buffers of the given models (each tensor once; a quantized linear's
    released float weight, a ``meta`` tensor, counts as its quantized matrix's kernel bytes instead)."""
    seen: dict[int, int] = {}
    for m in models:
        if m is None:
            continue
        for t in [*m.parameters(), *m.buffers()]:
            seen[id(t)] = 0 if t.device.type == "meta" else t.numel() * t.element_size()
        for module in m.modules():
            matrix = getattr(module, ATTR, None)
            if matrix is not None:
                seen[id(matrix)] = matrix.nbytes
    return sum(seen.values())


def drafter_models(drafter, target: torch.nn.Module | None = None) -> list[torch.nn.Module]:
    """The distinct nn.Modules a drafter holds in its attributes, the target excluded ([] for None)."""
    if drafter is None:
        return []
    found = {id(v): v for v in vars(drafter).values() if isinstance(v, torch.nn.Module) and v is not target}
    return list(found.values())


def drafter_params_per_forward(drafter, target: torch.nn.Module | None = None) -> int:
    """Parameters one draft forward of ``drafter`` reads (see the module doc); 0 for None (plain decoding)."""
    if drafter is None:
        return 0
    own = capability(drafter, "params_per_forward")
    if own is not None:
        return int(own)
    return sum(params_per_forward(m) for m in drafter_models(drafter, target))


def mbsu(acceptance_length: float, cost_ratio: float, draft_calls_per_step: float) -> float:
    """τ / (c·γ + 1); 0 when nothing was generated."""
    if acceptance_length <= 0:
        return 0.0
    return acceptance_length / (cost_ratio * draft_calls_per_step + 1.0)
