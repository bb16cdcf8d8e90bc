"""``builtin:code-chat``: coding requests as chats, made from the held-out standard-library modules (no download,
no public benchmark set).

Half of the requests ask the model to write a function from what a standard-library function's docstring says
(``write``: "Write a Python function `name(args)` that <first docstring paragraph>. Include a docstring."); the
other half paste a real function's source in a ```` ```python ```` block and ask for an edit, cycling over four
tasks:

``rename``      rename the function and its parameters to clearer names;
``type-hints``  add type hints and a docstring;
``class``       turn two adjacent module-level functions into a class;
``fix``         find and fix the bug: one small bug planted here (a flipped comparison or an off-by-one integer),
                chosen deterministically (:func:`plant_bug`); the record keeps the correct ``source`` and ``bug``.

The categories alternate (write, rename, write, type-hints, write, class, write, fix, ...), so any prefix of the
set is balanced. Functions come from the ``test`` split of the corpus (modules no bundled model was trained on),
sorted, stratified by top-level module (:func:`speculant.data.stdlib_functions.stratified`), each used at most
once; a function shorter than ``min_lines`` or longer than ``max_lines`` lines is skipped. Each record is
``{"id", "category", "messages": [{"role": "user", "content"}], "source", "module"}`` (``fix`` adds ``bug``),
the record format of :mod:`speculant.data.prompts`; the same ``seed`` gives the same set on one interpreter.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap

from .stdlib_functions import FUNCTIONS, split_functions, stratified, top_module

__all__ = ["CATEGORIES", "EDIT_TASKS", "code_chat_prompts", "plant_bug"]

EDIT_TASKS = ("rename", "type-hints", "class", "fix")
"""The edit requests, in the order they cycle."""

CATEGORIES = ("write", *EDIT_TASKS)
"""Every record's ``category``."""

_ASK = {
    "rename": "Rename this function and its parameters to clearer, more descriptive names, and update every use of "
    "them. Give the whole function back.",
    "type-hints": "Add type hints to the parameters and the return value of this function, and give it a docstring "
    "(improve the existing one if it has one). Give the whole function back.",
    "class": "Turn these functions into a class: they become its methods, and what they share becomes attributes. "
    "Show the class and how to use it.",
    "fix": "This function has a bug. Find it, explain it in one sentence, and give the fixed function.",
}

_FLIP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "is": "is not", "is not": "is",
         "in": "not in", "not in": "in"}
_OPERATOR = re.compile(r"<=|>=|==|!=|<|>|\bis\s+not\b|\bnot\s+in\b|\bis\b|\bin\b")
# the first words of a docstring that do not start an imperative sentence ("Return x." is one)
_NOT_VERBS = {"a", "an", "the", "this", "these", "if", "when", "helper", "internal", "used", "for", "utility",
              "same", "like", "private", "deprecated", "called", "note", "unlike", "with", "in", "on", "by"}


def _source(lines: list[str], node: ast.FunctionDef) -> str:
    """The function's source (decorators included), dedented, ending with a newline."""
    first = node.lineno - 1 - len(node.decorator_list)
    return textwrap.dedent("".join(lines[first: node.end_lineno])).rstrip() + "\n"


def _fits(source: str, min_lines: int, max_lines: int, max_chars: int) -> bool:
    return min_lines <= source.count("\n") <= max_lines and len(source) <= max_chars


