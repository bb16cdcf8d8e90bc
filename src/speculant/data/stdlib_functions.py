"""Functions of the held-out standard-library modules, and a stratified pick of records: what the built-in code
sets (:mod:`speculant.data.prompts`, :mod:`speculant.data.code_chat`) are made from.

The modules are those of one split of the corpus (:mod:`speculant.data.corpus`), parsed with ``ast`` in corpus
order (sorted by module), so every set built from them is deterministic for one interpreter.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator

from .corpus import Document, load_corpus

__all__ = ["FUNCTIONS", "split_docs", "split_functions", "stratified", "top_module"]

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
"""The ``ast`` node types of a function definition."""


def split_docs(split: str) -> tuple[Document, ...]:
    """The corpus documents of ``split``. The small held-out splits are read once per process (the stdlib scan
    takes seconds); the train split (most of the stdlib) is not kept in memory."""
    if split == "train":
        return _read_split(split)
    return _cached_split(split)


def _read_split(split: str) -> tuple[Document, ...]:
    return tuple(doc for doc in load_corpus(include_topics=False) if doc.split == split)


_cached_split = functools.lru_cache(maxsize=4)(_read_split)


def split_functions(split: str) -> Iterator[tuple[Document, list[str], ast.FunctionDef, ast.Module]]:
    """``(doc, source lines, function node, module tree)`` for every function in the ``split`` modules, in corpus
    order (``ast.walk`` order within a module: top-level definitions before methods)."""
    for doc in split_docs(split):
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        lines = doc.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, FUNCTIONS):
                yield doc, lines, node, tree


def top_module(row: dict) -> str:
    """The top-level module of a record whose ``id`` starts with its dotted module name."""
    return row["id"].split(".")[0]


def stratified(rows: list[dict], n: int, group: Callable[[dict], str]) -> list[dict]:
    """``n`` of ``rows``, round-robin over the groups ``group(row)`` names (sorted, so no big group dominates), a
    fixed permutation of each group's rows (in their given order) within it."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(group(row), []).append(row)
    picked: list[dict] = []
    rank = 0
    while len(picked) < n and any(len(g) > rank for g in groups.values()):
        for top in sorted(groups):
            g = groups[top]
            if len(picked) < n and rank < len(g):
                picked.append(g[(rank * 7919) % len(g)])  # 7919 is prime: a permutation of the group
        rank += 1
    return picked
