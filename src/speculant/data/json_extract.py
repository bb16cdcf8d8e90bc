"""``builtin:json-extract``: chat requests that ask for JSON matching a schema, extracted from a text, with the
reference answer.

Two real sources, both on this machine (nothing downloads): the metadata of the installed distributions
(:mod:`importlib.metadata`: a header block of ``Name``, ``Version``, ``Summary``, ``Requires-Python``,
``License``, ``Classifier`` and ``Requires-Dist`` lines), and the functions of the held-out standard-library
modules (the ``test`` split of :mod:`speculant.data.corpus`: a signature and its docstring). Four schema shapes
(each record's ``category``), in turn:

``package``       a nested object with integers: name, version ``{text, major, minor}``, summary, requires_python
                  (a string or null);
``dependencies``  an array of objects: each ``Requires-Dist`` line's distribution name and whether it is
                  conditional (has an environment marker);
``classifiers``   an enum and an array of strings: the development status (one of :data:`STATUSES`) and the
                  intended audiences;
``function``      a function's name, its docstring's first paragraph, its parameters with their defaults (a
                  string as written in the signature, or null).

Every answer is computable from the text, so each record carries its ``reference``. A record is ``{"id",
"category", "messages": [system, user], "response_format", "reference", "source"}``: the system message states
the schema, the user message the request and the text; ``response_format`` is OpenAI's ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict": true}}``. Distributions are taken in a seeded order
of their sorted names, each used once; functions stratified by top-level module
(:func:`speculant.data.stdlib_functions.stratified`). The same ``seed`` gives the same set for one interpreter and
one set of installed distributions.

:func:`answer_report` checks an answer: ``valid`` (parses and matches the schema) and ``exact`` (equals the
reference).
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.metadata
import json
import random
import re
from collections.abc import Callable, Iterator, Mapping

from .json_schema import check_schema, json_equal, parse_json, schema_errors
from .stdlib_functions import split_functions, stratified, top_module

__all__ = ["CATEGORIES", "SCHEMAS", "STATUSES", "answer_report", "distribution_headers", "json_extract_prompts"]

STATUSES = ("Planning", "Pre-Alpha", "Alpha", "Beta", "Production/Stable", "Mature", "Inactive", "not stated")
"""The ``development_status`` values: the trove classifiers' ``Development Status`` names, or ``not stated``."""

_NAME_STR = {"type": "string", "maxLength": 100}

SCHEMAS: dict[str, dict] = {
    "package": {
        "type": "object",
        "properties": {
            "name": _NAME_STR,
            "version": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40},
                                                          "major": {"type": "integer", "minimum": 0},
                                                          "minor": {"type": "integer", "minimum": 0}},
                        "required": ["text", "major", "minor"], "additionalProperties": False},
            "summary": {"type": "string", "maxLength": 200},
            "requires_python": {"type": ["string", "null"], "maxLength": 100},
        },
        "required": ["name", "version", "summary", "requires_python"],
        "additionalProperties": False,
    },
    "dependencies": {
        "type": "object",
        "properties": {
            "package": _NAME_STR,
            "requires": {"type": "array", "minItems": 1, "maxItems": 10, "items": {
                "type": "object", "properties": {"name": _NAME_STR, "conditional": {"type": "boolean"}},
                "required": ["name", "conditional"], "additionalProperties": False}},
        },
        "required": ["package", "requires"],
        "additionalProperties": False,
    },
    "classifiers": {
        "type": "object",
        "properties": {
            "package": _NAME_STR,
            "development_status": {"type": "string", "enum": list(STATUSES)},
            "audiences": {"type": "array", "maxItems": 8, "items": _NAME_STR},
        },
        "required": ["package", "development_status", "audiences"],
        "additionalProperties": False,
    },
    "function": {
        "type": "object",
        "properties": {
            "name": _NAME_STR,
            "summary": {"type": "string", "maxLength": 300},
            "parameters": {"type": "array", "maxItems": 6, "items": {
                "type": "object", "properties": {"name": _NAME_STR,
                                                 "default": {"type": ["string", "null"], "maxLength": 100}},
                "required": ["name", "default"], "additionalProperties": False}},
        },
        "required": ["name", "summary", "parameters"],
        "additionalProperties": False,
    },
}
"""The schema of each shape (JSON Schema, the subset of :mod:`speculant.data.json_schema`). Strings and arrays are
bounded by how the set is built (at most 8 classifiers, 10 requirements, 6 parameters, a 200-character summary
...), so an answer decoded under the schema always ends."""

CATEGORIES = tuple(SCHEMAS)
"""Every record's ``category``, in the order they take turns."""

