"""The training precision shared by both pipelines: bf16 autocast where the hardware computes it natively."""

from __future__ import annotations

import torch

__all__ = ["autocast_dtype"]


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` (auto | fp32 | bf16) on ``device``: auto is bf16 where the
    hardware computes it natively, else None (fp32)."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16  # CPUs with native bf16 (AVX512-BF16, AMX) train about twice as fast
    return None
