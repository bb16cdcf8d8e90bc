"""Input validation with one-line, specific errors (ValueError), shared by the API and the CLI, and the
once-per-process warnings for settings that have no effect."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "as_id_list",
    "check_logprobs",
    "check_stream",
    "check_positive_int",
    "check_token_ids",
    "resolve_device",
    "warn_once",
    "context_length",
    "sliding_window",
    "check_fits_context",
    "resolve_eos",
    "vocab_size",
    "check_vocab_compatible",
    "num_layers",
]


def _is_token_id(t) -> bool:
    """An integer token id: a Python int or a numpy integer (``numbers.Integral``), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def as_id_list(input_ids) -> list[int]:
    """One prompt's token ids as a list of ints, from whatever form a caller holds them in.

    Accepted: a list (or tuple) of ints, a 1-D or ``[1, T]`` torch tensor or numpy array of integers, a nested
    list ``[[...]]`` of one sequence, or a tokenizer's output (a ``BatchEncoding`` or any mapping with an
    ``input_ids`` entry in one of those forms). A batch of several sequences, an empty prompt or non-integer
    ids are a one-line ValueError naming ``input_ids``.
    """
    if isinstance(input_ids, Mapping):  # BatchEncoding is a UserDict: tokenizer(text) straight in
        if "input_ids" not in input_ids:
            raise ValueError(f"input_ids: a mapping was given without an 'input_ids' entry (keys: "
                             f"{', '.join(map(str, list(input_ids)[:5]))})")
        input_ids = input_ids["input_ids"]
    if isinstance(input_ids, np.ndarray):
        if input_ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must hold integer token ids, got a numpy array of dtype {input_ids.dtype}")
        input_ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64))
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids: batch size {input_ids.shape[0]} is not supported yet by this entry "
                                 "point: pass one prompt ([1, T] or 1-D)")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D or [1, T], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        ids = [int(t) for t in input_ids.tolist()]
    elif isinstance(input_ids, Iterable) and not isinstance(input_ids, (str, bytes, Mapping)):
        ids = list(input_ids)
        if ids and not _is_token_id(ids[0]) and isinstance(ids[0], (Sequence, np.ndarray, torch.Tensor)) \
                and not isinstance(ids[0], (str, bytes)):
            if len(ids) != 1:
                raise ValueError(f"input_ids: batch size {len(ids)} is not supported yet by this entry point: pass "
                                 "one prompt")
            return as_id_list(ids[0])
        if not all(_is_token_id(t) for t in ids):
            bad = next(t for t in ids if not _is_token_id(t))
            raise ValueError(f"input_ids must be a list of integer token ids, got an element {bad!r:.40}")
        ids = [int(t) for t in ids]
    else:
        raise ValueError(f"input_ids must be a list of ints, a 1-D tensor or array of ints or a tokenizer's output, "
                         f"got {type(input_ids).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    return ids


def check_stream(stream) -> None:
    """``stream`` must be callable or None (a one-line ValueError naming it, not a TypeError from the loop)."""
    if stream is not None and not callable(stream):
        raise ValueError(f"stream must be a callable (called with each step's new token ids) or None, got "
                         f"{type(stream).__name__}")


def check_logprobs(logprobs) -> int | None:
    """``logprobs`` must be None (off) or an integer >= 0 (the number of top alternatives per token)."""
    if logprobs is None:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
        raise ValueError(f"logprobs must be None (off) or an integer >= 0 (top alternatives per token), got "
                         f"{logprobs!r:.40}")
    return logprobs


def check_positive_int(name: str, value) -> int:
    """``value`` if it is an int >= 1, else a one-line ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def context_length(model: torch.nn.Module) -> int | None:
    """The model's maximum number of positions, or None when its config states none."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


def sliding_window(cfg) -> int | None:
    """The sliding window of a model config when any layer uses one, else None."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_fits_context(model: torch.nn.Module, prompt_len: int, max_new_tokens: int, role: str = "target") -> None:
    """Prompt plus new tokens must fit the model's context (and its sliding window, not supported past it)."""
    total = prompt_len + max_new_tokens
    ctx = context_length(model)
    if ctx is not None and total > ctx:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the {role} "
            f"model's context of {ctx} tokens"
        )
    window = sliding_window(model.config.get_text_config() if hasattr(model.config, "get_text_config")
                            else model.config)
    if window is not None and total > window:
        raise ValueError(
            f"{total} tokens exceed the {role} model's sliding window of {window}: sliding-window attention "
            "beyond the window is not supported yet"
        )


