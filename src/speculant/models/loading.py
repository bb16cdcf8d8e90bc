"""Loading local Hugging Face model directories (never the network), with one-line errors for what is missing.

A model directory is what ``model.save_pretrained(d); tokenizer.save_pretrained(d)`` writes: ``config.json``,
weights (``*.safetensors`` or ``pytorch_model*.bin``, sharded or not) and tokenizer files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..core.modes import normal_tensors
from ..core.quant import QUANTIZATIONS
from .attached import is_attached, load_attached
from .gguf import CODED, code_kind, coded_weights, load_gguf_model
from .vlm import is_vision_language, text_view
from .sources import (ASSETS, PACKAGED, convert_gguf, gguf_backing, hub_cached_dir, install_files, is_hub_id,
                      packaged_gguf, packaged_installed)

__all__ = ["check_model_dir", "load_model_dir", "load_pretrained", "load_draft", "default_draft_for", "default_method_for", "load_tokenizer", "draft_context", "bundled_dir", "tokenizers_match", "resolve_model", "DTYPES", "BUNDLED", "check_quantization", "quantize_loaded", "wide_variant"]

log = logging.getLogger(__name__)

# Any one of these is enough for AutoTokenizer: a fast tokenizer (tokenizer.json), a SentencePiece model, or
# the vocab files of BPE (vocab.json + merges.txt) and WordPiece (vocab.txt) tokenizers.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names :func:`load_model_dir` accepts as strings (besides ``"auto"``: the dtype in config.json)."""


def check_model_dir(path: str | Path) -> Path:
    """Return ``path`` as a Path if it is a loadable model directory, else raise a one-line ValueError that names
    the directory and every missing file."""
    d = Path(path).expanduser()
    if not d.exists():
        raise ValueError(f"model directory {str(d)!r} does not exist")
    if not d.is_dir():
        raise ValueError(f"{str(d)!r} is not a directory: a model directory (save_pretrained output) is expected")
    missing = []
    if is_attached(d):  # an attached drafter: own weights only, the target's tokenizer and embedding
        missing = [f for f in ("config.json", "model.safetensors") if not (d / f).is_file()]
        if missing:
            raise ValueError(f"attached drafter directory {str(d)!r} is missing {'; '.join(missing)}")
        return d
    if not (d / "config.json").is_file():
        missing.append("config.json")
    backing = gguf_backing(d)  # a directory made from a GGUF file reads its weights from that file
    if backing is not None:
        if not backing.is_file():
            missing.append(f"its weights' GGUF file {backing} (delete the directory to rebuild it)")
    elif not any(f.is_file() for pattern in _WEIGHT_PATTERNS for f in d.glob(pattern)):
        missing.append("weights (" + " or ".join(_WEIGHT_PATTERNS) + ")")
    if not any((d / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer files (one of " + ", ".join(_TOKENIZER_FILES) + ")")
    if missing:
        raise ValueError(f"model directory {str(d)!r} is missing {'; '.join(missing)}")
    return d


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(DTYPES)}")


def check_quantization(quantization: str | None) -> str:
    """``quantization`` if it is one of :data:`speculant.core.quant.QUANTIZATIONS` (None: ``"none"``), else a
    one-line ValueError."""
    if quantization is None:
        return "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; known: {', '.join(QUANTIZATIONS)}")
    return quantization


WIDE_TAGS = {"8bit": 8, "7bit": 7}
"""Benchmark variants of a quantization (``KIND/TAG``, e.g. ``file/8bit``): a GGUF file's Q6_K tensors requantized
to 8- or 7-bit q8 codes instead of kept as q6 (:func:`quantize_loaded`'s ``wide_bits``)."""


def wide_variant(kind: str) -> tuple[str, int]:
    """``KIND`` or ``KIND/TAG`` (:data:`WIDE_TAGS`) -> ``(KIND, wide_bits)`` (6, the default, without a tag).
    ValueError for another tag."""
    base, _, tag = kind.partition("/")
    if tag and tag not in WIDE_TAGS:
        raise ValueError(f"{kind!r}: the tag after '/' must be one of {', '.join(WIDE_TAGS)}")
    return base, WIDE_TAGS.get(tag, 6)


