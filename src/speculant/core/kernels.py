"""speculant's own CPU kernels (C++ in ``core/csrc/``), compiled on first use and called through ctypes.

Two kernels, one library:

* the ``q4`` matrix product (int4 weights in 32-input blocks with a float16 scale and minimum, activations
  quantized per row to int8 in 32-input blocks; see ``csrc/q4.cpp`` for the scheme and the packed weight layout,
  :mod:`speculant.core.quant` for the quantization kinds), and ``q8``, the same with 8-bit weight codes. Each weight
  block is loaded once for up to 16 rows, so a forward over the 1..16 tokens of a verification reads the weights
  once, as plain decoding does;
* row-independent attention for a forward's few query rows (``csrc/attend.cpp``, :mod:`speculant.core.attention`):
  each row's output is the same bits whether it is computed alone (plain decoding) or beside others, under a
  causal or a tree mask (verification), which is what makes speculation exact bit for bit.

Building: the sources are plain C++ with a C ABI (no torch headers, no pybind, no ninja: why not
``torch.utils.cpp_extension.load``: it needs ninja, which is not a dependency, and compiling against torch's headers
takes tens of seconds where this takes a few), compiled by ``$CXX`` (or ``c++``) with ``-O3 -march=native -fopenmp``
in about four seconds into
``$SPECULANT_CACHE/kernels/`` (default ``~/.cache/speculant/kernels/``), named by a hash of the source, the flags,
the compiler, the CPU's flags and the torch version, so a changed source or a different machine sharing the home
directory builds its own. The library is written to a temporary name and renamed, so concurrent first uses are
safe. OpenMP links ``libgomp.so.1`` by name, which the dynamic loader resolves to the copy torch already loaded:
one thread pool for torch and us, sized by ``torch.get_num_threads()`` at every call.

When no compiler is there, the build fails or ``SPECULANT_KERNELS=0``, :func:`library` returns None after one
logged warning and callers use their torch reference instead (never an error).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["BLOCK_BYTES", "GROUP", "HALF", "KERNELS_ENV", "Q4_BLOCK_BYTES", "Q4_COLUMNS", "Q6_BLOCK_BYTES", "Q8_BLOCK_BYTES", "SOURCES", "attend", "build_of", "cache_dir", "cpu_info",
           "library", "q4_amx", "q4_call", "q4_isa", "q4_layers", "q4_matmul", "q4_seven", "rope_attend", "using"]

log = logging.getLogger(__name__)

KERNELS_ENV = "SPECULANT_KERNELS"
"""Environment variable: ``0`` never builds nor loads the compiled kernels (the torch reference runs instead)."""

GROUP = 32
"""Inputs per block: one weight scale and minimum per column (q4, q8; torch's int4 kernel groups the same way), one
activation scale per row."""
HALF = 16
"""Inputs per q6 sub-scale (GGUF's Q6_K: two per block)."""
Q4_COLUMNS = 16
"""Output columns per packed q4 block."""
Q4_BLOCK_BYTES = 320
"""Bytes per packed q4 block: 16 columns x 32 inputs of 4-bit codes (256), 16 float16 scales, 16 float16 minimums."""
Q8_BLOCK_BYTES = 576
"""Bytes per packed q8 block: 16 columns x 32 inputs of 8-bit codes (512), 16 float16 scales, 16 float16 minimums."""
Q6_BLOCK_BYTES = 448
"""Bytes per packed q6 block: 16 columns x 32 inputs of 6-bit codes (384), 32 int8 sub-scales, 16 float16 ``d``."""
BLOCK_BYTES = {4: Q4_BLOCK_BYTES, 6: Q6_BLOCK_BYTES, 7: Q8_BLOCK_BYTES, 8: Q8_BLOCK_BYTES}
"""Packed block bytes by code bits (7: q8 blocks whose codes all lie below 128, see :func:`q4_matmul`; 6: q6)."""

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("q4.cpp", "attend.cpp", "layers.cpp"))
"""The C++ files compiled into the one library, in build order."""
# -ffp-contract=off: the float operations are exactly the ones written (explicit fma), in every code path
_COMMON = ["-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off"]
_ISA_FLAGS = {"native": ["-march=native"], "avx512": ["-march=skylake-avx512"], "avx2": ["-march=haswell"],
              "generic": []}
_ISA_NAMES = {3: "avx512-vnni", 2: "avx512", 4: "avx2-vnni", 1: "avx2", 0: "scalar"}
_libraries: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$SPECULANT_CACHE/kernels``, else ``$XDG_CACHE_HOME/speculant/kernels``,
    else ``~/.cache/speculant/kernels``."""
    root = os.environ.get("SPECULANT_CACHE")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "speculant" / "kernels"


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and feature flags as Linux reports them (``/proc/cpuinfo``), else ``("", [])``."""
    name, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not name and line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif not flags and line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1].split()
                if name and flags:
                    break
    except OSError:
        pass
    return name, flags


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), else the processor's name: part of the build key (-march=native)."""
    flags = cpu_info()[1]
    return " ".join(sorted(flags)) if flags else (platform.processor() or platform.machine())