def resolve_eos(model: torch.nn.Module, eos_token_id) -> frozenset[int]:
    """The set of stop tokens: the given id(s), else the model's generation config, else none."""
    if eos_token_id is None:
        gen_cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if _is_token_id(eos_token_id):
        return frozenset([int(eos_token_id)])
    if isinstance(eos_token_id, Iterable) and not isinstance(eos_token_id, (str, bytes)):
        ids = list(eos_token_id.tolist() if isinstance(eos_token_id, (torch.Tensor, np.ndarray)) else eos_token_id)
        if all(_is_token_id(t) for t in ids):
            return frozenset(int(t) for t in ids)
    raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output layer (the size of its logits)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None and hasattr(out, "weight"):
        return int(out.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


# Padded embedding matrices (Qwen pads 151,665 tokens to 151,936 or 152,064 rows) differ by a few hundred
# rows; different tokenizers differ by far more. Without tokenizers to compare, this is the tolerance.
_PADDING_TOLERANCE = 0.01


def check_vocab_compatible(target_vocab: int, draft_vocab: int, tokenizers_match: bool | None = None) -> int:
    """Return the number of token ids both models share (ids below it are the same tokens).

    ``tokenizers_match`` is the result of comparing the two tokenizers when they are known (the CLI does);
    otherwise sizes that differ by more than padding are taken to be different vocabularies.
    """
    if tokenizers_match is False:
        raise ValueError("draft and target tokenizers differ: speculative decoding needs the same vocabulary")
    if target_vocab != draft_vocab and tokenizers_match is None:
        gap = abs(target_vocab - draft_vocab) / max(target_vocab, draft_vocab)
        if gap > _PADDING_TOLERANCE:
            raise ValueError(
                f"draft vocabulary ({draft_vocab} tokens) does not match the target's ({target_vocab}): "
                "speculative decoding needs models that share a tokenizer"
            )
    return min(target_vocab, draft_vocab)


def num_layers(model: torch.nn.Module) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.num_hidden_layers)


def check_token_ids(ids: Iterable[int], vocab: int, what: str = "input_ids", role: str = "target") -> None:
    """Every id must be a token of the model: in ``[0, vocab)``; else a ValueError naming the first offending id
    (an out-of-range id would otherwise end in a bare IndexError inside the embedding)."""
    for t in ids:
        if not 0 <= t < vocab:
            raise ValueError(
                f"{what}: token id {t} is outside the {role} model's vocabulary of {vocab} tokens (ids 0..{vocab - 1})"
            )


def _no_device(text: str, why: str) -> ValueError:
    return ValueError(f"device {text!r} is not available: {why} (torch {torch.__version__})")


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The torch device for ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``...), checked usable here.

    ``None`` or ``"auto"``: the best available one, CUDA if torch sees a GPU, else Apple's MPS, else the CPU.
    Raises a one-line ValueError for a string torch does not parse and for a device this torch build or machine
    cannot use (a CPU-only build asked for ``cuda``, a GPU index past the last one...), before any work is done.
    """
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    text = str(device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {text!r}: expected auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise _no_device(text, "this torch build has no CUDA support")
        if not torch.cuda.is_available():
            raise _no_device(text, "torch finds no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES)")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise _no_device(text, f"{count} CUDA GPU(s) visible, cuda:0 to cuda:{count - 1}")
        return dev
    if dev.type == "mps":
        if not torch.backends.mps.is_built():
            raise _no_device(text, "this torch build has no MPS support")
        if not torch.backends.mps.is_available():
            raise _no_device(text, "MPS needs Apple silicon and macOS 12.3 or later")
        return dev
    backend = getattr(torch, dev.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise _no_device(text, f"torch has no usable {dev.type} backend here")
    return dev


_WARNED: set[str] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    """Log ``message`` as a warning the first time it comes up in this process (a setting with no effect is
    reported once, not on every generation of a benchmark)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