@normal_tensors
def quantize_loaded(model: torch.nn.Module, quantization: str, gguf_file: str | Path | None = None,
                    undecoded: frozenset[str] | set[str] = frozenset(), wide_bits: int = 6) -> int:
    """Quantize a freshly loaded ``model`` in place to ``quantization`` (:func:`speculant.core.quant.quantize_model`)
    and return how many matrices were built from a GGUF file's own codes.

    With ``gguf_file`` (the file the model's weights were read from) and an int4, q4, file or q8 kind, every matrix
    the file stores as codes with a scale and minimum per 32 (:data:`speculant.models.gguf.CODE_TYPES`) takes those
    codes unchanged (:meth:`~speculant.core.quant.QuantMatrix.from_codes`) where the kind holds them: 4-bit codes
    (Q4_K, Q4_1, Q4_0) in int4, q4, file and q8; 5- and 8-bit codes (Q5_0, Q5_1, Q8_0) in q8 matrices, which a ``file``
    model holds too. So the quantized model is the file's model: int4 computes ``(q - 8) * scale + (minimum + 8 *
    scale)`` in the model's dtype (float32: the file's values but for a rare last-bit rounding of that form), q4
    and q8 round each scale and minimum to float16 (exact for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, whose d and m are
    float16 and whose minimums 8 d, 16 d, 128 d are too; Q4_K's ``d * sc`` has up to 17 significant bits: a relative
    rounding of at most 2^-11 of the scale and of the minimum).

    In a ``file`` model the file's Q6_K tensors (a Q4_K_M file's LM head, half of its value and down projections: the
    file spent more bits on them) become q6 matrices of their own codes, d and sub-scales
    (:meth:`~speculant.core.quant.QuantMatrix.q6`, 7 bits per weight): exactly the file's values. Its other 5- to
    8-bit tensors without per-32 blocks (Q5_K: :data:`speculant.models.gguf.WIDE_TYPES`) become q8 matrices
    requantized from their values (8-bit codes per 32 inputs: within 1/510 of a group's range of the file's value,
    where 4 bits would be 1/30). ``wide_bits`` 8 or 7 requantizes the Q6_K tensors that way too (7: 7-bit codes,
    within 1/254, which an AVX2 CPU without VNNI multiplies faster, :func:`speculant.core.kernels.q4_seven`, at a
    cost in fidelity to the float32 file, docs/results/): benchmarks' choices, not defaults.
    Every other matrix (F16/F32 tensors, fewer-bit types, any wider tensor for int4 and q4, or any tensor for int8)
    is requantized to the kind from its values.

    ``undecoded``: parameters the loader left undecoded (:func:`speculant.models.gguf.coded_weights`), each of which
    must take the file's codes here; a RuntimeError if one would be requantized from its (absent) values."""
    from ..core.quant import ATTR, HOLDS, QuantMatrix, attach, quantization_of, quantize_model, quantized_linears, \
        releasable

    if wide_bits not in (6, 7, 8):
        raise ValueError(f"wide_bits must be 6, 7 or 8, got {wide_bits!r}")
    built = 0
    if gguf_file is not None and quantization in CODED and quantization_of(model) == "none":
        from .gguf import WIDE_TYPES, file_tensors

        targets = {id(m.weight): m for m in quantized_linears(model)}
        params = dict(model.named_parameters())
        free = releasable(model, quantized_linears(model))
        six = wide_bits == 6 and "q6" in HOLDS[quantization]  # Q6_K kept as q6 (its codes wanted)
        for name, qtype, codes, scale, minimum in file_tensors(gguf_file, model, six=six):
            module = targets.get(id(params[name]))
            if module is None:  # e.g. a Q4_K token embedding under an untied head: not a quantized linear
                continue
            kind, coded = code_kind(qtype, quantization, six=six)
            dtype = module.weight.dtype
            if codes is not None and coded:  # Q6_K: codes, d and sub-scales; the others: codes, scale and minimum
                matrix = (QuantMatrix.q6(codes, scale, minimum, dtype) if kind == "q6"
                          else QuantMatrix.from_codes(codes, scale, minimum, dtype, kind))
                built += 1
            elif name in undecoded:
                raise RuntimeError(f"{name} was left undecoded but is not taken as codes")
            elif qtype in WIDE_TYPES and kind == "q8":  # a wide type without per-32 blocks (Q6_K in q8): from its values
                matrix = QuantMatrix.quantize(module.weight, kind, code_bits=7 if wide_bits == 7 else 8)
            else:
                continue  # requantized with the rest below
            attach(module, matrix, release_weight=id(module) in free)
    left = [n for n, p in model.named_parameters() if n in undecoded and p.device.type != "meta"
            and not any(getattr(m, ATTR, None) is not None and m.weight is p for m in quantized_linears(model))]
    if left:
        raise RuntimeError(f"{left[0]} was left undecoded but took no matrix from the file's codes")
    quantize_model(model, quantization)
    if built:
        from ..core.llama_forward import fused_groups
        from ..core.quant import unify_fused

        unify_fused(fused_groups(model))  # the model's own forward and the fused lean one: the same matrices
        log.info("%d of the model's matrices quantized to %s from %s's own codes", built, quantization,
                 Path(gguf_file).name)
    return built