_ASK = {
    "package": "From this package metadata, give the package's name, its version (the text, and its major and minor "
    "numbers), its summary, and the Python versions it requires (its Requires-Python, or null if it has none).",
    "dependencies": "List the requirements of this package (its Requires-Dist lines, in order): each one's "
    "distribution name as written, and whether it is conditional (has an environment marker after ';').",
    "classifiers": "From this package metadata, give the package's development status (from its 'Development "
    "Status' classifier, or 'not stated' if it has none) and its intended audiences (the text after 'Intended "
    "Audience ::' of each such classifier, in order).",
    "function": "Describe this Python function: its name, its summary (the first paragraph of its docstring, on "
    "one line), and its parameters in order (without self or cls), each with its default value as written in the "
    "signature, or null if it has none.",
}

_SYSTEM = ("You extract data from text into JSON. Reply with one JSON object that matches this JSON Schema, and "
           "nothing else.\n\nSchema: {schema}")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION = re.compile(r"(\d+)\.(\d+)")
_MAX_CLASSIFIERS = 8
_MAX_REQUIRES = 10


def _one_line(text: str | None, limit: int = 100) -> str | None:
    """``text`` when it is one line of at most ``limit`` characters, else None."""
    if not text or "\n" in text.strip() or len(text.strip()) > limit:
        return None
    return text.strip()


def distribution_headers() -> list[dict]:
    """Every installed distribution's metadata as ``{"name", "version", "summary", "license", "requires_python",
    "classifiers", "requires", "text"}``, sorted by lower-cased name (the first found of each): ``text`` is its
    header block (the fields in that order, at most 8 ``Classifier`` and 10 ``Requires-Dist`` lines, a long or
    multi-line ``License`` left out), the material every other field is read from."""
    found: dict[str, dict] = {}
    for dist in importlib.metadata.distributions():
        meta = dist.metadata
        name, version = meta.get("Name"), meta.get("Version")
        if not name or not version or name.lower() in found:
            continue
        row = {"name": name, "version": version, "summary": _one_line(meta.get("Summary"), 200),
               "license": _one_line(meta.get("License-Expression")) or _one_line(meta.get("License")),
               "requires_python": _one_line(meta.get("Requires-Python")),
               "classifiers": (meta.get_all("Classifier") or [])[:_MAX_CLASSIFIERS],
               "requires": meta.get_all("Requires-Dist") or []}
        lines = [f"Name: {name}", f"Version: {version}"]
        lines += [f"{key}: {row[field]}" for key, field in (("Summary", "summary"), ("License", "license"),
                                                             ("Requires-Python", "requires_python")) if row[field]]
        lines += [f"Classifier: {c}" for c in row["classifiers"]]
        lines += [f"Requires-Dist: {r}" for r in row["requires"][:_MAX_REQUIRES]]
        row["text"] = "\n".join(lines)
        found[name.lower()] = row
    return [found[k] for k in sorted(found)]


def _package(d: dict) -> dict | None:
    m = _VERSION.match(d["version"])
    if m is None or d["summary"] is None:
        return None
    return {"name": d["name"], "version": {"text": d["version"], "major": int(m[1]), "minor": int(m[2])},
            "summary": d["summary"], "requires_python": d["requires_python"]}


def _dependencies(d: dict) -> dict | None:
    if not 1 <= len(d["requires"]) <= _MAX_REQUIRES:
        return None
    requires = []
    for line in d["requires"]:
        m = _NAME.match(line.strip())
        if m is None:
            return None
        requires.append({"name": m.group(), "conditional": ";" in line})
    return {"package": d["name"], "requires": requires}


def _classifiers(d: dict) -> dict | None:
    if not d["classifiers"]:
        return None
    status = "not stated"
    audiences = []
    for c in d["classifiers"]:
        parts = [p.strip() for p in c.split("::")]
        if parts[0] == "Development Status" and len(parts) == 2 and status == "not stated":
            status = re.sub(r"^\d+\s*-\s*", "", parts[1])
        elif parts[0] == "Intended Audience" and len(parts) >= 2:
            audiences.append(" :: ".join(parts[1:]))
    if status not in STATUSES:
        return None
    return {"package": d["name"], "development_status": status, "audiences": audiences}


_FROM_METADATA: dict[str, Callable[[dict], dict | None]] = {
    "package": _package, "dependencies": _dependencies, "classifiers": _classifiers}


def _as_written(lines: list[str], node: ast.expr) -> str:
    """``node``'s source text as written (``ast`` columns are UTF-8 byte offsets); a multi-line one unparsed."""
    if node.lineno != node.end_lineno:
        return ast.unparse(node)
    return lines[node.lineno - 1].encode("utf-8")[node.col_offset:node.end_col_offset].decode("utf-8")


