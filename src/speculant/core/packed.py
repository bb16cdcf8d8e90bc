"""Weight matrices kept in oneDNN's blocked layout, so a CPU matmul does not re-layout them on every call.

On a CPU, ``F.linear`` hands a weight matrix to oneDNN, which first reorders it into its blocked layout, on every
call: for decoding, where each matrix is used once per token for one or a few rows, that reorder reads and writes
the whole matrix again. Over SmolLM2-135M's matrices (270 MB in bf16, far larger than the caches) on 2 cores of an
AVX-512 (bf16) CPU, one sweep of bf16 ``F.linear`` takes 20.0 ms for 1 row and 22.4 ms for 5, the same matrices
reordered once 14.8 and 13.2 ms; float32 46.2 and 56.1 ms vs 27.0 and 35.6 ms (``benchmarks/packed_matmul.py``).

:class:`PackedMatrix` holds that reordered copy and :func:`linear` multiplies by it
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor uses for frozen CPU linears). In bfloat16 the result
is bit for bit ``F.linear``'s (the same oneDNN kernel without the per-call reorder); in float32, where ``F.linear``
calls MKL's sgemm instead, it differs by float32 rounding (about 1e-5 relative). Either way plain and speculative
decoding run through the same kernels, so their outputs stay identical to each other.

The copy costs memory, as much as the weights it packs. :func:`pack_enabled` decides: ``SPECULANT_PACK=1`` packs,
``=0`` never does, and by default (``auto``) a float32 or bfloat16 model on a CPU is packed when its matrices take
at least 1 MiB (smaller ones stay in the CPU's caches, where oneDNN's fixed cost per call outweighs the saved
reorder: the test suite's tiny models ran markedly slower packed) and the copy takes at most a quarter of the memory
the system has available.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .modes import normal_mode
from .quant import QuantMatrix

__all__ = ["PACK_ENV", "PackedMatrix", "available_memory", "linear", "pack_enabled", "packable"]

PACK_ENV = "SPECULANT_PACK"
"""Environment variable: ``1`` (pack), ``0`` (never), ``auto`` (the default; see :func:`pack_enabled`)."""

_AUTO_SHARE = 0.25  # auto packs when the copy takes at most this share of the available memory
_AUTO_MIN_BYTES = 1 << 20  # ... and the matrices at least this many bytes


class PackedMatrix:
    """A ``[out, in]`` weight matrix reordered once into oneDNN's blocked layout (a private copy: later in-place
    changes of the source are not seen; rebuild it). ``shape``, ``dtype`` and ``nbytes`` describe the source."""

    __slots__ = ("packed", "shape", "dtype", "nbytes")

    def __init__(self, weight: torch.Tensor) -> None:
        with normal_mode():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.shape = weight.shape
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * weight.element_size()


def linear(x: torch.Tensor, weight: torch.Tensor | PackedMatrix | QuantMatrix,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a dense, packed or quantized (:class:`~speculant.core.quant.QuantMatrix`: int8,
    int4, or q4 on speculant's own kernel) ``weight`` (``x [..., in]`` -> ``[..., out]``)."""
    if type(weight) is PackedMatrix:
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    if type(weight) is QuantMatrix:
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def packable(weight: torch.Tensor) -> bool:
    """Whether this torch build and CPU can pack ``weight``: a CPU float32 matrix, or bfloat16 where oneDNN has
    bf16 kernels, with no autograd graph wanted through it."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def available_memory() -> int | None:
    """Bytes of memory the system has available (Linux ``MemAvailable``), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def pack_enabled(weights: list[torch.Tensor]) -> bool:
    """Whether to pack ``weights`` (all of one model): ``$SPECULANT_PACK`` decides, by default (``auto``) yes when
    each is :func:`packable`, they take at least 1 MiB, and their copy takes at most a quarter of
    :func:`available_memory`. Raises a ValueError for another value of the variable."""
    mode = os.environ.get(PACK_ENV, "auto").strip().lower()
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"{PACK_ENV} must be auto, 1 or 0, got {mode!r}")
    if mode == "0" or not weights or not all(packable(w) for w in weights):
        return False
    if mode == "1":
        return True
    free = available_memory()
    need = sum(w.numel() * w.element_size() for w in weights)
    return free is not None and _AUTO_MIN_BYTES <= need <= _AUTO_SHARE * free
