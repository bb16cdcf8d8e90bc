"""Built-in prompt sets drawn from the held-out (test-split) standard-library modules.

``code``: a function's signature and docstring (the model writes the body). Prompts are extracted with ``ast``
from modules no bundled model was trained on, deterministically (sorted, evenly spaced picks).
"""

from __future__ import annotations

import ast
import textwrap

from ..train.corpus import load_corpus

__all__ = ["code_prompts", "BUILTIN_SETS", "builtin_prompts"]


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
    for doc in load_corpus(include_topics=False):
        if doc.split != split:
            continue
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        lines = doc.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                text = _signature_and_docstring(lines, node)
                if text and len(text) <= max_chars:
                    found.append({"id": f"{doc.module}.{node.name}:{node.lineno}", "prompt": text})
    # stratified by top-level module (round-robin), evenly spaced within each, so no big package dominates
    groups: dict[str, list[dict]] = {}
    for row in sorted(found, key=lambda r: r["id"]):
        groups.setdefault(row["id"].split(".")[0], []).append(row)
    picked: list[dict] = []
    rank = 0
    while len(picked) < n and any(len(g) > rank for g in groups.values()):
        for top in sorted(groups):
            g = groups[top]
            if len(picked) < n and rank < len(g):
                picked.append(g[(rank * 7919) % len(g)])  # a fixed stride through the module's functions
        rank += 1
    return picked


BUILTIN_SETS = {"code": code_prompts}


def builtin_prompts(name: str, n: int = 24) -> list[dict]:
    """The built-in set ``name`` (``builtin:NAME`` on the command line)."""
    if name not in BUILTIN_SETS:
        raise ValueError(f"unknown built-in prompt set {name!r}; known: {', '.join(BUILTIN_SETS)}")
    return BUILTIN_SETS[name](n=n)
