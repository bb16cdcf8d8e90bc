"""Fill-in-the-middle prompts (``builtin:fim``) made from the held-out standard-library modules: a span of a
function's body cut out, the model writes it back between the code before and after it.

Deterministic for one interpreter: the functions are picked as the other built-in code sets pick them (sorted,
stratified by top-level module, :func:`speculant.data.stdlib_functions.stratified`) and each function's span from
a random generator seeded with the set's ``seed`` and the function's id, so a record does not depend on how many
are asked for.
"""

from __future__ import annotations

import ast
import random

from .stdlib_functions import split_functions, stratified, top_module

__all__ = ["fim_prompts"]


def _body_lines(node: ast.FunctionDef) -> tuple[int, int] | None:
    """``(first, end)``: the 0-based line range of the function's body after its docstring; None when nothing is
    left (a docstring-only function) or it shares the ``def`` line."""
    body = node.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    if not body or body[0].lineno == node.lineno:
        return None
    return body[0].lineno - 1, node.end_lineno


def _back(lines: list[str], end: int, max_chars: int) -> int:
    """The first line of the longest run of whole lines ending at ``end`` (exclusive) within ``max_chars``."""
    start, chars = end, 0
    while start > 0 and chars + len(lines[start - 1]) <= max_chars:
        start -= 1
        chars += len(lines[start])
    return start


def _forward(lines: list[str], start: int, stop: int, max_chars: int) -> int:
    """The end (exclusive) of the longest run of whole lines from ``start`` to at most ``stop`` within
    ``max_chars``."""
    end, chars = start, 0
    while end < stop and chars + len(lines[end]) <= max_chars:
        chars += len(lines[end])
        end += 1
    return end


def fim_prompts(n: int = 24, split: str = "test", seed: int = 0, max_span: int = 8, prefix_chars: int = 1200,
                suffix_chars: int = 800, after_lines: int = 8) -> list[dict]:
    """``n`` fill-in-the-middle records ``{"id", "prefix", "suffix", "middle", "category"}``.

    Each is a function of the ``split`` modules with 1 to ``max_span`` whole lines of its body (after the
    docstring; the first line never blank) cut out as ``middle``; ``prefix`` is the module's text before the cut
    (whole lines, at most ``prefix_chars`` characters, ending at the cut), ``suffix`` the rest of the function and
    up to ``after_lines`` lines after it (whole lines, at most ``suffix_chars`` characters). ``category``:
    ``single-line`` or ``multi-line``. The id is ``module.function:line`` of the function.
    """
    found: list[dict] = []
    for doc, lines, node, _ in split_functions(split):
        body = _body_lines(node)
        if body is None or not any(lines[i].strip() for i in range(*body)):
            continue
        found.append({"id": f"{doc.module}.{node.name}:{node.lineno}", "lines": lines, "body": body})
    rows = []
    for row in stratified(sorted(found, key=lambda r: r["id"]), n, top_module):
        lines, (first, end) = row["lines"], row["body"]
        rng = random.Random(f"{seed}:{row['id']}")
        starts = [i for i in range(first, end) if lines[i].strip()]
        a = rng.choice(starts)
        b = min(end, a + rng.randint(1, max_span))
        after = _forward(lines, b, min(len(lines), end + after_lines), suffix_chars)
        rows.append({"id": row["id"], "prefix": "".join(lines[_back(lines, a, prefix_chars):a]),
                     "suffix": "".join(lines[b:after]), "middle": "".join(lines[a:b]),
                     "category": "single-line" if b - a == 1 else "multi-line"})
    return rows