@normal_tensors
def load_model_dir(path: str | Path, dtype: torch.dtype | str | None = None, quantization: str | None = None):
    """Load a causal LM and its tokenizer from a local directory, with no network access.

    Args:
        path: a directory written by ``save_pretrained`` (model and tokenizer).
        dtype: a ``torch.dtype``, one of ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``, or ``None``
            for transformers' default (float32 for the bundled models, see :func:`load_pretrained`).
        quantization: one of :data:`speculant.core.quant.QUANTIZATIONS` (None: ``"none"``): the model is
            quantized in place after loading (:func:`quantize_loaded`), except a GGUF-backed one, which is built
            quantized: it keeps the file's own codes where the kind holds them, never decodes those tensors, and in
            q4, file and q8 caches its matrices for the next load (:mod:`speculant.models.matrix_cache`).

    Returns:
        ``(model, tokenizer)``, the model in eval mode. A vision-language model (a config with a vision part) comes
        back as its text part (:func:`speculant.models.vlm.text_view`; the whole model and its processor ride along
        for image prompts: :func:`speculant.models.vlm.vision_parts`).

    Raises:
        ValueError: the directory does not exist or lacks config.json, weights or tokenizer files (one line,
            naming the directory and the missing files), or ``dtype`` or ``quantization`` is unknown, or the
            model cannot take the kind (int4/q4: input sizes that are multiples of 32).
    """
    quantization = check_quantization(quantization)
    d = check_model_dir(path)
    kwargs = {}
    if dtype is None and any(d.resolve() == (ASSETS / sub).resolve() for sub in BUNDLED.values()):
        dtype = torch.float32  # bundled models: exactness (target) and speed (draft) first, see load_pretrained
    resolved = _resolve_dtype(dtype)
    if resolved is not None:
        kwargs["dtype"] = resolved
    log.info("loading model and tokenizer from %s", d)
    backing = gguf_backing(d)
    if backing is not None:  # the GGUF's tensors, dequantized as transformers' float32 conversion would be
        model = _load_gguf_quantized(d, backing, resolved if isinstance(resolved, torch.dtype) else torch.float32,
                                     quantization)
    elif is_vision_language(AutoConfig.from_pretrained(str(d), local_files_only=True)):
        # a vision-language model: its text part runs as the target, the whole model builds image prompts
        from transformers import AutoModelForImageTextToText, AutoProcessor

        vlm = AutoModelForImageTextToText.from_pretrained(str(d), local_files_only=True, **kwargs).eval()
        processor = AutoProcessor.from_pretrained(str(d), local_files_only=True)
        model = text_view(vlm)
        model.__dict__["processor"] = processor
        quantize_loaded(model, quantization, None)
        return model, processor.tokenizer
    else:
        model = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, **kwargs)
        _keep_tied(model)
    tokenizer = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    model.eval()
    if backing is None:  # (a GGUF-backed model came quantized)
        quantize_loaded(model, quantization, None)
    return model, tokenizer


def _load_gguf_quantized(d: Path, backing: Path, dtype: torch.dtype, quantization: str) -> torch.nn.Module:
    """The model of directory ``d``, whose weights GGUF file ``backing`` holds, in ``dtype`` and ``quantization``:
    its matrices read from the directory's matrix cache when it has them (their tensors left undecoded), else built
    from the file (:func:`quantize_loaded`) and cached for the next load (:mod:`speculant.models.matrix_cache`)."""
    from . import matrix_cache

    config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    path = matrix_cache.cache_file(d, quantization, dtype)
    cached = matrix_cache.read_cache(path, quantization, dtype, backing)
    if cached is not None:
        model = load_gguf_model(backing, config, dtype, skip=cached.undecoded)
        if matrix_cache.load_matrices(model, cached, quantization):
            log.info("%s: quantized matrices read from %s", d.name, path.name)
            return model.eval()
        del model  # a cache that does not fit: its undecoded tensors are needed after all
    # the tensors quantize_loaded takes as codes are never decoded (their float values would only be dropped)
    undecoded = coded_weights(backing, config, quantization)
    model = load_gguf_model(backing, config, dtype, skip=undecoded)
    quantize_loaded(model, quantization, backing, undecoded=undecoded)
    if path is not None:
        matrix_cache.save_matrices(model.eval(), path, quantization, dtype, backing)
    return model


def load_tokenizer(path: str | Path):
    """The tokenizer of a local model directory (no network)."""
    return AutoTokenizer.from_pretrained(str(check_model_dir(path)), local_files_only=True)


