"""Torch's autograd modes around loading."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["normal_tensors"]

F = TypeVar("F", bound=Callable)


def normal_tensors(func: F) -> F:
    """Run ``func`` outside inference mode and without gradients, whatever the caller's modes. For loaders: weights
    made inside a caller's ``torch.inference_mode()`` would be inference tensors, which cannot be updated in place
    later (quantizing, packing, online adaptation) and have no version counter for the caches keyed on it
    (VocabTrim heads, the lean forward); and ``inference_mode(False)`` alone would turn gradients on inside a
    caller's ``no_grad()``."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
