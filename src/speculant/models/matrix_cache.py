"""A GGUF model's quantized matrices, cached on disk in the q4 / q8 / q6 kernel's own block layout.

Building a q4, file or q8 model from a GGUF file means decoding the file's tensors, taking its codes (or
requantizing the wider ones) and packing them into the kernel's blocks (:meth:`speculant.core.quant.QuantMatrix
._pack`): for Qwen2.5-Coder-1.5B tens of seconds of decoding, codes and packing at every load, and a float32 peak
of several GB. The blocks are the same bytes each time, so the first load writes them next
to the model's cached metadata (``<model dir>/matrices-<quantization>-<dtype>-v<layout>.safetensors``, one tensor
per linear, named by module) and later loads read them back: the tensors whose matrices the file holds are then not
decoded at all (:func:`speculant.models.gguf.load_gguf_model`'s ``skip``), only the float parts (embedding, norms,
biases) are. The result is the same model, bit for bit: the same blocks, attached the same way
(:func:`speculant.core.quant.attach`; a tied head's shared embedding again takes the matrix's dequantized values).

The file is written to a temporary name and renamed into place (an interrupted write leaves nothing half-made).
It records what made it: the block layout (:data:`speculant.core.quant.BLOCK_LAYOUT`), the way matrices are built
(:data:`BUILD`), torch's and transformers' versions, the quantization and dtype, and the GGUF file (resolved path,
size, modification time); a file that differs in any of these, cannot be read, or does not hold exactly the model's
quantized linears is ignored with a warning and rewritten (files of older block layouts, and temporaries of
interrupted writes, are deleted then). Only q4, q8 and q6 matrices are cached (the int4 and int8 kinds
run torch's kernels, whose packed forms are torch's own). Deleting the file, or the whole cache, is always safe. On
disk: about the quantized model's size per quantization and dtype loaded.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.quant import ATTR, BLOCK_KINDS, BLOCK_LAYOUT, HOLDS, QuantMatrix, ReleasedLinear, attach, quantized_linears, \
    releasable

__all__ = ["BUILD", "CACHED", "Cached", "cache_file", "load_matrices", "read_cache", "save_matrices"]

log = logging.getLogger(__name__)

CACHED = tuple(q for q, kinds in HOLDS.items() if set(kinds) <= set(BLOCK_KINDS))
"""The quantizations whose matrices are cached: those made of q4 / q8 kernel blocks only (q4, file, q8)."""

BUILD = 5  # (2: Q6_K requantized to 7 bits, undone; 3: Q6_K as q6; 4: fused parts unified; 5: "file" named)
"""Version of how a GGUF model's matrices are made (:func:`speculant.models.loading.quantize_loaded`: which tensors
keep their codes and in which kind, requantization from values, the decoders): bump it with any change there, so
that caches made the old way are rebuilt."""

_KEY = "speculant"  # the safetensors metadata entry holding the description


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_file(model_dir: str | Path, quantization: str, dtype: torch.dtype) -> Path | None:
    """Where model directory ``model_dir``'s matrices in ``quantization`` and ``dtype`` are cached (None for a
    quantization that is not cached)."""
    if quantization not in CACHED:
        return None
    return Path(model_dir) / f"matrices-{quantization}-{_dtype_name(dtype)}-v{BLOCK_LAYOUT}.safetensors"


def _made_by(quantization: str, dtype: torch.dtype, gguf_file: Path) -> dict:
    """What a cache file must have been made by to be read: code, libraries, kind, dtype and source file."""
    import transformers

    stat = gguf_file.stat()
    return {"layout": BLOCK_LAYOUT, "build": BUILD, "torch": torch.__version__, "transformers": transformers.__version__,
            "quantization": quantization, "dtype": _dtype_name(dtype),
            "gguf": {"path": str(gguf_file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}}


@dataclass(frozen=True)
class Cached:
    """A readable cache file: its ``path`` and its matrices (``{module name: (kind, (out, in), released)}``)."""

    path: Path
    matrices: dict[str, tuple[str, tuple[int, int], bool]]

    @property
    def undecoded(self) -> set[str]:
        """The parameter names (``<module>.weight``) a loader need not decode: the released matrices' weights."""
        return {f"{name}.weight" for name, (_, _, released) in self.matrices.items() if released}


def _entry(info, kinds: tuple[str, ...]) -> tuple[str, tuple[int, int], bool] | None:
    """One matrix's description, checked: ``(kind, (out, in), released)``, else None."""
    if not isinstance(info, dict) or info.get("kind") not in kinds or not isinstance(info.get("released"), bool):
        return None
    shape = info.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
        return None
    return info["kind"], (shape[0], shape[1]), info["released"]


