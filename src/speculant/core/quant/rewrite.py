"""Quantizing a whole model in place: every linear of its decoder layers and its LM head becomes a
:class:`~.formats.QuantMatrix`.

Quantization is a choice of model, not of decoding method: :func:`quantize_model` turns a model into its quantized
version, and from then on every method (plain decoding, chains, trees, lookup ...) runs that model, so "lossless"
keeps its meaning: each method's output equals plain decoding of the same quantized model.

How it is wired: :func:`quantize_model` records the matrix on each decoder-layer linear and the LM head (attribute
:data:`~.formats.ATTR`, :func:`attach`) and then drops the module's float weight
(:func:`~.release.release`): the weight becomes a shapeless-storage ``meta`` tensor of the same
shape and dtype, and the module's forward multiplies by the quantized matrix
(:meth:`~.formats.QuantMatrix.linear`), so the model's own forward (transformers, the ``hf-*``
baselines, any fallback) runs the quantized weights too, and no float copy of a quantized matrix is kept.
:class:`~speculant.core.llama_forward.LlamaForward` finds the recorded matrices and multiplies by them with the
quantized kernels (fused q/k/v and gate/up concatenated, :meth:`~.formats.QuantMatrix.cat`).
A tied LM head quantizes the shared matrix but keeps its float values, the dequantized rows, for the token
embedding (as in a GGUF file, whose token_embd is quantized).
"""

from __future__ import annotations

import torch

from ..modes import normal_mode
from .formats import ATTR, GROUP, HOLDS, MATRIX_KIND, QUANTIZATIONS, QuantMatrix
from .release import releasable, release

__all__ = ["attach", "quantization_of", "quantize_model", "quantized_linears", "unify_fused"]


def attach(module: torch.nn.Module, matrix: QuantMatrix, release_weight: bool = False) -> None:
    """Make ``module`` (an ``nn.Linear``) the quantized ``matrix``: the matrix is recorded for
    :class:`~speculant.core.llama_forward.LlamaForward` (attribute :data:`~.formats.ATTR`) and the float weight
    either becomes its dequantized values (in place, so tied and fused views follow) or, with ``release_weight``
    (for a module :func:`~.release.releasable` names), is dropped (:func:`~.release.release`).
    A loader that decodes quantized blocks itself (GGUF) calls this with :meth:`QuantMatrix.int4`."""
    weight = module.weight
    if tuple(weight.shape) != tuple(matrix.shape):
        raise ValueError(f"quantized matrix {tuple(matrix.shape)} does not fit weight {tuple(weight.shape)}")
    if matrix.dtype != weight.dtype:
        raise ValueError(f"quantized matrix computes in {matrix.dtype}, the weight is {weight.dtype}")
    if not release_weight:
        with normal_mode():
            weight.copy_(matrix.dequantize())
    setattr(module, ATTR, matrix)
    if release_weight:
        release(module)


def unify_fused(groups: list[tuple[torch.nn.Module, ...]]) -> int:
    """Give every quantized linear of a group that is multiplied as one matrix (``groups``: e.g.
    :func:`speculant.core.llama_forward.fused_groups`) a kind the fused matrix holds exactly: a q6 matrix beside
    another kind becomes the q8 matrix :meth:`QuantMatrix.cat` would make of it, so that the model's own forward
    multiplies by the very matrix the fused call does (a Q4_K_M file's Q6_K value projections, fused with Q4_K q and k).
    Returns the matrices replaced."""
    replaced = 0
    for group in groups:
        matrices = [getattr(m, ATTR, None) for m in group]
        if any(q is None for q in matrices):
            continue
        for module, q, fused in zip(group, matrices, QuantMatrix.fusable(matrices)):
            if fused is not q:
                if module.weight.device.type == "meta":  # released: the matrix alone
                    setattr(module, ATTR, fused)
                else:  # a float weight kept: it takes the new matrix's values
                    attach(module, fused)
                replaced += 1
    return replaced


def quantized_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears :func:`quantize_model` quantizes: the decoder layers' ``nn.Linear`` modules and the LM head (not
    the embedding, norms or other heads)."""
    base = getattr(model, "base_model", model)
    found = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear) and all(head is not m for m in found):
        found.append(head)
    return found


def quantization_of(model: torch.nn.Module) -> str:
    """``"none"`` or one of :data:`~.formats.QUANTIZATIONS`: what :func:`quantize_model` made of
    ``model``."""
    return getattr(model, "speculant_quantization", "none")


def quantize_model(model: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """Quantize ``model`` in place to ``quantization`` (one of :data:`~.formats.QUANTIZATIONS`) and return it:
    every linear of its decoder layers and its LM head (see the module doc). ``"none"`` leaves it as it is; quantizing
    again to the same kind is a no-op, to another kind a ValueError (reload the model instead). int4, q4 and q8 need
    each matrix's input size to be a multiple of 32.

    A linear that already carries a matrix of a kind this one holds (:data:`~.formats.HOLDS`; :func:`attach`: a GGUF
    loader built it from the file's own codes, or it is a head shared with a target quantized alike) is kept as it
    is; one that carries another kind is a ValueError (requantizing it would change the model that shares it)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    current = quantization_of(model)
    if quantization == "none" or quantization == current:
        return model
    if current != "none":
        raise ValueError(f"the model is already quantized to {current}; load it again to quantize to {quantization}")
    linears = quantized_linears(model)
    other = [m for m in linears
             if getattr(m, ATTR, None) is not None and getattr(m, ATTR).kind not in HOLDS[quantization]]
    if other:
        raise ValueError(f"a linear of the model already holds a {getattr(other[0], ATTR).kind} matrix (shared with "
                         f"another model?): it cannot be quantized to {quantization}")
    linears = [m for m in linears if getattr(m, ATTR, None) is None]
    if quantization != "int8":
        bad = [m for m in linears if m.weight.shape[1] % GROUP]
        if bad:
            raise ValueError(f"{quantization} needs input sizes that are multiples of {GROUP}, got "
                             f"{bad[0].weight.shape[1]}")
    free = releasable(model, quantized_linears(model))
    for m in linears:  # each float weight dropped as soon as its matrix exists: the peak stays near the float model
        attach(m, QuantMatrix.quantize(m.weight, MATRIX_KIND.get(quantization, quantization)),
               release_weight=id(m) in free)
    model.speculant_quantization = quantization
    return model
