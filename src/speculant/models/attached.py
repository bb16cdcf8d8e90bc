"""Attached drafters: small draft models that share the target's token embedding and LM head.

A real target's embedding is a large part of a small drafter (SmolLM2: 49,152 x 576 = 28M parameters, against
3.5M per transformer layer). EAGLE/MTP heads and Direct Alignment drafters reuse the target's embedding and
LM head instead of carrying copies: the drafter's own file holds only its transformer layers and final norm, and
when it is loaded next to its target it takes the target's ``embed_tokens`` and ``lm_head`` modules themselves
(the same tensors: no copy in memory, and they stay frozen in training).

An attached drafter directory holds ``config.json`` (the target's architecture with fewer layers),
``model.safetensors`` (own parameters only), ``attached.json`` (what it shares, and a fingerprint of the
target's embedding so it is never attached to a different model) and usually ``vocab_trim.json`` and
``MODEL_CARD.md``. It has no tokenizer: it reads and writes the target's token ids.

A *feature* drafter (EAGLE, Li et al. 2024; :mod:`speculant.drafters.feature`) also reads the target's final hidden
states: it carries one more own module, ``feature_fc`` (a linear map ``[2H] -> [H]`` of the next token's embedding
concatenated with the target's hidden state, the input of its layers), and ``attached.json`` says
``"features": true``. A ConFu drafter (:mod:`.confu_contemplation`) also holds ``contemplation`` (its soft prompt,
contemplate embeddings and future input map), recorded as ``"contemplate"``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..core.quant import GROUP, QuantMatrix
from .confu_contemplation import add_contemplation, contemplation_of

__all__ = ["ATTACHED_FILE", "EXPORT_STORAGES", "STORAGES", "is_attached", "stored_parameters", "build_attached", "own_state", "save_attached", "load_attached",
           "embedding_fingerprint", "add_feature_input", "feature_layers", "is_feature_drafter"]

ATTACHED_FILE = "attached.json"
_SHARED = ("model.embed_tokens.", "lm_head.")


def is_attached(path: str | Path) -> bool:
    """True for a directory that holds an attached drafter."""
    return (Path(path) / ATTACHED_FILE).is_file()


@torch.no_grad()
def embedding_fingerprint(model: torch.nn.Module) -> list[float]:
    """A few float32 statistics of the input embedding that identify a model (robust to fp32/bf16 loading)."""
    w = model.get_input_embeddings().weight.detach().float()
    rows = w[: min(64, w.shape[0])]
    return [round(float(rows.abs().mean()), 4), round(float(rows.pow(2).mean().sqrt()), 4), float(w.shape[0]),
            float(w.shape[1])]


def _attach(draft: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    return draft


def feature_layers(model: torch.nn.Module) -> list[int]:
    """The target layers a feature drafter also reads (their outputs, before the final norm), [] for none."""
    return list(getattr(model.config, "speculant_feature_layers", None) or [])


def add_feature_input(draft: torch.nn.Module, taps: list[int] | None = None) -> torch.nn.Module:
    """Give ``draft`` the input map of a feature drafter: ``feature_fc``, ``[emb(x_{t+1}) ; h_t^(l) for l in
    taps ; f_t] -> [H]`` (``taps``: target layers whose outputs it also reads, EAGLE-3 style; recorded in the
    config as ``speculant_feature_layers``), initialised to pass the target's final state through (identity on
    ``f``, small weights elsewhere), so training starts from "the next hidden state is the current one"."""
    if taps is not None:
        draft.config.speculant_feature_layers = list(taps)
    h = draft.config.hidden_size
    width = h * (2 + len(feature_layers(draft)))
    fc = torch.nn.Linear(width, h, bias=True)
    with torch.no_grad():
        torch.nn.init.normal_(fc.weight, std=0.02)
        fc.weight[:, -h:].copy_(torch.eye(h))
        fc.bias.zero_()
    draft.feature_fc = fc.to(device=draft.device, dtype=draft.dtype)
    return draft


def is_feature_drafter(model: torch.nn.Module) -> bool:
    """True for a feature (EAGLE) drafter: one with the ``feature_fc`` input map."""
    return isinstance(getattr(model, "feature_fc", None), torch.nn.Linear)


def build_attached(target: torch.nn.Module, layers: list[int], features: bool = False,
                   taps: list[int] | None = None) -> torch.nn.Module:
    """A drafter made of the target's layers ``layers`` (copied, in that order) and final norm, sharing the
    target's embedding and LM head. Works for decoder models laid out as ``model.layers`` / ``model.norm``
    (Llama, Qwen2/3, Mistral, SmolLM2, ...). ``features``: a feature drafter (:func:`add_feature_input`), also
    reading the outputs of the target's layers ``taps``."""
    base = getattr(target, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise ValueError(f"{type(target).__name__} is not laid out as model.layers / model.norm: an attached "
                         "drafter cannot be built from it")
    n = len(base.layers)
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"layers must be indices of the target's {n} layers, got {layers}")
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layers)
    if hasattr(config, "layer_types") and getattr(config, "layer_types", None):
        config.layer_types = [target.config.layer_types[i] for i in layers]
    draft = type(target)(config).to(target.dtype)
    for j, i in enumerate(layers):
        draft.model.layers[j].load_state_dict(base.layers[i].state_dict())
    draft.model.norm.load_state_dict(base.norm.state_dict())
    if features:
        if taps and any(not 0 <= i < n for i in taps):
            raise ValueError(f"taps must be indices of the target's {n} layers, got {taps}")
        add_feature_input(draft, taps or [])
    draft.eval()
    return _attach(draft, target)


