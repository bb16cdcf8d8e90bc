"""VocabTrim calibration: count token frequencies on a calibration split and store them with a drafter.

The best calibration text is what the target itself generates (Goel et al. 2025), i.e. the ``distill`` split of
:mod:`.bundled.distill_data`. The result is ``vocab_trim.json`` in the draft model's directory (read by
:mod:`speculant.drafters.vocab_trim`): every token id seen, most frequent first, the coverage of the top-N for a
few N, and optionally a recommended ``default_size`` that drafters use unless told otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..drafters.vocab_trim import CALIBRATION_FILE
from .bundled.data import load_split

__all__ = ["token_ranking", "write_calibration", "write_calibration_tokens"]


def token_ranking(tokens: np.ndarray, vocab: int) -> tuple[list[int], np.ndarray]:
    """Token ids seen in ``tokens`` ``[T]``, most frequent first (ties: lower id first), and the counts ``[V]``."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)[:vocab]
    order = np.lexsort((np.arange(vocab), -counts))  # by count descending, then id
    return [int(i) for i in order if counts[i] > 0], counts


def write_calibration(model_dir: str | Path, data: str | Path, split: str = "distill",
                      default_size: int | None = None, default_size_sampling: int | None = None) -> Path:
    """Write ``vocab_trim.json`` for the model in ``model_dir`` from the ``split`` stream of ``data``.

    ``default_size`` is the kept-token count drafters use by default, ``default_size_sampling`` the one they use
    when sampling (None: the same; 0: the full head)."""
    return write_calibration_tokens(model_dir, load_split(data, split), split, default_size, default_size_sampling)


def write_calibration_tokens(model_dir: str | Path, tokens: np.ndarray, source: str,
                             default_size: int | None = None, default_size_sampling: int | None = None) -> Path:
    """Write ``vocab_trim.json`` for the model in ``model_dir`` from the calibration tokens ``[T]`` (``source``
    names where they come from); the sizes as in :func:`write_calibration`."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    ranking, counts = token_ranking(tokens, vocab)
    total = int(counts.sum())
    coverage = {}
    for n in (512, 1024, 2048, 4096, 8192):
        if n < vocab:
            coverage[str(n)] = round(float(counts[ranking[:n]].sum()) / total, 5)
    if default_size is not None and not 0 < default_size <= len(ranking):
        raise ValueError(f"default_size must be between 1 and the {len(ranking)} tokens seen, got {default_size}")
    if default_size_sampling is not None and not 0 <= default_size_sampling <= len(ranking):
        raise ValueError(f"default_size_sampling must be between 0 (the full head) and the {len(ranking)} tokens "
                         f"seen, got {default_size_sampling}")
    sampling = {} if default_size_sampling is None else {"default_size_sampling": default_size_sampling}
    out = model_dir / CALIBRATION_FILE
    out.write_text(json.dumps({
        "method": "VocabTrim (Goel et al. 2025): token ids by frequency on the calibration split",
        "calibration": {"split": source, "tokens": total, "distinct": len(ranking)},
        "coverage": coverage,
        "default_size": default_size,
        **sampling,
        "token_ids": ranking,
    }))
    return out
