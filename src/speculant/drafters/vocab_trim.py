"""VocabTrim (Goel et al. 2025, "VocabTrim: Vocabulary Pruning for Efficient Speculative Decoding in LLMs").

A drafter's LM head restricted to the ``M`` tokens the target uses most (counted on a calibration set, best text
the target generated). The draft computes ``h · W[keep]ᵀ`` instead of ``h · Wᵀ`` — for a small drafter with a
large vocabulary the head is most of a draft forward — drafts in the trimmed index space and maps back with the
index table. Lifted to the full vocabulary, the draft distribution is 0 outside the kept set, so the one
verifier is unchanged and decoding stays lossless; the price is a lower τ when the target wants a token the
drafter cannot propose.

Calibration files (``vocab_trim.json`` in a draft model's directory, written by ``speculant train calibrate``)
list token ids from most to least frequent, and may recommend a ``default_size`` that drafters use unless told
otherwise.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from ..core.packed import PackedMatrix, linear, pack_enabled
from ..core.quant import ATTR

__all__ = ["CALIBRATION_FILE", "TrimmedHead", "load_calibration", "resolve_keep_ids", "trimmed_head"]

CALIBRATION_FILE = "vocab_trim.json"


def load_calibration(model_dir: str | Path | None) -> dict | None:
    """The calibration of the model in ``model_dir`` (``{"token_ids": [...], "default_size": N, ...}``) or None."""
    if not model_dir:
        return None
    path = Path(model_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data.get("token_ids"), list) or not data["token_ids"]:
        raise ValueError(f"{path} has no token_ids list")
    return data


def resolve_keep_ids(model: torch.nn.Module, vocab_trim: int | Sequence[int] | None, vocab: int,
                     sampling: bool = False) -> list[int] | None:
    """The kept token ids for ``vocab_trim``; None means the full head.

    ``None``: the model's recommended size if its directory ships a calibration with one, else the full head.
    The calibration may recommend a larger ``default_size_sampling`` for ``sampling`` (temperature > 0): greedy
    acceptance only needs the target's argmax in the kept set, sampled acceptance ``sum(min(p, q))`` loses the
    target's whole mass outside it. ``0``: the full head. ``N > 0``: the N most frequent tokens of the model's
    calibration (an error if it has none). A sequence: exactly those ids.
    """
    model_dir = _model_dir(model)
    if vocab_trim is None:
        calibration = load_calibration(model_dir) or {}
        size = calibration.get("default_size")
        if sampling and "default_size_sampling" in calibration:
            size = calibration["default_size_sampling"]  # null / 0: the full head
        if not size or size >= vocab:
            return None
        ids = calibration["token_ids"][: int(size)]
    elif isinstance(vocab_trim, int):
        if vocab_trim < 0:
            raise ValueError(f"vocab_trim must be >= 0 (0 = the full LM head), got {vocab_trim}")
        if vocab_trim == 0 or vocab_trim >= vocab:
            return None
        calibration = load_calibration(model_dir)
        if calibration is None:
            raise ValueError(
                f"vocab_trim={vocab_trim} needs the draft's token frequencies ({CALIBRATION_FILE} in its model "
                f"directory, {model_dir!r}): write them with `speculant train calibrate --model DIR --data DIR`, "
                "or pass the kept token ids"
            )
        ids = calibration["token_ids"][:vocab_trim]
    else:
        ids = [int(i) for i in vocab_trim]
    if not ids:
        raise ValueError("vocab_trim keeps no tokens")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"vocab_trim ids must be distinct token ids below the vocabulary size {vocab}")
    return ids


class TrimmedHead:
    """``logits = h · W[keep]ᵀ (+ b[keep])``: the rows of an LM head for the kept tokens only.

    Args:
        lm_head: the drafter's output layer (``model.get_output_embeddings()``), weight ``[V, H]``.
        keep: kept token ids of the full vocabulary ``[M]``.
    """

    def __init__(self, lm_head: torch.nn.Module, keep: Sequence[int]) -> None:
        weight = lm_head.weight  # [V, H] (a meta tensor when a quantized head released its float weight)
        quantized = getattr(lm_head, ATTR, None)
        device = quantized.scale.device if quantized is not None else weight.device  # (q4 codes unpack)
        self.keep = torch.tensor(list(keep), dtype=torch.long, device=device)  # [M]
        self.dtype = weight.dtype
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach()[self.keep].contiguous()  # [M]
        self._keep_list = [int(i) for i in keep]
        # a quantized head (speculant.core.quant): its kept rows, same codes; else [M, H] reordered once for the CPU's
        # matmul kernels where allowed (speculant.core.packed): a drafter computes these logits at every draft step
        if quantized is not None:
            self._matrix = quantized.rows(self.keep)
        else:
            rows = weight.detach()[self.keep].contiguous()  # [M, H]
            self._matrix = PackedMatrix(rows) if pack_enabled([rows]) else rows

    @property
    def size(self) -> int:
        return len(self._keep_list)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` hidden states → ``[..., M]`` trimmed logits."""
        return linear(hidden.to(self.dtype), self._matrix, self.bias)

    def token(self, index: int) -> int:
        """The full-vocabulary id of trimmed index ``index``."""
        return self._keep_list[index]

    def lift(self, probs: torch.Tensor, vocab: int) -> torch.Tensor:
        """``[..., M]`` probabilities over the kept tokens → ``[..., vocab]``, zero elsewhere."""
        full = probs.new_zeros((*probs.shape[:-1], vocab))
        return full.index_copy_(-1, self.keep.to(probs.device), probs)


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm_head -> {key: (TrimmedHead | None, quantized)}
_HEADS_PER_MODULE = 4  # settings kept per head, the least recently used dropped first
_HEADS_LOCK = threading.Lock()