def tokenizers_match(tok_a, tok_b) -> bool:
    """True when both tokenizers map exactly the same strings to the same ids (added tokens included), the
    condition for a draft model to propose token ids the target reads as the same tokens."""
    if tok_a is tok_b:
        return True
    return tok_a.get_vocab() == tok_b.get_vocab()


BUNDLED = {
    "default-target": "default-target",
    "default-draft": "default-draft",
    "smollm2-135m-instruct-draft": "smollm2-135m-instruct-draft",
    "qwen2.5-coder-1.5b-instruct-eagle3": "qwen2.5-coder-1.5b-instruct-eagle3",  # once trained and shipped
    "qwen2.5-coder-1.5b-instruct-confu": "qwen2.5-coder-1.5b-instruct-confu",  # once trained and shipped
}
"""Names of the models shipped inside the package (directories under ``speculant/assets``)."""


def _keep_tied(model: torch.nn.Module) -> None:
    """Tie the head to the input embedding when the config says so and loading left them apart. A checkpoint of a
    tied model holds no ``lm_head.weight``; transformers ties it while loading, but it has been seen to report the
    head MISSING and "newly initialized" instead (a random head, silently changing every output), so the loader
    checks."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if (getattr(text, "tie_word_embeddings", False) and head is not None and embed is not None
            and head.weight is not embed.weight):
        model.tie_weights()
        if head.weight is not embed.weight:  # transformers' own tying left them apart too: tie them here
            log.warning("%s: the head was not tied to the input embedding after loading; tied now",
                        type(model).__name__)
            head.weight = embed.weight


def bundled_dir(name: str) -> Path | None:
    """The directory of bundled model ``name`` if the package ships it, else None."""
    sub = BUNDLED.get(name)
    if sub is None:
        return None
    d = ASSETS / sub
    return d if (d / "config.json").is_file() else None


def resolve_model(name_or_path: str | Path) -> Path:
    """The local model directory for a model name or path, converting or locating it as needed (no network).

    Accepted, in this order: a bundled name (``default-target``, ``default-draft``, the bundled drafters), a
    packaged model name (:data:`speculant.models.sources.PACKAGED`, e.g. ``smollm2-135m-instruct``: its GGUF file is
    converted once into the cache), an existing directory, a ``.gguf`` file (converted once), a Hugging Face
    Hub id found in the local Hugging Face cache. Anything else is a one-line ValueError that says what was
    tried and how to get the model."""
    key = str(name_or_path)
    if key in BUNDLED:
        d = bundled_dir(key)
        if d is None:
            raise ValueError(
                f"bundled model {key!r} is not installed: {ASSETS / BUNDLED[key]} is missing "
                "(reinstall speculant, or pass a model directory)"
            )
        return d
    if key in PACKAGED:
        return install_files(PACKAGED[key], convert_gguf(packaged_gguf(key), key))
    path = Path(key).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path)
    if path.exists():
        return path
    if key.lower().endswith(".gguf"):
        raise ValueError(f"GGUF file {key!r} does not exist")
    if is_hub_id(key):
        return hub_cached_dir(key)
    raise ValueError(
        f"model directory {key!r} does not exist, and it is not a .gguf file, a bundled name ({', '.join(BUNDLED)}) or a packaged "
        f"model ({', '.join(PACKAGED)})"
    )


@normal_tensors
def load_pretrained(name_or_path: str | Path, dtype: torch.dtype | str | None = None,
                    quantization: str | None = None):
    """Load a bundled model by name (``"default-target"``, ``"default-draft"``) or a local model directory.

    Bundled models are stored in bfloat16 and load in float32 unless ``dtype`` says otherwise. The target: in
    bf16 a batched verification forward and a one-token forward can round a near-tie differently, so greedy
    output could differ from plain decoding in rare tokens; in float32 such flips need a tie within ~1e-6. The
    draft: its numerics only change what is proposed, never what is emitted, and on CPUs float32 is faster than
    bf16 for its small matrices.

    ``quantization``: see :func:`load_model_dir` (None: none).

    Returns ``(model, tokenizer)``, the model in eval mode. Raises a one-line ValueError for an unknown name,
    a bundled model missing from this installation, or a directory with missing files. Nothing is downloaded.
    """
    return load_model_dir(resolve_model(name_or_path), dtype, quantization)


def default_draft_for(target: str | Path, method: str | None = None) -> str | None:
    """The name of the drafter speculant ships for ``target`` (a bundled or packaged model name, or the
    directory one resolves to), or None when it ships none. A packaged model's default draft is a bundled drafter
    directory or another packaged model (:attr:`speculant.models.sources.PackagedModel.default_draft`), named only
    when it is there (bundled, or its packages installed). ``method``: a method that needs its own kind of
    drafter (:attr:`~speculant.models.sources.PackagedModel.method_drafts`, e.g. ``eagle3``) gets that one, or
    None when it is not shipped."""
    key = str(target)
    model = PACKAGED.get(key)
    own = dict(model.method_drafts) if model is not None else {}
    if method is not None and method in own:
        return own[method] if bundled_dir(own[method]) is not None else None
    if key == "default-target" or (bundled_dir("default-target") is not None
                                   and Path(key).expanduser().resolve() == bundled_dir("default-target").resolve()):
        return "default-draft" if bundled_dir("default-draft") is not None else None
    model = PACKAGED.get(key)
    if model is None or not model.default_draft:
        return None
    if bundled_dir(model.default_draft) is not None or packaged_installed(model.default_draft):
        return model.default_draft  # a drafter shipped with speculant, or another (installed) packaged model
    return None


def default_quantization_for(target: str | Path) -> str | None:
    """The weight quantization a packaged ``target`` (by name) loads in when none is asked for
    (:attr:`speculant.models.sources.PackagedModel.default_quantization`), else None."""
    model = PACKAGED.get(str(target))
    return None if model is None else model.default_quantization


def default_method_for(target: str | Path, draft: str | Path | None = None) -> str | None:
    """The method spec measured fastest for a packaged ``target`` with the drafter speculant ships for it
    (:attr:`speculant.models.sources.PackagedModel.default_method`), when ``draft`` is None or that drafter (by
    name or directory); else None, and callers use :data:`speculant.drafters.registry.DEFAULT_METHOD`."""
    model = PACKAGED.get(str(target))
    shipped = default_draft_for(target)
    if model is None or model.default_method is None or shipped is None:
        return None
    if draft is None or str(draft) == shipped:
        return model.default_method
    shipped_dir = bundled_dir(shipped)
    if shipped_dir is not None and Path(draft).expanduser().resolve() == shipped_dir.resolve():
        return model.default_method
    return None


def draft_context(draft: str | Path, target_tokenizer) -> dict:
    """The drafter-building context for draft model ``draft`` (a name or directory) next to a target with
    ``target_tokenizer``: ``{"tokenizers_match": bool}``, plus both tokenizers (``draft_tokenizer``,
    ``target_tokenizer``) when they differ (what a cross-vocabulary drafter needs). An attached drafter reads the
    target's ids by construction; an ordinary draft's tokenizer is loaded and compared (:func:`tokenizers_match`)."""
    d = resolve_model(draft)
    if is_attached(d):
        return {"tokenizers_match": True}
    draft_tokenizer = load_tokenizer(d)
    if tokenizers_match(target_tokenizer, draft_tokenizer):
        return {"tokenizers_match": True}
    # another vocabulary: only a cross-vocabulary method can draft with it, and it needs both tokenizers
    return {"tokenizers_match": False, "draft_tokenizer": draft_tokenizer, "target_tokenizer": target_tokenizer}


@normal_tensors
def load_draft(name_or_path: str | Path, target: torch.nn.Module, dtype: torch.dtype | str | None = None,
               quantization: str | None = None):
    """Load a draft model for ``target``: an attached drafter (:mod:`speculant.models.attached`, sharing the target's
    embedding and LM head, loaded in the target's dtype) or an ordinary model directory / name (in ``dtype``),
    quantized to ``quantization`` (see :func:`load_model_dir`; None: none). An attached drafter's own layers are
    quantized and its shared head stays the target's, so its kind must be the target's (None: the target's; else
    a ValueError). Its embedding check compares with the float embedding it was made for, which a target with a
    tied, quantized head no longer has: load it next to the float target, then quantize both
    (:func:`speculant.session.load_plan` does).

    Returns the draft model (eval mode). The caller checks that an ordinary draft's tokenizer matches the
    target's (:func:`tokenizers_match`); an attached drafter uses the target's tokenizer by construction."""
    from ..core.quant import quantization_of, quantize_model

    d = check_model_dir(resolve_model(name_or_path))
    quantization = quantization_of(target) if quantization is None and is_attached(d) else check_quantization(
        quantization)
    if is_attached(d):
        if quantization != quantization_of(target):
            raise ValueError(f"attached drafter {str(d)!r} shares the target's head: its quantization must be the "
                             f"target's ({quantization_of(target)}), got {quantization}")
        return quantize_model(load_attached(d, target), quantization)
    model, _ = load_model_dir(d, dtype, quantization)
    return model
