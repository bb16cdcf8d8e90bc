"""The training corpus: the running interpreter's standard-library sources and the pydoc topics.

The test suite (``test``/``tests``/``idle_test`` directories) and third-party ``site-packages`` are left out.
Documents are split into train / validation / test deterministically BY MODULE: the top-level module or package
name is hashed, so a held-out module never contributes a single line to training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Document", "stdlib_root", "split_of", "load_corpus", "SPLITS"]

SPLITS = ("train", "validation", "test")
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# Fractions of top-level modules held out; sized so both held-out sets have a few hundred KB of code.
_HELD_OUT = {"validation": 0.05, "test": 0.05}


@dataclass(frozen=True)
class Document:
    """One source file (or pydoc topic): ``module`` is its dotted name, ``top`` the top-level module."""

    module: str
    top: str
    text: str
    split: str


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(top_level: str) -> str:
    """Deterministic split of a top-level module name (stable across machines and Python versions)."""
    h = int.from_bytes(hashlib.sha256(top_level.encode()).digest()[:8], "big") / 2**64
    if h < _HELD_OUT["validation"]:
        return "validation"
    if h < _HELD_OUT["validation"] + _HELD_OUT["test"]:
        return "test"
    return "train"


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def load_corpus(root: Path | None = None, include_topics: bool = True) -> list[Document]:
    """All documents, sorted by module name (deterministic order)."""
    root = root or stdlib_root()
    docs: list[Document] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        module = _module_name(rel)
        top = module.split(".")[0]
        docs.append(Document(module=module, top=top, text=text, split=split_of(top)))
    if include_topics:
        try:
            from pydoc_data.topics import topics
        except ImportError:  # some distributions strip pydoc_data
            topics = {}
        for name in sorted(topics):
            top = f"pydoc:{name}"
            docs.append(Document(module=top, top=top, text=topics[name], split=split_of(top)))
    return docs