def own_state(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's own parameters (everything but the shared embedding and LM head)."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(_SHARED)}


_SCALE = ".int8_scale"  # key suffix of the per-row scales of an int8-stored matrix
_Q4_SCALE, _Q4_MIN = ".q4_scale", ".q4_min"  # key suffixes of a q4-stored matrix's scales and minimums per 32

STORAGES = ("float", "int8", "q4")
"""How :func:`save_attached` may store a drafter's matrices (``storage=``): in a float ``dtype``, int8 per row, or
q4 (4 bits per weight and a float16 scale and minimum per 32 inputs)."""

EXPORT_STORAGES = ("int8", "q4")
"""The storages ``speculant train draft --store`` exports in (quantized ones)."""


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [R, C], scale float32 [R, 1])`` with ``w ≈ q * scale``, one symmetric scale per output row."""
    scale = w.detach().float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    return (w.detach().float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def _q4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [R, C / 2], scale, minimum float16 [R, C / 32])``: ``w``'s q4 matrix
    (:meth:`speculant.core.quant.QuantMatrix.quantize`, 4-bit codes with a scale and minimum per 32 inputs), the
    even input's code in each byte's low nibble."""
    m = QuantMatrix.quantize(w.detach().float(), "q4")
    return m.codes.contiguous(), m.scale.contiguous(), m.zero.contiguous()