def read_cache(path: Path | None, quantization: str, dtype: torch.dtype, gguf_file: Path) -> Cached | None:
    """The cache file at ``path`` if it was made for ``quantization`` and ``dtype`` from ``gguf_file`` by this
    version (:func:`_made_by`) and describes its matrices well, else None (with a warning when a file is there)."""
    if path is None or not path.is_file():
        return None
    why = "its description is damaged"
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            about = json.loads((f.metadata() or {})[_KEY])
        if isinstance(about, dict) and isinstance(about.get("matrices"), dict):
            made = {k: v for k, v in about.items() if k != "matrices"}
            kinds = HOLDS[quantization]
            matrices = {name: _entry(info, kinds) for name, info in about["matrices"].items()}
            if made != _made_by(quantization, dtype, gguf_file):
                why = "made by another version, for another kind or dtype, or from another file"
            elif matrices and None not in matrices.values():
                return Cached(path, matrices)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is rebuilt
        why = " ".join(str(exc).split())[:200]
    log.warning("ignoring the matrix cache %s (%s): it will be rebuilt", path, why)
    return None


def load_matrices(model: torch.nn.Module, cached: Cached, quantization: str) -> bool:
    """Attach ``cached``'s matrices to ``model`` (loaded with :attr:`Cached.undecoded` left undecoded) and mark it
    quantized to ``quantization``; True on success. False, with a warning and nothing attached, when the file does
    not hold exactly the model's quantized linears in their shapes (then load the model again, decoding all)."""
    modules, quantized = dict(model.named_modules()), set(quantized_linears(model))
    linears = {name for name, m in modules.items() if m in quantized}
    free = releasable(model, quantized_linears(model))
    plan = []
    for name, (kind, shape, released) in cached.matrices.items():
        module = modules.get(name)
        if (name not in linears or tuple(module.weight.shape) != shape or released != (id(module) in free)):
            break
        plan.append((name, module, kind, shape))
    if len(plan) != len(cached.matrices) or set(cached.matrices) != linears:
        log.warning("ignoring the matrix cache %s: it does not hold this model's quantized linears", cached.path)
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(cached.path), framework="pt") as f:
            matrices = [(module, QuantMatrix.from_blocks(kind, shape, f.get_tensor(name), module.weight.dtype))
                        for name, module, kind, shape in plan]
    except Exception as exc:  # noqa: BLE001 - a damaged file: rebuilt by the caller
        log.warning("ignoring the matrix cache %s (%s)", cached.path, " ".join(str(exc).split())[:200])
        return False
    for module, matrix in matrices:
        attach(module, matrix, release_weight=id(module) in free)
    model.speculant_quantization = quantization  # every quantized linear holds its matrix now
    return True


def save_matrices(model: torch.nn.Module, path: Path, quantization: str, dtype: torch.dtype, gguf_file: Path) -> bool:
    """Write the q4 / q8 / q6 matrices of ``model`` (made from ``gguf_file`` in ``quantization`` and ``dtype``) to
    ``path``, atomically; False, writing nothing, when a linear holds another kind or the write fails (a read-only
    or full disk: the model is still usable, only not cached)."""
    tensors, matrices = {}, {}
    linears = set(quantized_linears(model))
    for name, module in model.named_modules():
        matrix = getattr(module, ATTR, None) if module in linears else None
        if matrix is None:
            continue
        if matrix.kind not in BLOCK_KINDS:
            return False
        tensors[name] = matrix.blocks
        matrices[name] = {"kind": matrix.kind, "shape": list(matrix.shape),
                          "released": type(module) is ReleasedLinear}
    if not tensors:
        return False
    about = {**_made_by(quantization, dtype, gguf_file), "matrices": matrices}
    from safetensors.torch import save_file

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".matrices-", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata={_KEY: json.dumps(about)})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as any file the cache holds (mkstemp made it private)
        os.replace(tmp, path)
        tmp = None
    except Exception as exc:  # noqa: BLE001 - OSError, safetensors' own I/O errors: the load goes on uncached
        log.warning("could not write the matrix cache %s (%s): later loads rebuild the matrices", path,
                    " ".join(str(exc).split())[:200])
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    log.info("cached %d quantized matrices in %s", len(tensors), path)
    _remove_outdated(path)
    return True


def _remove_outdated(path: Path) -> None:
    """Delete what no load will read again beside a freshly written cache file: the same quantization and dtype
    under older block layouts (newer ones belong to a newer installation sharing the cache), and temporaries an
    interrupted write left (over an hour old). Never fails: another process may be renaming or removing them."""
    import time

    stem = path.name.rsplit("-v", 1)[0]
    for p in [*path.parent.glob(f"{stem}-v*.safetensors"), *path.parent.glob(".matrices-*.tmp")]:
        try:
            if p.suffix == ".tmp":
                if time.time() - p.stat().st_mtime > 3600:
                    p.unlink()
            elif int(p.name[len(stem) + 2:].removesuffix(".safetensors")) < BLOCK_LAYOUT:
                p.unlink()
        except (OSError, ValueError):
            pass
