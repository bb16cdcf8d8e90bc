"""The target's final hidden states over its own answers: the inputs and regression targets of a feature drafter.

A feature drafter (EAGLE, Li et al. 2024; :mod:`speculant.drafters.feature`) drafts from the target's last hidden
state ``f_t`` (final-normed: what the LM head reads), optionally the outputs of a few earlier layers (EAGLE-3's
low/mid/high fusion, "taps"), and the next token, so its training data needs those states at every position of
every sample. The target is run once over each sample's prompt and answer (all but the answer's last
token: no position after it is ever read) with the lean forward, and the states are stored in bfloat16 next to
the answers, one file per answer shard (``RUN/features/shard-00000.npy``, ``[sum of lengths, H]``, rows in the
shard's sample order), each renamed into place when complete, so an interrupted run resumes at the next shard.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from .answers import AnswerShard, shard_paths

__all__ = ["extract_features", "features_dir", "load_features", "sequence_lengths", "to_bits", "to_tensor"]

log = logging.getLogger(__name__)


def features_dir(run: str | Path, taps: list[int]) -> Path:
    """Where a run keeps the target's states for ``taps``: ``RUN/features`` or ``RUN/features-taps-9-19``."""
    return Path(run) / ("features" if not taps else "features-taps-" + "-".join(str(i) for i in taps))


def sequence_lengths(shard: AnswerShard) -> np.ndarray:
    """``[N]``: rows of features per sample (prompt + answer - 1; 0 for an empty answer)."""
    prompts = np.diff(shard.prompt_offsets)
    answers = np.diff(shard.answer_offsets)
    return np.where(answers > 0, prompts + answers - 1, 0)


@torch.inference_mode()
def _shard_features(target, shard: AnswerShard, taps: list[int]) -> np.ndarray:
    from ...core.cache import SpecCache
    from ...core.checks import num_layers
    from ...core.target_forward import TargetForward

    forward = TargetForward(target, taps=taps)
    device = target.device
    rows = []
    for i in range(len(shard)):
        prompt, answer, _ = shard.sample(i)
        if len(answer) == 0:
            continue
        seq = np.concatenate([prompt, answer[:-1]]).astype(np.int64)
        ids = torch.from_numpy(seq)[None].to(device)  # [1, T]
        cache = SpecCache(num_layers(target), capacity=len(seq) + 8)
        states: list[torch.Tensor] = []
        forward.prefill(cache, ids, hidden_out=states)  # [1, T, F]
        rows.append(to_bits(states[0][0]))
    width = target.config.hidden_size * (len(taps) + 1)
    return np.concatenate(rows) if rows else np.zeros((0, width), dtype=np.int16)


def extract_features(target, answers: str | Path, out: str | Path, taps: list[int] | None = None,
                     progress: bool = True) -> Path:
    """Write ``out/shard-*.npy``: the target's states over every sample of the answer shards in ``answers``
    (resumable: complete shards are skipped): the outputs of the layers ``taps``, then the final-normed hidden
    state, ``[rows, (len(taps) + 1) H]``. Returns ``out``."""
    from tqdm.auto import tqdm

    answers, out = Path(answers), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = shard_paths(answers)
    todo = [p for p in paths if not (out / (p.stem + ".npy")).exists()]
    for path in tqdm(todo, desc="target features", unit="shard", disable=not progress):
        feats = _shard_features(target, AnswerShard.load(path), list(taps or []))
        tmp = out / (path.stem + ".tmp.npy")
        np.save(tmp, feats)
        os.replace(tmp, out / (path.stem + ".npy"))
    return out


def load_features(folder: str | Path, shards: int | list[str | Path]) -> list[np.ndarray]:
    """The feature arrays (int16 views of bfloat16 ``[rows, F]``, memory-mapped) of the answer shards ``shards``
    (their paths or names: ``shard-00007.npz`` pairs with ``shard-00007.npy``), or of the first ``shards`` shards
    (an int)."""
    folder = Path(folder)
    names = [f"shard-{i:05d}" for i in range(shards)] if isinstance(shards, int) else [Path(p).stem for p in shards]
    out = []
    for name in names:
        path = folder / f"{name}.npy"
        if not path.exists():
            raise ValueError(f"missing target features {path}: run the feature stage first")
        out.append(np.load(path, mmap_mode="r"))
    return out


def to_bits(states: torch.Tensor) -> np.ndarray:
    """States ``[..., F]`` as the int16 bits of their bfloat16 values (numpy has no bfloat16), as stored."""
    return states.to(torch.bfloat16).view(torch.int16).cpu().numpy()


def to_tensor(rows: np.ndarray) -> torch.Tensor:
    """int16 bfloat16 bits ``[..., H]`` -> a float32 tensor."""
    return torch.from_numpy(np.array(rows, copy=True)).view(torch.bfloat16).float()  # a copy: rows may be read-only