def _q4_values(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 matrix :func:`_q4_groups` stored (the q4 matrix's own values)."""
    return QuantMatrix("q4", codes, scale, minimum, torch.float32).dequantize()


def stored_parameters(path: str | Path) -> tuple[int, set[str]]:
    """``(own parameters, storages)`` of the drafter saved in directory ``path``: how many weights its file holds
    (two q4 codes per byte counted as two) and which of :data:`STORAGES` its matrices use."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    q4 = {k.removesuffix(_Q4_SCALE) for k in shapes if k.endswith(_Q4_SCALE)}
    int8 = {k.removesuffix(_SCALE) for k in shapes if k.endswith(_SCALE)}
    count = sum(math.prod(s) * (2 if k in q4 else 1) for k, s in shapes.items()
                if not k.endswith((_SCALE, _Q4_SCALE, _Q4_MIN)))
    storages = {name for name, used in (("q4", q4), ("int8", int8)) if used}
    return count, storages or {"float"}


def save_attached(draft: torch.nn.Module, target: torch.nn.Module, out: str | Path, target_name: str,
                  dtype: torch.dtype = torch.bfloat16, extra: dict | None = None, storage: str | None = None) -> Path:
    """Write an attached drafter directory: config, own weights, ``attached.json`` (which records ``storage``).

    ``storage`` (one of :data:`STORAGES`; None: ``"int8"`` for ``dtype=torch.int8``, else ``"float"``):
    ``"float"`` stores every weight in ``dtype`` (a float dtype); ``"int8"`` every matrix as int8 with one float32
    scale per row (norm weights bf16), half the bytes of bf16; ``"q4"`` every matrix whose input size is a multiple
    of 32 as 4-bit codes with a float16 scale and minimum per 32 inputs (the q4 kernel's kind: 5 bits per weight;
    other matrices int8, norms bf16). Loading gives the stored values back as floats (q4: the q4 matrix's own
    values); a quantized target's kind then quantizes the drafter's layers from them again. A drafter's numerics
    only change what it proposes, never what is emitted."""
    from safetensors.torch import save_file

    if storage is None:
        storage = "int8" if dtype == torch.int8 else "float"
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {', '.join(STORAGES)}, got {storage!r}")
    if storage == "float" and not dtype.is_floating_point:
        raise ValueError(f"storage 'float' needs a float dtype, got {dtype}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(out)
    tensors = {}
    for k, v in own_state(draft).items():
        if storage == "q4" and v.dim() == 2 and v.shape[1] % GROUP == 0:
            tensors[k], tensors[k + _Q4_SCALE], tensors[k + _Q4_MIN] = _q4_groups(v)
        elif storage != "float" and v.dim() == 2:
            tensors[k], tensors[k + _SCALE] = _int8_rows(v)
        else:
            tensors[k] = v.detach().to(dtype if storage == "float" else torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    (out / ATTACHED_FILE).write_text(json.dumps({
        "shares": ["model.embed_tokens", "lm_head"],
        "features": is_feature_drafter(draft),
        "storage": storage,
        **({"contemplate": {"soft": c.soft, "mixture": c.mixture}} if (c := contemplation_of(draft)) else {}),
        "target": target_name,
        "target_fingerprint": embedding_fingerprint(target),
        **(extra or {}),
    }, indent=1))
    return out


def load_attached(path: str | Path, target: torch.nn.Module) -> torch.nn.Module:
    """Load the attached drafter in ``path`` onto ``target`` (in the target's dtype and device), sharing its
    embedding and LM head. A one-line ValueError when the drafter was made for another model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    meta = json.loads((path / ATTACHED_FILE).read_text())
    expected, got = meta.get("target_fingerprint"), embedding_fingerprint(target)
    if expected is not None and (expected[2:] != got[2:]
                                 or any(abs(a - b) > 2e-3 * max(abs(a), 1e-6) + 1e-4
                                        for a, b in zip(expected[:2], got[:2]))):
        raise ValueError(f"the drafter in {str(path)!r} was made for {meta.get('target')!r}, and the given target "
                         "is a different model (its embedding differs)")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config.model_type != target.config.model_type or config.hidden_size != target.config.hidden_size:
        raise ValueError(f"the drafter in {str(path)!r} is a {config.model_type} of hidden size "
                         f"{config.hidden_size}; the target is a {target.config.model_type} of hidden size "
                         f"{target.config.hidden_size}")
    draft = type(target)(config)
    if meta.get("features"):
        add_feature_input(draft)
    if meta.get("contemplate"):  # a ConFu drafter: its soft prompt is sized by the target
        add_contemplation(draft, target.config, **meta["contemplate"])
    state = load_file(str(path / "model.safetensors"))
    for k in [k for k in state if k.endswith(_SCALE)]:  # int8 rows back to floats
        scale = state.pop(k)
        name = k[: -len(_SCALE)]
        state[name] = state[name].float() * scale
    for k in [k for k in state if k.endswith(_Q4_SCALE)]:  # q4 groups back to floats
        name = k[: -len(_Q4_SCALE)]
        if name not in state or name + _Q4_MIN not in state:
            raise ValueError(f"the drafter in {str(path)!r} is damaged: {name} lacks its 4-bit codes or minimums")
        state[name] = _q4_values(state[name], state.pop(k), state.pop(name + _Q4_MIN))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(_SHARED)]
    if missing or unexpected:
        raise ValueError(f"the drafter in {str(path)!r} does not match its config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    _attach(draft, target)
    draft.to(device=target.device, dtype=target.dtype)
    draft.eval()
    return draft
