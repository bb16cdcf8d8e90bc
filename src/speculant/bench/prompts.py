"""Prompt sets: built-in sets drawn from the held-out (test-split) standard-library modules, and JSONL files.

Built-in sets (``builtin:NAME`` on the command line), extracted with ``ast`` from modules no bundled model was
trained on, deterministically (sorted, stratified by top-level module, evenly spaced picks):

``code``
    a function's signature and docstring; the model writes the body.
``grounded``
    a short function's full source, then a comment asking for the same function again (renamed, or rewritten
    with type hints) and the start of its ``def`` line: the answer copies from the prompt, the regime where
    drafting from the context (prompt lookup) shines. Each record keeps the copied function in ``source``.

A JSONL file has one object per line with a ``prompt`` string; every other field (``id``, ...) is kept. Records
without an ``id`` get their line number.
"""

from __future__ import annotations

import ast
import functools
import json
import textwrap
from collections.abc import Callable
from pathlib import Path

from ..train.corpus import Document, load_corpus

__all__ = ["BUILTIN_SETS", "builtin_prompts", "code_prompts", "grounded_prompts", "load_prompts"]

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _split_docs(split: str) -> tuple[Document, ...]:
    """The corpus documents of ``split``. The small held-out splits are read once per process (the stdlib scan
    takes seconds); the train split (most of the stdlib) is not kept in memory."""
    if split == "train":
        return _read_split(split)
    return _cached_split(split)


def _read_split(split: str) -> tuple[Document, ...]:
    return tuple(doc for doc in load_corpus(include_topics=False) if doc.split == split)


_cached_split = functools.lru_cache(maxsize=4)(_read_split)


def _functions(split: str):
    """``(doc, source lines, function node)`` for every function in the ``split`` modules, in corpus order."""
    for doc in _split_docs(split):
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        lines = doc.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, _FUNCTIONS):
                yield doc, lines, node


def _stratified(found: list[dict], n: int) -> list[dict]:
    """``n`` rows, round-robin over top-level modules (so no big package dominates), a fixed stride within each."""
    groups: dict[str, list[dict]] = {}
    for row in sorted(found, key=lambda r: r["id"]):
        groups.setdefault(row["id"].split(".")[0], []).append(row)
    picked: list[dict] = []
    rank = 0
    while len(picked) < n and any(len(g) > rank for g in groups.values()):
        for top in sorted(groups):
            g = groups[top]
            if len(picked) < n and rank < len(g):
                picked.append(g[(rank * 7919) % len(g)])  # 7919 is prime: a permutation of the group
        rank += 1
    return picked


def _signature_and_docstring(source_lines: list[str], node: ast.FunctionDef) -> str | None:
    doc = node.body[0] if node.body else None
    if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
            and isinstance(doc.value.value, str)):
        return None
    if len(node.body) < 2 or len(doc.value.value) < 20:
        return None  # a docstring-only function, or a trivial docstring
    first = node.lineno - 1 - len(node.decorator_list)
    text = "".join(source_lines[first : doc.end_lineno])
    return textwrap.dedent(text)


def code_prompts(n: int = 24, split: str = "test", max_chars: int = 1200) -> list[dict]:
    """``n`` prompts ``{"id", "prompt"}``: signature + docstring of functions from the ``split`` modules."""
    found: list[dict] = []
    for doc, lines, node in _functions(split):
        text = _signature_and_docstring(lines, node)
        if text and len(text) <= max_chars:
            found.append({"id": f"{doc.module}.{node.name}:{node.lineno}", "prompt": text})
    return _stratified(found, n)


_GROUNDED_TASKS = (
    ("rename", "# The same function as {name}() above, renamed to {new}():\ndef {new}("),
    ("type-hints", "# {name}() again, rewritten with type hints:\ndef {name}("),
)


def grounded_prompts(n: int = 24, split: str = "test", min_lines: int = 4, max_lines: int = 16,
                     max_chars: int = 700) -> list[dict]:
    """``n`` prompts ``{"id", "prompt", "source", "task"}`` whose answer copies from the prompt.

    The prompt is a short function (``min_lines``..``max_lines`` lines, no nested definitions, not a dunder
    method, dedented) from
    the ``split`` modules, a blank line, a comment asking for the same function again (``task`` ``rename``: as
    ``NAME_v2``; ``type-hints``: with type hints; alternating) and the start of its ``def`` line. ``source`` is
    the function as it appears in the prompt.
    """
    found: list[dict] = []
    for doc, lines, node in _functions(split):
        if node.name.startswith("__") and node.name.endswith("__"):
            continue  # dunder methods: a renamed copy would read oddly
        if any(isinstance(c, (*_FUNCTIONS, ast.ClassDef, ast.Lambda)) for c in ast.walk(node) if c is not node):
            continue
        first = node.lineno - 1 - len(node.decorator_list)
        source = textwrap.dedent("".join(lines[first : node.end_lineno]))
        if not (min_lines <= source.count("\n") <= max_lines and len(source) <= max_chars):
            continue
        found.append({"id": f"{doc.module}.{node.name}:{node.lineno}", "name": node.name, "source": source})
    rows = []
    for i, row in enumerate(_stratified(found, n)):
        task, template = _GROUNDED_TASKS[i % len(_GROUNDED_TASKS)]
        ask = template.format(name=row["name"], new=row["name"] + "_v2")
        rows.append({"id": row["id"], "prompt": row["source"] + "\n" + ask, "source": row["source"], "task": task})
    return rows


BUILTIN_SETS: dict[str, Callable[..., list[dict]]] = {"code": code_prompts, "grounded": grounded_prompts}


def builtin_prompts(name: str, n: int = 24) -> list[dict]:
    """The built-in set ``name`` (``builtin:NAME`` on the command line)."""
    if name not in BUILTIN_SETS:
        raise ValueError(f"unknown built-in prompt set {name!r}; known: {', '.join(BUILTIN_SETS)}")
    return BUILTIN_SETS[name](n=n)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise ValueError(f"prompt file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} is not a file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{path}:{lineno}: no 'prompt' field (expected a JSON object with a 'prompt' string)")
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
            rows.append({"id": str(lineno), **obj})
    return rows


def load_prompts(source: str | Path, n: int | None = None) -> list[dict]:
    """The prompts of ``source``: ``builtin:NAME`` or the path of a JSONL file; the first ``n`` only if given.

    Returns records with at least ``id`` and ``prompt``. Raises a one-line ValueError for a missing file, a line
    that is not a JSON object or has no (or an empty) ``prompt``, an unknown built-in set, or an empty set.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"the number of prompts must be an integer >= 1, got {n!r}")
    text = str(source)
    if text.startswith("builtin:"):
        rows = builtin_prompts(text[len("builtin:"):], n=24 if n is None else n)
    else:
        rows = _read_jsonl(Path(text).expanduser())
    rows = rows if n is None else rows[:n]
    if not rows:
        raise ValueError(f"no prompts in {text!r}")
    return rows
