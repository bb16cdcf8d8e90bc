"""The ``NAME[:key=value...]`` option syntax shared by method specs, benchmark baselines and KV policies.

:func:`split_spec` splits a spec into its name and raw ``key=value`` strings; a :class:`Key` declares one option
(its type and a doc line) and converts the raw string: ``int``, ``float``, ``str``, ``bool`` (1/0, true/false,
yes/no, on/off) or ``list[T]`` (values separated by ``/``).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NO_DEFAULT", "Key", "split_spec"]

NO_DEFAULT: Any = inspect.Parameter.empty
"""Marks a key whose default is unknown to the registry (the factory decides)."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Key:
    """One option: ``type`` converts the spec's string (``list[T]`` splits on ``/``), ``doc`` says what it does,
    ``default`` is for help texts only (the factory applies its own)."""

    type: Any
    doc: str
    default: Any = NO_DEFAULT

    def type_name(self) -> str:
        if typing.get_origin(self.type) is list:
            (item,) = typing.get_args(self.type) or (str,)
            return f"{item.__name__}/{item.__name__}/..."
        return getattr(self.type, "__name__", str(self.type))

    def convert(self, owner: str, key: str, value: Any, kind: str = "method") -> Any:
        """Convert a string value (``owner``, ``kind`` word the error: "option 'k' of method 'chain'"); values of
        other types (from Python callers) are passed as given and left to the factory to validate."""
        if not isinstance(value, str):
            return value
        try:
            if typing.get_origin(self.type) is list:
                (item,) = typing.get_args(self.type) or (str,)
                if not value.strip():
                    raise ValueError("empty list")
                return [_convert_scalar(item, part) for part in value.split("/")]
            return _convert_scalar(self.type, value)
        except ValueError:
            raise ValueError(
                f"bad value {value!r} for option {key!r} of {kind} {owner!r}: expected {self.type_name()}"
            ) from None


def _convert_scalar(typ: Any, text: str) -> Any:
    text = text.strip()
    if typ is bool:
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(text)
    if typ is str:
        return text
    return typ(text)  # int("2.5") and float("x") raise ValueError


def split_spec(spec: str, kind: str, known: Sequence[str]) -> tuple[str, dict[str, str]]:
    """``NAME[:key=value...]`` -> ``(name, {key: raw string value})`` (``kind`` and ``known`` only word the errors).
    Raises a one-line ValueError for an empty spec, a malformed ``key=value`` or a repeated key; the caller checks
    the name and converts the values."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty {kind} spec; known {kind}s: {', '.join(known)}")
    name, *parts = [p.strip() for p in spec.strip().split(":")]
    raw: dict[str, str] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"bad {kind} option {part!r} in {spec!r}: expected key=value")
        if key in raw:
            raise ValueError(f"option {key!r} given twice in {spec!r}")
        raw[key] = value
    return name, raw