def _build(isa: str, sources: tuple[Path, ...] = SOURCES) -> Path:
    """Compile ``sources`` (default: the ``csrc/`` files, :data:`SOURCES`) into one library for ``isa``
    (``native``, or ``avx2``/``generic`` for tests) unless already cached;
    the library's path. Raises (RuntimeError, OSError) when it cannot."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX)")
    source = b"\0".join(path.read_bytes() for path in sources)
    flags = _COMMON + _ISA_FLAGS[isa]
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), cxx.encode(), _cpu_flags().encode(),
                                     torch.__version__.encode(), platform.machine().encode()])).hexdigest()[:16]
    path = cache_dir() / f"speculant-{isa}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        errors = ""
        for openmp in (["-fopenmp"], []):  # no OpenMP (e.g. Apple clang without libomp): one thread
            done = subprocess.run([cxx, *flags, *openmp, *map(str, sources), "-o", tmp], capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(tmp, path)
                return path
            errors = done.stderr
        raise RuntimeError(f"{cxx} failed: {errors.strip()[-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library(isa: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel library for ``isa`` (built on first use), or None when it is disabled
    (``SPECULANT_KERNELS=0``) or cannot be built or loaded (one warning per ISA, logged)."""
    if isa in _libraries:
        return _libraries[isa]
    lib = None
    if os.environ.get(KERNELS_ENV, "1").strip() == "0":
        log.info("%s=0: speculant's compiled kernels are off, the torch reference runs instead", KERNELS_ENV)
    else:
        try:
            lib = _load(_build(isa))
            routes = (" + AMX from 10 rows" if lib.q4_amx(-1) else "") + (" + 7-bit route" if lib.q4_seven(-1) else "")
            log.info("speculant q4 kernel (%s): %s%s", isa, _ISA_NAMES.get(lib.q4_isa(), "?"), routes)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("speculant's compiled kernels are unavailable (%s); using the slower torch references", e)
            lib = None
    _libraries[isa] = lib
    return lib


def build_of(folder: str | Path) -> ctypes.CDLL:
    """The native build of another copy of the kernel sources (``folder`` holds the files of :data:`SOURCES` by
    name, e.g. an earlier revision's), for benchmarks that compare builds (:func:`using`). The copy must have this
    version's C functions and packed-weight layout (the signatures declared here are used as they are); the same
    sources give the same cached library. Raises RuntimeError when it cannot be built or lacks a function."""
    try:
        return _load(_build("native", tuple(Path(folder) / path.name for path in SOURCES)))
    except (AttributeError, OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the kernels in {folder} cannot be built or loaded: {e}") from None


@contextlib.contextmanager
def using(lib: ctypes.CDLL | None):
    """Within the block, :func:`library` (the native build every caller asks for) returns ``lib``."""
    had, before = "native" in _libraries, _libraries.get("native")
    _libraries["native"] = lib
    try:
        yield lib
    finally:
        if had:
            _libraries["native"] = before
        else:
            _libraries.pop("native", None)


def _load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its functions' C signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.q4_matmul.restype = ctypes.c_int
    lib.q4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.q4_isa.restype = ctypes.c_int
    if hasattr(lib, "q4_glu"):  # (an earlier revision's build, benchmarks/kernel_ab.py, may lack it)
        lib.q4_glu.restype = None
        lib.q4_glu.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
    lib.q4_amx.restype = ctypes.c_int
    lib.q4_amx.argtypes = [ctypes.c_int]
    if hasattr(lib, "q4_seven"):  # (an earlier revision's build, benchmarks/kernel_ab.py, may lack it)
        lib.q4_seven.restype = ctypes.c_int
        lib.q4_seven.argtypes = [ctypes.c_int]
    lib.q4_layers.restype = ctypes.c_int
    lib.q4_layers.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 3, ctypes.c_void_p,
                              *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                              ctypes.c_float, ctypes.c_int]
    lib.rope_attend.restype = ctypes.c_int
    lib.rope_attend.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 4, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 2,
                                ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_float,
                                ctypes.c_void_p, ctypes.c_int]
    lib.attend.restype = ctypes.c_int
    lib.attend.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p, *[ctypes.c_int64] * 2,
                           ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_int, *[ctypes.c_int64] * 5,
                           ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


