"""``response_format`` -> a compiled grammar: OpenAI's shapes (``text``, ``json_object``, ``json_schema``) and two
more (``regex``, ``grammar``: an llguidance Lark grammar, which may embed JSON Schemas as ``%json{...}``).

Compiling checks everything it can before a generation starts: a schema llguidance cannot enforce (an unknown type
or format, an unsatisfiable bound, a keyword it does not implement) is a ValueError naming the problem, never
silently ignored; ``"strict": false`` in a ``json_schema`` lets llguidance skip keywords it does not implement, each
one logged as a warning. A grammar that allows no output at all is refused too. Compiled formats are cached per
tokenizer and spec; each generation gets a fresh matcher (:meth:`CompiledFormat.constraint`).
"""

from __future__ import annotations

import json
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .guidance import GuidanceConstraint

__all__ = ["FORMAT_TYPES", "CompiledFormat", "compile_response_format"]

log = logging.getLogger(__name__)

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
"""The ``type`` values :func:`compile_response_format` accepts."""

_CACHE_SIZE = 64
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> llguidance tokenizer
_compiled: OrderedDict[tuple[int, str], CompiledFormat] = OrderedDict()  # (tokenizer id, spec) -> compiled


@dataclass
class CompiledFormat:
    """A compiled ``response_format``: ``kind`` (one of :data:`FORMAT_TYPES`), the llguidance ``grammar`` (None for
    ``text``) and the warnings compiling gave (keywords ``strict: false`` let it skip)."""

    kind: str
    grammar: str | None = None
    warnings: list[str] = field(default_factory=list)
    _matcher: Any = field(default=None, repr=False)  # a pristine LLMatcher, deep-copied per generation
    _ll_tokenizer: Any = field(default=None, repr=False)

    def constraint(self) -> GuidanceConstraint | None:
        """A fresh :class:`~speculant.core.constraint.Constraint` for one generation (None for ``text``)."""
        if self._matcher is None:
            return None
        return GuidanceConstraint(self._matcher.deep_copy(), self._ll_tokenizer)


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of a Hugging Face fast ``tokenizer`` (built once per tokenizer object)."""
    try:
        return _tokenizers[tokenizer]
    except (KeyError, TypeError):
        pass
    import llguidance.hf

    try:
        built = llguidance.hf.from_tokenizer(tokenizer)
    except ValueError as e:
        raise ValueError(f"response_format needs a fast Hugging Face tokenizer: {e}") from None
    try:
        _tokenizers[tokenizer] = built
    except TypeError:  # not weakly referable: built again next time
        pass
    return built


def compile_response_format(response_format: dict, tokenizer) -> CompiledFormat:
    """Compile ``response_format`` for ``tokenizer`` (a fast Hugging Face tokenizer). Accepted shapes:

    * ``{"type": "text"}``: no constraint;
    * ``{"type": "json_object"}``: any JSON object;
    * ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}``: JSON valid against
      the schema (``strict`` absent or true: a keyword llguidance does not implement is an error; false: skipped,
      with a logged warning);
    * ``{"type": "regex", "pattern": "..."}``: text matching the regular expression (whole);
    * ``{"type": "grammar", "grammar": "..."}``: text of an llguidance Lark grammar (``start`` rule; JSON Schemas
      inline as ``%json{...}``).

    Raises a one-line ValueError naming the problem (a bad shape, a bad schema, regex or grammar, an unsupported
    keyword, a grammar with no possible output)."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be a dict such as {{'type': 'json_object'}}, got "
                         f"{type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in FORMAT_TYPES:
        raise ValueError(f"response_format type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r:.60}")
    if kind == "text":
        return CompiledFormat("text")
    try:
        spec = json.dumps(response_format, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"response_format is not JSON-serialisable: {e}") from None
    lt = ll_tokenizer(tokenizer)
    key = (id(lt), spec)
    hit = _compiled.get(key)
    if hit is not None:
        _compiled.move_to_end(key)
        return hit
    grammar = _grammar(kind, response_format)
    compiled = _compile(kind, grammar, lt)
    _compiled[key] = compiled
    while len(_compiled) > _CACHE_SIZE:
        _compiled.popitem(last=False)
    return compiled


WHITESPACE = r"[ \t]{0,8}(\r?\n[ \t]{0,48})?"
"""The whitespace JSON may hold between two tokens of its syntax: a few spaces, or one line break and an indentation
of up to 48 columns (pretty-printed JSON fits). JSON's own grammar allows any amount, and a small model decoding
under it can emit spaces until its token budget ends (seen with Qwen2.5-Coder-1.5B after ``"default":``), an answer
that never parses; bounded, every position must soon move on. A schema's own ``x-guidance`` whitespace options
(llguidance's) replace it."""


def _grammar(kind: str, rf: dict) -> str:
    """The llguidance grammar (JSON text) of a checked ``response_format`` of type ``kind``."""
    from llguidance import LLMatcher

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides={"whitespace_pattern": WHITESPACE})
    if kind == "json_schema":
        body = rf.get("json_schema")
        if not isinstance(body, dict):
            raise ValueError("response_format json_schema needs a 'json_schema' object: {'name': ..., 'schema': "
                             "{...}, 'strict': true}")
        schema = body.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"response_format json_schema.schema must be a JSON Schema object, got "
                             f"{type(schema).__name__}")
        strict = body.get("strict", True)
        if not isinstance(strict, bool):
            raise ValueError(f"response_format json_schema.strict must be true or false, got {strict!r:.40}")
        try:
            own = isinstance(schema, dict) and isinstance(schema.get("x-guidance"), dict) and any(
                "whitespace" in k for k in schema["x-guidance"])  # the schema's own whitespace rule wins
            overrides = {**({} if own else {"whitespace_pattern": WHITESPACE}), **({} if strict else {"lenient": True})}
            return LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
        except ValueError as e:
            raise ValueError(f"response_format json_schema: {_one_line(str(e))}") from None
    field_name = "pattern" if kind == "regex" else "grammar"
    text = rf.get(field_name)
    if not isinstance(text, str):
        raise ValueError(f"response_format {kind} needs a '{field_name}' string")
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if not text.strip():
        raise ValueError("response_format grammar is empty: give a Lark grammar with a start rule")
    return LLMatcher.grammar_from_lark(text)


def _compile(kind: str, grammar: str, lt) -> CompiledFormat:
    """Validate ``grammar`` for ``lt``, build its matcher and refuse one that allows no output."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lt)
    if is_error:
        raise ValueError(f"response_format {kind}: {_one_line(messages[0] if messages else 'invalid grammar')}")
    for message in messages:
        log.warning("response_format %s: %s", kind, _one_line(message))
    matcher = LLMatcher(lt, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"response_format {kind}: {_one_line(matcher.get_error())}")
    probe = GuidanceConstraint(matcher.deep_copy(), lt)
    probe.begin(lt.vocab_size, set())
    if not probe.mask_after([]).any() and not matcher.is_accepting():
        raise ValueError(f"response_format {kind}: the grammar allows no output at all")
    return CompiledFormat(kind, grammar, list(messages), matcher, lt)


def _one_line(text: str) -> str:
    """A message on one line, at most 300 characters."""
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:297] + "..."
