"""Torch's autograd modes for tensors that outlive the call that makes them (weights, packed and fused copies)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["normal_mode", "normal_tensors"]

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def normal_mode() -> Iterator[None]:
    """Outside inference mode and without gradients, whatever the caller's modes: tensors made inside a caller's
    ``torch.inference_mode()`` would be inference tensors, which cannot be updated in place later (quantizing,
    packing, online adaptation) and have no version counter for the caches keyed on it (VocabTrim heads, the Llama
    forward); ``inference_mode(False)`` alone would turn gradients on inside a caller's ``no_grad()``."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def normal_tensors(func: F) -> F:
    """``func`` run under :func:`normal_mode` (the loaders)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with normal_mode():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