def q4_seven(enabled: bool | None = None, isa: str = "native") -> bool:
    """Whether q8 products whose codes all lie below 128 (``bits=7``) take a route of their own (AVX2 without VNNI:
    one ``maddubs`` per 4 inputs instead of two, the same bits); ``enabled`` turns it on or off first (tests and
    benchmarks compare the routes). False without a library, and where the build has no such route."""
    lib = library(isa)
    if lib is None or not hasattr(lib, "q4_seven"):
        return False
    return bool(lib.q4_seven(-1 if enabled is None else int(enabled)))


def q4_isa(isa: str = "native") -> str | None:
    """The code path the ``isa`` build compiled (``avx512-vnni``, ``avx512``, ``avx2-vnni``, ``avx2``, ``scalar``), or None
    without a library."""
    lib = library(isa)
    return None if lib is None else _ISA_NAMES.get(lib.q4_isa(), "?")


def q4_amx(enabled: bool | None = None, isa: str = "native") -> bool:
    """Whether the q4/q8 products of 10..16 rows (per tile of 16) run on AMX tiles (Intel Sapphire Rapids and later, a native build,
    and Linux granting the tile state); ``enabled`` turns that on or off first (tests compare the paths: the same
    bits). False without a library."""
    lib = library(isa)
    if lib is None:
        return False
    return bool(lib.q4_amx(-1 if enabled is None else int(enabled)))


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, lib: ctypes.CDLL, *,
              norm: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False,
              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, bits: int = 4) -> torch.Tensor:
    """``x [M, K]`` (float32 or bfloat16, contiguous) times the packed q4 (``bits=4``), q8 (``bits=8``) or q6
    (``bits=6``) weights ``packed`` (uint8 ``[ceil(n / 16), K / 32, 320, 576 or 448]``, see
    :class:`speculant.core.quant.QuantMatrix`; ``bits=7``: 8-bit blocks whose codes all lie below 128, which the
    caller guarantees, see :func:`q4_seven`) ->
    ``[M, n]`` in ``x``'s dtype, on ``torch.get_num_threads()`` threads.

    Fused around the product (each step rounded to the dtype as the separate torch op would be; see
    ``csrc/q4.cpp``): ``norm [K]`` RMSNorm of each row first (with ``eps``), or ``glu``: ``x`` is ``[M, 2K]`` =
    ``[gate | up]`` and the product takes ``silu(gate) * up`` (silu's exp the kernel's own, within about an ulp of
    torch's: :func:`glu`); after it ``+ bias [n]``, then ``residual [M, n] +``.
    """
    m, xk = x.shape
    k = xk // 2 if glu else xk
    if (x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous() or k % GROUP
            or (glu and xk % 2)):
        raise ValueError(f"q4_matmul takes a contiguous float32/bfloat16 [M, K] with K a multiple of 32 ([M, 2K] "
                         f"with glu), got {x.dtype} {tuple(x.shape)}")
    if bits not in BLOCK_BYTES:
        raise ValueError(f"q4_matmul takes 4-, 6-, 7- or 8-bit codes, got bits={bits}")
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (-(-n // Q4_COLUMNS), k // GROUP, BLOCK_BYTES[bits]):
        raise ValueError(f"packed q4 weights of shape {tuple(packed.shape)} do not fit [{n}, {k}]")
    operands = {"norm": (norm, (k,)), "bias": (bias, (n,)), "residual": (residual, (m, n))}
    for name, (t, shape) in operands.items():
        if t is not None and (t.dtype != x.dtype or tuple(t.shape) != shape or not t.is_contiguous()):
            raise ValueError(f"q4_matmul's {name} must be a contiguous {x.dtype} {list(shape)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if norm is not None and glu:
        raise ValueError("q4_matmul fuses a norm or a GLU before the product, not both")
    return q4_call(x, k, packed, bits, n, lib, norm, eps, glu, bias, residual)


def glu(x: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
    """The GLU step a ``glu=True`` product applies before it, on its own: ``x [2K]`` = ``[gate | up]`` (float32 or
    bfloat16, contiguous) -> ``silu(gate) * up`` ``[K]`` as float32 (holding values of ``x``'s dtype), with the
    kernel's own ``1 + exp`` (``csrc/q4.cpp``: the same bits on every code path)."""
    if x.dim() != 1 or x.numel() % 2 or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"glu takes a contiguous float32/bfloat16 [2K], got {x.dtype} {tuple(x.shape)}")
    out = torch.empty(x.numel() // 2, dtype=torch.float32)
    lib.q4_glu(x.data_ptr(), x.dtype == torch.bfloat16, out.numel(), out.data_ptr())
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def q4_call(x: torch.Tensor, k: int, packed: torch.Tensor, bits: int, n: int, lib: ctypes.CDLL,
            norm: torch.Tensor | None, eps: float, glu: bool, bias: torch.Tensor | None,
            residual: torch.Tensor | None) -> torch.Tensor:
    """:func:`q4_matmul` without its checks (``x [M, K]`` or ``[M, 2K]`` with ``glu``): for callers that hold
    operands of known shapes (:meth:`speculant.core.quant.QuantMatrix.fused`, hundreds of calls per forward)."""
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    if m and n:
        if bits == 7 and not hasattr(lib, "q4_seven"):  # an earlier revision's build (kernel_ab.py): 8-bit codes
            bits = 8
        rc = lib.q4_matmul(x.data_ptr(), x.dtype == torch.bfloat16, m, k, packed.data_ptr(), bits, n, y.data_ptr(),
                           _ptr(norm), eps, glu, _ptr(bias), _ptr(residual), torch.get_num_threads())
        if rc == -3:
            raise ValueError(f"q4_matmul: this build does not take bits={bits}")
        if rc:
            raise MemoryError("q4_matmul: out of memory for the quantized activations")
    return y


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
           lib: ctypes.CDLL) -> torch.Tensor:
    """Row-independent attention (``csrc/attend.cpp``): ``q [Hq, T, D]``, ``k``/``v`` ``[Hkv, S, D]`` (float32 or
    bfloat16, all one dtype, any strides with the last dimension contiguous), ``allowed`` None (causal: row ``t``
    sees keys ``< S - T + t + 1``) or bool ``[T, S]`` -> ``[T, Hq, D]`` in ``q``'s dtype, on
    ``torch.get_num_threads()`` threads."""
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    dtype = q.dtype
    if (dtype not in (torch.float32, torch.bfloat16) or k.dtype != dtype or v.dtype != dtype
            or any(x.stride(-1) != 1 for x in (q, k, v)) or v.shape != k.shape or k.shape[2] != d):
        raise ValueError(f"attend takes float32/bfloat16 q [Hq, T, D], k and v [Hkv, S, D] of one dtype with the last "
                         f"dimension contiguous, got {q.dtype} {tuple(q.shape)}, {k.dtype} {tuple(k.shape)}, "
                         f"{v.dtype} {tuple(v.shape)}")
    mask = None
    if allowed is not None:
        if tuple(allowed.shape) != (t, s):
            raise ValueError(f"attend's mask must be [T, S] = [{t}, {s}], got {tuple(allowed.shape)}")
        mask = allowed.to(torch.uint8).contiguous()
    out = torch.empty(t, hq, d, dtype=dtype)
    if t:
        rc = lib.attend(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                        v.data_ptr(), v.stride(0), v.stride(1), int(dtype == torch.bfloat16), hq, hkv, t, s, d,
                        None if mask is None else mask.data_ptr(), float(scale), out.data_ptr(),
                        torch.get_num_threads())
        if rc:
            raise ValueError(f"attend: bad sizes Hq={hq}, Hkv={hkv}, T={t}, S={s}, D={d}")
    return out


def rope_attend(qkv: torch.Tensor, heads: int, kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, allowed: torch.Tensor | None,
                scale: float, lib: ctypes.CDLL) -> torch.Tensor:
    """One attention block after the fused q/k/v projection, in one call (``csrc/attend.cpp``, unchecked:
    :class:`~speculant.core.llama_forward.LlamaForward`'s hot path): RoPE on the queries and keys of
    ``qkv [T, (Hq + 2 Hkv) D]`` (contiguous) at ``positions`` (int64 ``[T]``, tables ``cos``/``sin`` ``[P, D]``
    contiguous, in ``qkv``'s dtype), keys and values written into the cache buffers ``k``/``v`` ``[Hkv, capacity, D]``
    (last dimension contiguous) at slots ``start .. start + T - 1``, then :func:`attend` over the ``start + T`` slots
    (``allowed``: None for causal, or uint8 ``[T, start + T]`` contiguous) -> ``[T, Hq * D]``; bit for bit the torch
    RoPE followed by :func:`attend`."""
    t = qkv.shape[0]
    d = cos.shape[1]
    out = torch.empty(t, heads * d, dtype=qkv.dtype)
    rc = lib.rope_attend(qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), t, heads, kv_heads, d,
                         positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1),
                         v.data_ptr(), v.stride(0), v.stride(1), start, _ptr(allowed), float(scale), out.data_ptr(),
                         torch.get_num_threads())
    if rc:
        raise (MemoryError if rc == -2 else ValueError)(f"rope_attend failed ({rc}): T={t}, Hq={heads}, "
                                                       f"Hkv={kv_heads}, D={d}, start={start}")
    return out


def q4_layers(x: torch.Tensor, weights: torch.Tensor, intermediate: int, heads: int, kv_heads: int,
              positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: torch.Tensor,
              caches: torch.Tensor, scale: float, eps: float, lib: ctypes.CDLL) -> None:
    """Every decoder layer of a q4 :class:`~speculant.core.llama_forward.LlamaForward` in one call
    (``csrc/layers.cpp``, unchecked: its hot path), ``x [T, H]`` (contiguous, the residual stream of one or several
    sequences' rows) updated in place: per layer the q4 products with their norms, biases, GLU and residuals
    (:func:`q4_call`) over all rows, around :func:`rope_attend` per sequence, the same calls in the same order.
    ``weights``: int64 ``[L, 14]``, addresses and code bits; ``segments``: int64 ``[S, 8]`` per sequence (first row,
    rows, cache start, mask address or 0, key/value head and slot strides); ``caches``: int64 ``[S, L, 2]`` key/value
    buffer addresses (see the C source); ``positions``: int64 ``[T]``."""
    t, h = x.shape
    if not hasattr(lib, "q4_seven"):  # an earlier revision's build (kernel_ab.py) takes 7-bit codes as 8-bit ones
        weights = weights.clone()
        weights[:, 10:] = torch.where(weights[:, 10:] == 7, 8, weights[:, 10:])
    rc = lib.q4_layers(x.data_ptr(), int(x.dtype == torch.bfloat16), t, h, weights.shape[0], weights.data_ptr(),
                       intermediate, heads, kv_heads, cos.shape[1], positions.data_ptr(), cos.data_ptr(),
                       sin.data_ptr(), segments.shape[0], segments.data_ptr(), caches.data_ptr(), float(scale),
                       float(eps), torch.get_num_threads())
    if rc:
        raise (MemoryError if rc == -2 else ValueError)(f"q4_layers failed ({rc}): T={t}, H={h}")
