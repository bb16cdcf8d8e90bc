"""A JSON Schema validator for the subset the structured workloads use (no dependency).

``builtin:json-extract`` and ``builtin:tools`` (:mod:`speculant.data.json_extract`, :mod:`speculant.data.tools`)
check an answer against a schema: it must parse and match. The schemas they build use only these keywords (JSON
Schema draft 2020-12 semantics): ``type`` (one name or a list), ``properties``, ``required``,
``additionalProperties`` (a boolean or a schema), ``items``, ``minItems``, ``maxItems``, ``enum``, ``const``,
``minimum``, ``maximum``, ``minLength``, ``maxLength``, ``pattern``, ``anyOf`` and the annotations ``title``,
``description`` and ``default``. :func:`check_schema` refuses anything else, so a schema that validates here
means the same to any draft 2020-12 validator.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["KEYWORDS", "TYPES", "check_schema", "is_valid", "json_equal", "parse_json", "schema_errors"]

TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
"""The type names of ``type``."""

KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                      "enum", "const", "minimum", "maximum", "minLength", "maxLength", "pattern", "anyOf",
                      "title", "description", "default"})
"""Every keyword a schema may use here."""


def check_schema(schema: Any, where: str = "schema") -> None:
    """Nothing when ``schema`` is a schema of the supported subset (module doc), else a one-line ValueError naming
    the first bad place (``where`` and a JSON-pointer-like path)."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: a schema must be a JSON object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - KEYWORDS)
    if unknown:
        raise ValueError(f"{where}: unsupported keyword(s) {', '.join(unknown)}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not types or any(t not in TYPES for t in types):
            raise ValueError(f"{where}/type: {schema['type']!r} is not one of {', '.join(TYPES)} (or a list)")
    props = schema.get("properties", {})
    if not isinstance(props, Mapping):
        raise ValueError(f"{where}/properties: must be an object")
    for name, sub in props.items():
        check_schema(sub, f"{where}/properties/{name}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required) or \
            len(set(required)) != len(required):
        raise ValueError(f"{where}/required: must be a list of distinct strings")
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, bool):
        check_schema(extra, f"{where}/additionalProperties")
    if "items" in schema:
        check_schema(schema["items"], f"{where}/items")
    for key in ("minItems", "maxItems", "minLength", "maxLength"):
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int) or schema[key] < 0):
            raise ValueError(f"{where}/{key}: must be an integer >= 0")
    for key in ("minimum", "maximum"):
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], (int, float))):
            raise ValueError(f"{where}/{key}: must be a number")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ValueError(f"{where}/enum: must be a non-empty list")
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except (re.error, TypeError) as exc:
            raise ValueError(f"{where}/pattern: not a regular expression ({exc})") from None
    if "anyOf" in schema:
        if not isinstance(schema["anyOf"], list) or not schema["anyOf"]:
            raise ValueError(f"{where}/anyOf: must be a non-empty list")
        for i, sub in enumerate(schema["anyOf"]):
            check_schema(sub, f"{where}/anyOf/{i}")


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if isinstance(value, bool):
        return False
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, (int, float))  # number


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: booleans are not numbers, 1 == 1.0, objects and arrays compared member by member."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def schema_errors(value: Any, schema: Mapping, path: str = "$") -> list[str]:
    """Every way ``value`` (parsed JSON) fails ``schema`` (the subset of the module doc), as ``"PATH: why"``
    lines; empty when it matches."""
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, t) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {json.dumps(value)[:60]}"]
    if "const" in schema and not json_equal(value, schema["const"]):
        errors.append(f"{path}: expected {json.dumps(schema['const'])}")
    if "enum" in schema and not any(json_equal(value, e) for e in schema["enum"]):
        errors.append(f"{path}: {json.dumps(value)[:60]} is not one of {json.dumps(schema['enum'])[:120]}")
    if "anyOf" in schema and not any(not schema_errors(value, s, path) for s in schema["anyOf"]):
        errors.append(f"{path}: matches none of the anyOf schemas")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{path}: missing {name!r}" for name in schema.get("required", []) if name not in value]
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {key!r}")
            elif isinstance(extra, Mapping):
                errors += schema_errors(item, extra, f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            errors.append(f"{path}: does not match /{schema['pattern']}/")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: above the maximum {schema['maximum']}")
    return errors


def parse_json(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` when ``text`` (surrounding whitespace allowed) is one JSON value, else ``(None, why)``.
    ``NaN`` and ``Infinity`` are not JSON and are refused."""

    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse), None
    except (ValueError, RecursionError) as exc:
        return None, f"not JSON: {exc}"[:200]


def is_valid(text: str, schema: Mapping) -> bool:
    """True when ``text`` parses as JSON (:func:`parse_json`) and matches ``schema``."""
    value, why = parse_json(text)
    return why is None and not schema_errors(value, schema)
