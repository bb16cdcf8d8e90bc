"""Reading a GGUF file's tensors straight into a transformers model: no float32 copy on disk.

transformers loads a llama/qwen2 GGUF through its legacy path (``modeling_gguf_pytorch_utils.load_gguf_checkpoint``):
every tensor is dequantized to float32 with ``gguf.dequantize`` (numpy), passed through the architecture's
``TensorProcessor`` (Llama's reverse Q/K row permutation), renamed with ``get_gguf_hf_weights_map`` and cast to the
requested dtype. :func:`load_gguf_model` does exactly that, one tensor at a time into a model built without
initialising its weights, so the weights are bit-identical to transformers' conversion while peak memory stays near
the model's own size; it reuses transformers' processors and name map, so the reorderings cannot drift.

Decoding uses gguf's own numpy code (the reference itself): vectorised torch decoders for Q4_K/Q6_K/Q5_0/Q8_0,
written bit-exact, were 1.5-3x slower than it on this 2-core machine, and the 1.5B loads well inside its budget
without them (README, "Packaged Qwen2.5-Coder models"). :func:`q4_k_codes` exposes a Q4_K tensor's raw block codes
(4-bit codes, per-group scales and minimums, as tensors) for quantized linears.

Only architectures whose transform is per tensor are read directly (:data:`DIRECT_ARCHITECTURES`); anything else
takes transformers' full conversion (:func:`speculant.models.sources.convert_gguf`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

__all__ = ["DIRECT_ARCHITECTURES", "q4_k_codes", "load_gguf_model", "gguf_architecture"]

log = logging.getLogger(__name__)

DIRECT_ARCHITECTURES = frozenset({"llama", "qwen2"})
"""GGUF ``general.architecture`` values :func:`load_gguf_model` reads (tested equal to transformers' conversion)."""



def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte ``start`` of each block, as float32 ``[nb, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(data: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """``[nb, groups * width]`` bytes -> ``[nb, 2 * groups, width]``: per group of ``width`` bytes, low then high
    nibbles (gguf's ``reshape(nb, -1, 1, width) >> [0, 4]``)."""
    x = data.reshape(data.shape[0], groups, 1, width)
    return torch.cat([x & 0xF, x >> 4], dim=2).reshape(data.shape[0], 2 * groups, width)


def q4_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw contents of Q4_K super-blocks ``blocks`` (uint8 ``[nb, 144]``): ``(codes, scales, mins)`` with
    ``codes`` uint8 ``[nb, 8, 32]`` (4-bit values, 8 groups of 32 per super-block), ``scales`` and ``mins`` float32
    ``[nb, 8]`` (fp16 ``d``/``dmin`` times the 6-bit group scale/min), so each value is
    ``scales[..., None] * codes.float() - mins[..., None]``, float32, bit-equal to ``gguf.dequantize`` (tested)."""
    nb = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    s = blocks[:, 4:16].reshape(nb, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]  # the 12 bytes of 6-bit scales and mins, ggml's get_scale_min_k4
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    codes = _nibbles(blocks[:, 16:144], 4, 32)
    return codes, d * sc.float(), dmin * mn.float()


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` of GGUF file ``path`` (read from its memory-mapped header)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def load_gguf_model(path: str | Path, config, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM of ``config`` (what transformers derives from the GGUF file ``path``) with the file's weights,
    dequantized and cast to ``dtype`` one tensor at a time, bit-identical to transformers' own GGUF conversion
    (same decoder values, same ``TensorProcessor``, same names). Returns the model in eval mode.

    Raises ValueError for an architecture outside :data:`DIRECT_ARCHITECTURES` or a file whose tensors do not
    cover the model's parameters."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in DIRECT_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not read directly; known: {', '.join(sorted(DIRECT_ARCHITECTURES))}")
    with no_init_weights():  # every parameter is overwritten below: skip the (slow) random initialisation
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for tensor in reader.tensors:
            weights = dequantize(tensor.data, tensor.tensor_type)  # float32, as transformers' loader
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                       parsed_parameters={"tensors": {}})
            if result.name not in names:
                continue
            target = params.get(names[result.name])
            if target is None:
                continue
            values = np.ascontiguousarray(result.weights)
            values = torch.from_numpy(values if values.flags.writeable else values.copy())  # F32: a read-only map
            if values.numel() != target.numel():
                raise ValueError(f"GGUF tensor {tensor.name} has {values.numel()} values; "
                                 f"{names[result.name]} needs {target.numel()}")
            target.copy_(values.reshape(target.shape))  # casts to the model's dtype, as transformers does
            loaded.add(names[result.name])
    missing = [n for n in params if n not in loaded and not _tied(model, n)]
    if missing:
        raise ValueError(f"GGUF file {str(path)!r} has no tensors for {', '.join(missing[:3])}"
                         + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    model.tie_weights()
    model.eval()
    return model


def _tied(model: torch.nn.Module, name: str) -> bool:
    """True for the output head of a model whose head shares the input embedding's weight."""
    out = model.get_output_embeddings()
    return (out is not None and name.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)
            and out.weight is model.get_input_embeddings().weight)