@functools.lru_cache(maxsize=4)
def _functions(max_chars: int) -> tuple[dict, ...]:
    """``{"id", "text", "reference"}`` of the held-out modules' documented functions whose parameters are all
    plain (positional-or-keyword or keyword-only, no ``*args``/``**kwargs``/positional-only), 1 to 6 of them
    besides ``self``/``cls``, sorted by id."""
    rows = []
    for doc, lines, node, _ in split_functions("test"):
        docstring = ast.get_docstring(node)
        a = node.args
        if not docstring or a.vararg or a.kwarg or a.posonlyargs or node.name.startswith("_"):
            continue
        params = [p.arg for p in a.args + a.kwonlyargs]
        defaults = [None] * (len(a.args) - len(a.defaults)) + [_as_written(lines, x) for x in a.defaults]
        defaults += [None if x is None else _as_written(lines, x) for x in a.kw_defaults]
        pairs = [(p, d) for p, d in zip(params, defaults) if p not in ("self", "cls")]
        summary = " ".join(docstring.split("\n\n")[0].split())
        if not 1 <= len(pairs) <= 6 or not 20 <= len(summary) <= 300 or any(len(d or "") > 100 for _, d in pairs):
            continue
        body = node.body[0]
        first = node.lineno - 1 - len(node.decorator_list)
        text = "".join(lines[first:body.end_lineno])
        indent = len(text) - len(text.lstrip(" "))
        text = "\n".join(line[indent:] if line[:indent].isspace() else line for line in text.splitlines())
        if len(text) > max_chars:
            continue
        rows.append({"id": f"{doc.module}.{node.name}:{node.lineno}", "text": text, "reference": {
            "name": node.name, "summary": summary,
            "parameters": [{"name": p, "default": d} for p, d in pairs]}})
    return tuple(sorted(rows, key=lambda r: r["id"]))


def _sources(seed: int, max_chars: int) -> dict[str, Iterator[dict]]:
    """Each shape's candidates ``{"id", "text", "reference"}`` in the order they are used."""
    dists = [d for d in distribution_headers() if len(d["text"]) <= max_chars]
    random.Random(f"{seed}:distributions").shuffle(dists)
    used: set[str] = set()

    def from_metadata(shape: str) -> Iterator[dict]:
        for d in dists:
            if d["name"] in used:
                continue
            reference = _FROM_METADATA[shape](d)
            if reference is not None:
                used.add(d["name"])
                yield {"id": d["name"], "text": d["text"], "reference": reference}

    functions = list(_functions(max_chars))
    return {**{shape: from_metadata(shape) for shape in _FROM_METADATA},
            "function": iter(stratified(functions, len(functions), top_module))}


def _record(shape: str, row: dict) -> dict:
    schema = SCHEMAS[shape]
    system = _SYSTEM.format(schema=json.dumps(schema, separators=(",", ":")))
    fence = "```python" if shape == "function" else "```"
    return {"id": f"{shape}/{row['id']}", "category": shape,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"{_ASK[shape]}\n\n{fence}\n{row['text']}\n```"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": shape, "schema": schema,
                                                                       "strict": True}},
            "reference": copy.deepcopy(row["reference"]), "source": row["text"]}


def json_extract_prompts(n: int = 40, seed: int = 0, max_chars: int = 1200) -> list[dict]:
    """``n`` extraction requests (default 40), the shapes of :data:`CATEGORIES` in turn (module doc); a shape whose
    sources run out is skipped from then on. ``max_chars`` bounds the text extracted from."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of prompts must be an integer >= 1, got {n!r}")
    sources = _sources(seed, max_chars)
    rows: list[dict] = []
    live = list(CATEGORIES)
    i = 0
    while len(rows) < n and live:
        shape = live[i % len(live)]
        row = next(sources[shape], None)
        if row is None:
            live.remove(shape)
            continue
        rows.append(_record(shape, row))
        i += 1
    return rows


def answer_report(text: str, record: Mapping) -> dict:
    """How ``text`` answers the json-extract (or any ``response_format``) ``record``: ``valid`` (parses as JSON and
    matches the record's schema; for ``{"type": "json_object"}``: parses to an object), ``exact`` (equals the
    record's ``reference``; None when it has none), ``errors`` (at most 5)."""
    value, why = parse_json(text)
    fmt = record.get("response_format") or {}
    if why is not None:
        errors = [why]
    elif fmt.get("type") == "json_schema":
        errors = schema_errors(value, fmt["json_schema"].get("schema", {}))
    else:
        errors = [] if isinstance(value, dict) else ["$: expected an object"]
    reference = record.get("reference")
    exact = None if reference is None else why is None and json_equal(value, reference)
    return {"valid": not errors, "exact": exact, "errors": errors[:5]}