def _plain(node: ast.FunctionDef) -> bool:
    """Not a dunder method and no nested definitions (a self-contained snippet)."""
    if node.name.startswith("__") and node.name.endswith("__"):
        return False
    return not any(isinstance(c, (*FUNCTIONS, ast.ClassDef, ast.Lambda)) for c in ast.walk(node) if c is not node)


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def _that(paragraph: str) -> str:
    """``paragraph`` continuing "a function ... that": an imperative first verb in the third person ("Return the
    x." -> "returns the x."), else "does the following: <paragraph>"."""
    first, _, rest = paragraph.partition(" ")
    word = first.lower()
    if not re.fullmatch(r"[A-Z][a-z]+", first) or word in _NOT_VERBS or not rest:
        return "does the following: " + paragraph
    if word.endswith("s") and not word.endswith(("ss", "us")):
        verb = word  # already "Returns"
    elif word.endswith(("ss", "sh", "ch", "x", "z", "o")):
        verb = word + "es"
    elif word.endswith("y") and word[-2:-1] not in "aeiou":
        verb = word[:-1] + "ies"
    else:
        verb = word + "s"
    return f"{verb} {rest}"


def _offsets(source: str) -> list[int]:
    """Byte offset of each line start (``ast`` columns are UTF-8 byte offsets)."""
    starts, total = [], 0
    for line in source.encode("utf-8").splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    return starts


def _bug_sites(tree: ast.AST, starts: list[int], data: bytes) -> list[tuple[int, int, str, str, str, int]]:
    """``(start byte, end byte, kind, was, now, line)`` of every place one small bug can go, in source order: the
    first operator of each comparison (flipped) and each integer literal in arithmetic, an index, a slice, a
    comparison or a call's arguments (plus one)."""
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left, right = node.left, node.comparators[0]
            a = starts[left.end_lineno - 1] + left.end_col_offset
            b = starts[right.lineno - 1] + right.col_offset
            m = _OPERATOR.search(data[a:b].decode("utf-8"))
            if m is None:
                continue
            was = " ".join(m.group().split())
            lo = a + len(data[a:b].decode("utf-8")[: m.start()].encode("utf-8"))
            hi = lo + len(m.group().encode("utf-8"))
            sites.append((lo, hi, "comparison", was, _FLIP[was], node.lineno))
        for child in ast.iter_child_nodes(node):
            if (isinstance(node, (ast.BinOp, ast.Subscript, ast.Slice, ast.Compare, ast.Call))
                    and isinstance(child, ast.Constant) and type(child.value) is int):
                lo = starts[child.lineno - 1] + child.col_offset
                hi = starts[child.end_lineno - 1] + child.end_col_offset
                sites.append((lo, hi, "off-by-one", data[lo:hi].decode("utf-8"), str(child.value + 1), child.lineno))
    return sorted(set(sites))


def plant_bug(source: str, rng: random.Random) -> tuple[str, dict] | None:
    """``source`` with one small bug, and what it is: ``{"kind": "comparison" | "off-by-one", "line": N (1-based,
    in ``source``), "was", "now"}``; None when ``source`` offers no place for one. The place is ``rng``'s pick
    among the comparisons and integer literals (:func:`_bug_sites`); the result always compiles and parses to a
    different tree."""
    tree = ast.parse(source)
    data = source.encode("utf-8")
    sites = _bug_sites(tree, _offsets(source), data)
    rng.shuffle(sites)
    for lo, hi, kind, was, now, line in sites:
        buggy = (data[:lo] + now.encode("utf-8") + data[hi:]).decode("utf-8")
        try:
            changed = ast.dump(ast.parse(buggy)) != ast.dump(tree)
        except SyntaxError:
            continue
        if changed:
            return buggy, {"kind": kind, "line": line, "was": was, "now": now}
    return None