def _model_dir(model: torch.nn.Module) -> str | None:
    return getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)


def _calibration_stamp(model_dir: str | None) -> tuple[int, int] | None:
    """The modification time and size of the calibration file in ``model_dir``, or None: a rewritten file is read
    again."""
    if not model_dir:
        return None
    try:
        stat = (Path(model_dir) / CALIBRATION_FILE).stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def trimmed_head(model: torch.nn.Module, vocab_trim: int | Sequence[int] | None, vocab: int,
                 sampling: bool = False) -> TrimmedHead | None:
    """The :class:`TrimmedHead` of ``model``'s LM head for ``vocab_trim`` (see :func:`resolve_keep_ids`; None: the
    full head), built once per head, setting and weights and shared by every drafter over that model: a server makes
    a fresh drafter per request, and building the kept rows of a quantized head unpacks its codes, which for a
    151,936-row head delayed every request's first token and stalled the whole batch it joined."""
    lm_head = model.get_output_embeddings()
    weight, quantized, bias = lm_head.weight, getattr(lm_head, ATTR, None), getattr(lm_head, "bias", None)
    setting = vocab_trim if vocab_trim is None or isinstance(vocab_trim, int) else tuple(int(i) for i in vocab_trim)
    from_file = not isinstance(setting, tuple)  # kept ids read from the model's calibration (see resolve_keep_ids)
    model_dir = _model_dir(model) if from_file else None
    key = (setting, vocab, sampling if setting is None else None, weight.data_ptr(), weight._version, weight.dtype,
           str(weight.device), None if bias is None else bias._version, id(quantized),
           (model_dir, _calibration_stamp(model_dir)) if from_file else None)
    with _HEADS_LOCK:  # drafters may begin on several threads (user code)
        heads = _HEADS.setdefault(lm_head, {})
        entry = heads.pop(key, None)  # re-inserted below: the most recently used last
        if entry is None:
            keep = resolve_keep_ids(model, vocab_trim, vocab, sampling=sampling)
            entry = (None if keep is None else TrimmedHead(lm_head, keep), quantized)  # quantized kept alive: its id
            while len(heads) >= _HEADS_PER_MODULE:                                    # stays unique while cached
                heads.pop(next(iter(heads)))
        heads[key] = entry
    return entry[0]
