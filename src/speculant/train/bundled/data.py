"""Prepare the training data once: train the tokenizer on the train split, tokenise every split.

Writes to a directory: the tokenizer (``AutoTokenizer``-loadable), ``{split}.npy`` token streams (uint16,
documents separated by ``<|endoftext|>``), and ``splits.json`` listing the modules of each split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ...data.corpus import SPLITS, load_corpus
from .tokenizer import save_tokenizer, train_tokenizer

__all__ = ["prepare", "load_split"]


def prepare(out: str | Path, vocab_size: int = 16384, progress: bool = True) -> Path:
    """Build the data directory ``out`` (idempotent: an existing complete directory is reused)."""
    out = Path(out)
    if (out / "splits.json").exists() and all((out / f"{s}.npy").exists() for s in SPLITS):
        return out
    out.mkdir(parents=True, exist_ok=True)
    docs = load_corpus()
    tokenizer = train_tokenizer((d.text for d in docs if d.split == "train"), vocab_size=vocab_size)
    save_tokenizer(tokenizer, out)
    eos = tokenizer.eos_token_id
    listing: dict[str, dict] = {}
    for split in SPLITS:
        part = [d for d in docs if d.split == split]
        stream: list[int] = []
        for d in tqdm(part, desc=f"tokenise {split}", disable=not progress, unit="doc"):
            stream.extend(tokenizer(d.text, add_special_tokens=False).input_ids)
            stream.append(eos)
        np.save(out / f"{split}.npy", np.asarray(stream, dtype=np.uint16))
        listing[split] = {
            "documents": len(part),
            "tokens": len(stream),
            "modules": sorted({d.top for d in part}),
        }
    (out / "splits.json").write_text(json.dumps(listing, indent=1))
    return out


def load_split(data_dir: str | Path, split: str) -> np.ndarray:
    """The token stream of one split ``[T]`` (uint16)."""
    path = Path(data_dir) / f"{split}.npy"
    if not path.exists():
        raise ValueError(f"{path} is missing: run `speculant train prepare --out {data_dir}` first")
    return np.load(path, mmap_mode="r")
