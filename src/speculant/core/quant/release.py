"""Dropping the float weight of a quantized linear: once its :class:`~.formats.QuantMatrix` is
attached, the module keeps only a ``meta`` weight (shape and dtype, no data) and multiplies by the matrix, so a
quantized model holds no float copy of its matrices.
"""

from __future__ import annotations

import torch

from .formats import ATTR

__all__ = ["ReleasedLinear", "releasable", "release"]


class ReleasedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose float weight :func:`release` dropped: the weight is a ``meta`` tensor of
    the same shape and dtype, the forward multiplies by the module's
    :class:`~.formats.QuantMatrix`, and device or dtype moves
    (``model.to(...)``) leave the weight as it is (it holds no data to move)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, ATTR).linear(x, self.bias)

    def _apply(self, fn, recurse=True):
        weight = self._parameters.pop("weight")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = weight


def releasable(model: torch.nn.Module, linears: list[torch.nn.Module]) -> set[int]:
    """``id``\ s of those of ``linears`` (the linears of ``model`` being quantized:
    :func:`~.rewrite.quantized_linears`) whose float weight no other, unquantized parameter of
    ``model`` shares (a tied LM head's token embedding does: that weight stays, as its dequantized values)."""
    ids = {id(m) for m in linears}
    keep = {p.untyped_storage().data_ptr() for module in model.modules() if id(module) not in ids
            for p in module.parameters(recurse=False) if p.device.type != "meta"}
    return {id(m) for m in linears if type(m) is torch.nn.Linear and m.weight.device.type != "meta"
            and m.weight.untyped_storage().data_ptr() not in keep}


def release(module: torch.nn.Linear) -> int:
    """Drop the float weight of a quantized ``module`` (one :func:`releasable` names): the weight becomes a ``meta``
    tensor of the same shape and dtype (shapes, dtypes and parameter counts still read right) and the module a
    :class:`ReleasedLinear`, whose forward multiplies by its
    :class:`~.formats.QuantMatrix`. Returns the bytes released."""
    if getattr(module, ATTR, None) is None:
        raise ValueError("only a quantized linear (with its QuantMatrix attached) can release its float weight")
    w = module.weight
    module.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    module.__class__ = ReleasedLinear
    return w.numel() * w.element_size()