def _compiles(source: str) -> bool:
    try:
        compile(source, "<code-chat>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def _pools(split: str, min_lines: int, max_lines: int, max_chars: int) -> dict[str, list[dict]]:
    """Candidate functions per category, sorted by id: ``write`` (documented public module-level functions),
    ``edit`` (self-contained functions and methods), ``class`` (two adjacent module-level functions)."""
    pools: dict[str, list[dict]] = {"write": [], "edit": [], "class": []}
    seen_modules = set()
    for doc, lines, node, tree in split_functions(split):
        name = f"{doc.module}.{node.name}:{node.lineno}"
        source = _source(lines, node)
        if not _fits(source, min_lines, max_lines, max_chars) or not _compiles(source):
            continue
        top_level = node in tree.body
        docstring = ast.get_docstring(node)
        if top_level and docstring and not node.name.startswith("_"):
            paragraph = _first_paragraph(docstring)
            signature = f"{node.name}({ast.unparse(node.args)})"
            if 20 <= len(paragraph) <= 400 and len(signature) <= 100:
                pools["write"].append({"id": name, "module": doc.module, "source": source,
                                       "ask": f"Write a Python function `{signature}` that {_that(paragraph)}"})
        if _plain(node):
            pools["edit"].append({"id": name, "module": doc.module, "source": source, "node": node.name})
        if doc.module not in seen_modules:  # adjacent module-level pairs, once per module
            seen_modules.add(doc.module)
            defs = [n for n in tree.body if isinstance(n, FUNCTIONS) and _plain(n)]
            for a, b in zip(defs, defs[1:]):
                pair = _source(lines, a) + "\n\n" + _source(lines, b)
                if _fits(pair, min_lines, max_lines, max_chars) and _compiles(pair):
                    pools["class"].append({"id": f"{doc.module}.{a.name}+{b.name}:{a.lineno}", "module": doc.module,
                                           "source": pair, "node": a.name})
    return {k: sorted(v, key=lambda r: r["id"]) for k, v in pools.items()}


def _fenced(source: str) -> str:
    return "```python\n" + source + "```"


def code_chat_prompts(n: int = 80, split: str = "test", seed: int = 0, min_lines: int = 4, max_lines: int = 60,
                      max_chars: int = 2400) -> list[dict]:
    """``n`` coding chats (default 80), categories alternating ``write`` and the edit tasks (module doc).

    Args:
        n: how many records; half of them (rounded up) ``write``.
        split: the corpus split whose modules the functions come from (``test``: held out from every bundled
            model's training).
        seed: picks the planted bug of each ``fix`` record.
        min_lines, max_lines, max_chars: the size of a function (or, for ``class``, of the pair) kept.

    Returns:
        the records (see the module doc); fewer than ``n`` only if the split runs out of functions.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of prompts must be an integer >= 1, got {n!r}")
    pools = _pools(split, min_lines, max_lines, max_chars)
    order = {k: iter(stratified(v, len(v), top_module)) for k, v in pools.items()}
    used: set[tuple[str, str]] = set()  # (module, function) already in a record

    def take(pool: str, ok=lambda row: True) -> dict | None:
        for row in order[pool]:
            keys = {(row["module"], part.split(":")[0]) for part in row["id"][len(row["module"]) + 1:].split("+")}
            if keys & used or not ok(row):
                continue
            used.update(keys)
            return row
        return None

    rows: list[dict] = []
    for i in range(n):
        category = "write" if i % 2 == 0 else EDIT_TASKS[(i // 2) % len(EDIT_TASKS)]
        if category == "write":
            row = take("write")
            if row is None:
                break
            content, extra = f"{row['ask'].rstrip('.')}. Include a docstring.", {}
        elif category == "fix":
            planted: dict = {}

            def bugged(r: dict) -> bool:
                found = plant_bug(r["source"], random.Random(f"{seed}:{r['id']}"))
                planted["found"] = found
                return found is not None

            row = take("edit", bugged)
            if row is None:
                break
            buggy, bug = planted["found"]
            content, extra = f"{_ASK['fix']}\n\n{_fenced(buggy)}", {"bug": bug}
        else:
            row = take("class" if category == "class" else "edit")
            if row is None:
                break
            content, extra = f"{_ASK[category]}\n\n{_fenced(row['source'])}", {}
        rows.append({"id": f"{category}/{row['id']}", "category": category,
                     "messages": [{"role": "user", "content": content}], "source": row["source"],
                     "module": row["module"], **extra})
    return rows
