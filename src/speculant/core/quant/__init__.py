"""Weight-only quantized matrices and quantized models.

* :mod:`.formats`: :class:`QuantMatrix` (int8, int4 on torch's CPU kernels; q4, q8, q6 on speculant's own), the
  packing into each kernel's layout, its products, and the tables naming the kinds and model quantizations;
* :mod:`.reference`: q4's product in torch, op for op as the compiled kernel computes it;
* :mod:`.rewrite`: quantizing a whole model in place (:func:`quantize_model`, :func:`attach`, :func:`unify_fused`);
* :mod:`.release`: dropping a quantized linear's float weight (:class:`ReleasedLinear`).

The public names of all four are here too: ``from speculant.core.quant import QuantMatrix, quantize_model``.
"""

from .formats import (
    ATTR,
    BITS,
    BLOCK_KINDS,
    BLOCK_LAYOUT,
    DRAFT_KIND,
    GROUP,
    HALF,
    HOLDS,
    KINDS,
    MATRIX_KIND,
    QUANTIZATIONS,
    QuantMatrix,
)
from .reference import q4_activations, q4_reference
from .release import ReleasedLinear, releasable, release
from .rewrite import attach, quantization_of, quantize_model, quantized_linears, unify_fused

__all__ = ["ATTR", "BITS", "BLOCK_KINDS", "BLOCK_LAYOUT", "DRAFT_KIND", "GROUP", "HALF", "HOLDS", "KINDS",
           "MATRIX_KIND", "QUANTIZATIONS", "QuantMatrix", "ReleasedLinear", "attach", "q4_activations", "q4_reference",
           "quantization_of", "quantize_model", "quantized_linears", "releasable", "release", "unify_fused"]
