"""Checking an answer to a structured request: a record with ``response_format`` (``builtin:json-extract``, or
any JSONL record that carries one) or with ``tools`` (``builtin:tools``).

:func:`check_answer` gives ``{"valid", "exact", "errors"}``: ``valid`` is what the request requires (the text
parses as JSON and matches the schema, :func:`speculant.data.json_extract.answer_report`; or at least one tool
call and every call names an offered tool with arguments that match its parameters,
:func:`speculant.data.tools.tool_calls_report`), ``exact`` whether it equals the record's ``reference`` or
``expected`` call (None when it has none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .json_extract import answer_report
from .tools import tool_calls_report

__all__ = ["check_answer", "is_structured", "structured_kind"]


def structured_kind(record: Mapping) -> str | None:
    """``"tools"`` for a record with ``tools``, ``"json"`` for one with a JSON ``response_format``
    (``json_object`` or ``json_schema``), else None."""
    if record.get("tools"):
        return "tools"
    fmt = record.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") in ("json_object", "json_schema"):
        return "json"
    return None


def is_structured(record: Mapping) -> bool:
    """True when :func:`check_answer` can check an answer to ``record``."""
    return structured_kind(record) is not None


def check_answer(record: Mapping, text: str, tool_calls: Sequence[Any] | None = None) -> dict | None:
    """How ``text`` (and, for a tools record, the reply's ``tool_calls``: OpenAI's ``function`` objects
    ``{"name", "arguments"}``, or whole tool calls with a ``function``) answers ``record``; None for a record that
    is not structured (module doc)."""
    kind = structured_kind(record)
    if kind == "json":
        return answer_report(text, record)
    if kind == "tools":
        calls = [c.get("function", c) if isinstance(c, Mapping) else c for c in tool_calls or []]
        return tool_calls_report(calls, record)
    return None
