"""Tool calls (OpenAI's ``tools`` / ``tool_choice``) in the model's own format: the tools checked, the format read
from the chat template, a grammar that forces a call, and calls parsed back out of generated text.

The chat template renders the tools itself (``tokenizer.apply_chat_template(messages, tools=...)``), so the model
sees them as it was trained to. The format speculant reads and writes is Qwen2.5's and Hermes' (``<tool_call>``
blocks of JSON, one per call, separated by a newline)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`tool_format` finds it in a tokenizer's chat template (a ValueError ``model's chat template has no tool
format`` otherwise). :func:`tool_constraint` turns ``tool_choice`` ``required`` or a named function (with
``parallel_tool_calls``) into an llguidance Lark grammar with each function's parameters inlined as ``%json``, as a
``response_format``-like dict ``{"type": "grammar", "grammar": ...}``; where the markers are tokens of their own
(Qwen2.5's ``<tool_call>`` is an added token, id 151657) the grammar names those tokens (``<[151657]>``), so the
constrained model writes the very tokens it was trained on. :class:`ToolCallParser` reads generated text as it
streams (or :func:`parse_tool_calls`, all at once): content, and OpenAI ``tool_calls`` items ``{"id":
"call_...", "type": "function", "function": {"name", "arguments": "<JSON string>"}}``. A block that is no valid call
of a given tool (bad JSON, an unknown name) stays content.
"""

from __future__ import annotations

import contextlib
import json
import re
import weakref
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NO_TOOL_FORMAT", "ParsedReply", "ToolCallParser", "ToolFormat", "ToolSpecError", "check_tool_choice",
           "check_tools", "parse_tool_calls", "schema_error", "tool_call_id", "tool_constraint", "tool_format"]

NO_TOOL_FORMAT = "model's chat template has no tool format"
"""The message of the ValueError for a tokenizer whose chat template renders no tools (or not as ``<tool_call>``
blocks)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
_PROBE = "speculant_probe_tool_7f3a"  # a function name no template writes by itself
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""llguidance's JSON options in every grammar: the spacing of Python's ``json.dumps`` (and of the templates'
``tojson``), so the model writes the JSON as its template showed it, with no room for runaway whitespace."""


class ToolSpecError(ValueError):
    """A bad ``tools``, ``tool_choice`` or tool message; ``param`` names the field at fault
    (``tools[0].function.parameters``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------------------------- requests


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def schema_error(schema: Any, lenient: bool = False) -> str | None:
    """Why llguidance cannot compile JSON schema ``schema`` (one line), or None when it can (or when llguidance is
    not installed: the constraint's own compilation says so then). ``lenient``: keywords llguidance does not
    implement (``not``, an unknown ``format``) are skipped rather than refused."""
    try:
        import llguidance
    except ImportError:
        return None
    options = {"x-guidance": {"lenient": True}} if lenient else {}
    grammar = llguidance.LLMatcher.grammar_from_lark("start: %json" + json.dumps({**schema, **options}))
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not failed:
        return None
    lines = []
    for line in (messages[0] if messages else "the schema does not compile").split("\n"):
        if re.match(r"^\s*\d+ \|", line):  # the grammar's source quoted from here on
            break
        if line.strip() and line.strip() != "^" and not set(line.strip()) <= {"^"}:
            lines.append(line.strip())
    return re.sub(r"^at \d+\(\d+\): ", "", " ".join(lines))


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools`` checked: an array of ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}`` with distinct names of ``[A-Za-z0-9_-]{1,64}`` and parameters an object schema
    llguidance compiles (``strict`` absent or true: a keyword llguidance does not implement is refused; false: it is
    skipped). Returns the tools as the template takes them (``parameters`` defaults to the schema of
    ``{}``). Raises :class:`ToolSpecError` naming the field."""
    if not isinstance(tools, list):
        raise ToolSpecError("tools", f"'tools' must be an array of function tools, got {_kind(tools)}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolSpecError(where, f"'{where}' must be an object {{\"type\": \"function\", \"function\": "
                                       f"{{...}}}}, got {_kind(tool)}")
        if tool.get("type") != "function":
            raise ToolSpecError(f"{where}.type", f"'{where}.type' must be 'function' (the only tool type served), "
                                                 f"got {json.dumps(tool.get('type'))[:40]}")
        for key in tool:
            if key not in ("type", "function"):
                raise ToolSpecError(f"{where}.{key[:40]}", f"'{where}.{key[:40]}' is not a field of a function tool")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolSpecError(f"{where}.function", f"'{where}.function' must be an object, got {_kind(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSpecError(f"{where}.function.name", f"'{where}.function.name' must be 1 to 64 letters, "
                                                          f"digits, '_' or '-', got {json.dumps(name)[:60]}")
        if name in seen:
            raise ToolSpecError(f"{where}.function.name", f"two tools are named '{name}'")
        seen.add(name)
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                raise ToolSpecError(f"{where}.function.{key[:40]}",
                                    f"'{where}.function.{key[:40]}' is not a field of a function (name, "
                                    "description, parameters, strict)")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolSpecError(f"{where}.function.description", f"'{where}.function.description' must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolSpecError(f"{where}.function.strict", f"'{where}.function.strict' must be a boolean")
        params = fn.get("parameters")
        if params is None:  # no arguments: exactly {}
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSpecError(f"{where}.function.parameters", f"'{where}.function.parameters' must be a JSON "
                                                                "schema of an object ({\"type\": \"object\", ...})")
        problem = schema_error(params, lenient=fn.get("strict") is False)
        if problem is not None:
            raise ToolSpecError(f"{where}.function.parameters",
                                f"'{where}.function.parameters' is not a JSON schema this server can follow: "
                                f"{problem[:300]}")
        out.append({"type": "function", "function": {**{k: v for k, v in fn.items() if v is not None},
                                                     "parameters": params}})
    return out


def check_tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """OpenAI's ``tool_choice`` as ``"none"``, ``"auto"``, ``"required"`` or the name of the function to call
    (``{"type": "function", "function": {"name": ...}}``); absent: ``"auto"`` with tools, ``"none"`` without.
    Raises :class:`ToolSpecError` (a name no tool has, a call asked for with no tools, a malformed value)."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolSpecError("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": "
                                               f"\"function\", \"function\": {{\"name\": ...}}}}, got "
                                               f"{json.dumps(choice)[:60]}")
        if choice == "required" and not tools:
            raise ToolSpecError("tool_choice", "'tool_choice' is 'required' but no 'tools' were given")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise ToolSpecError("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": "
                                           "\"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        shown = ", ".join(names) if names else "none"
        raise ToolSpecError("tool_choice.function.name", f"'tool_choice' names the function "
                                                         f"'{fn['name'][:64]}', which is not among the tools "
                                                         f"({shown[:200]})")
    return fn["name"]


def tool_call_id() -> str:
    """A fresh call id in OpenAI's shape: ``call_`` and 24 random letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


# ---------------------------------------------------------------------------------------------- the model's format


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool-call format: the text that opens and closes a call and, when each is one token of the
    tokenizer's own (an added token), that token's id (the grammar then names the token, not its spelling)."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    open_id: int | None = None
    close_id: int | None = None
    separator: str = "\n"  # between two calls, and around a call's JSON

    def marker(self, which: str) -> str:
        """The Lark terminal of the opening (``"open"``) or closing marker: its token (``<[id]>``) or its text."""
        token = self.open_id if which == "open" else self.close_id
        return f"<[{token}]>" if token is not None else json.dumps(self.open if which == "open" else self.close)


def _template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one for tools first
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def _own_token(tokenizer, text: str) -> int | None:
    """The id of ``text`` when the tokenizer has it as one added token, else None."""
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if str(token) == text:
            return int(token_id)
    return None


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> ToolFormat, or the error's message


def tool_format(tokenizer) -> ToolFormat:
    """The tool-call format of ``tokenizer``'s chat template: Qwen2.5 / Hermes ``<tool_call>`` blocks, with the
    ids of the markers where they are added tokens.

    Raises:
        ValueError: :data:`NO_TOOL_FORMAT` when the template does not render tools (a probe tool's name does not
            reach the prompt) or writes no ``<tool_call>`` blocks; also when the markers are special tokens that
            decoding drops (their text would never reach the parser).
    """
    try:
        found = _FOUND.get(tokenizer)
    except TypeError:  # not weakly referenceable: no cache
        found = None
    if found is None:
        try:
            found = _find_format(tokenizer)
        except ValueError as exc:
            found = str(exc)
        with contextlib.suppress(TypeError):
            _FOUND[tokenizer] = found
    if isinstance(found, str):
        raise ValueError(found)
    return found


def _find_format(tokenizer) -> ToolFormat:
    source = _template_source(tokenizer)
    fmt = ToolFormat()
    if not source or fmt.open not in source:
        raise ValueError(NO_TOOL_FORMAT)
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001: a template that cannot render tools has no tool format
        raise ValueError(NO_TOOL_FORMAT) from None
    if _PROBE not in text:
        raise ValueError(NO_TOOL_FORMAT)
    open_id, close_id = _own_token(tokenizer, fmt.open), _own_token(tokenizer, fmt.close)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token in (open_id, close_id):
        if token is not None and getattr(decoder.get(token), "special", False):
            raise ValueError(f"{NO_TOOL_FORMAT} this server can read: its tool-call markers are special tokens, "
                             "which decoding drops from the text")
    return ToolFormat(open_id=open_id, close_id=close_id)


# ---------------------------------------------------------------------------------------------- the constraint


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    style = {**_JSON_STYLE, "lenient": True} if fn.get("strict") is False else _JSON_STYLE
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": style}


def tool_constraint(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool = True,
                    answer_schema: Mapping[str, Any] | None = None) -> dict[str, str] | None:
    """The ``response_format``-like constraint (``{"type": "grammar", "grammar": <llguidance Lark>}``) of a
    ``tool_choice``: ``"required"`` (one call of any tool, or several with ``parallel``), a function's name (one
    call of it), ``"auto"`` with ``answer_schema`` (either calls or a JSON answer of that schema: the
    ``response_format`` of a request with tools); None when nothing is forced (``"none"``; ``"auto"`` alone).
    ``tools`` are :func:`check_tools`'s."""
    if choice == "none" or (choice == "auto" and answer_schema is None):
        return None
    chosen = [t for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    rules = [f"fn{i}: %json{json.dumps(_call_schema(t))}" for i, t in enumerate(chosen)]
    sep = json.dumps(fmt.separator)
    lines = [
        "start: calls" + (" | answer" if choice == "auto" else ""),
        f"calls: call ({sep} call)*" if parallel and choice in ("auto", "required") else "calls: call",
        f"call: {fmt.marker('open')} {sep} ({' | '.join(f'fn{i}' for i in range(len(chosen)))}) {sep} "
        f"{fmt.marker('close')}",
        *rules,
    ]
    if choice == "auto":
        lines.append(f"answer: %json{json.dumps(dict(answer_schema))}")
    return {"type": "grammar", "grammar": "\n".join(lines) + "\n"}


# ---------------------------------------------------------------------------------------------- parsing


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
"""The head of a call's JSON up to its arguments object: ``{"name": "f", "arguments": `` (group 1: the name)."""


def _call(body: str, names: set[str] | None) -> tuple[str, str] | None:
    """``(name, arguments as a JSON string)`` of one block's JSON, or None when it is no valid call (not JSON, not
    ``{"name": str, "arguments": object}``, a name not in ``names``). The arguments are the model's own text where
    the call is written name first (as templates show it), else the object dumped again."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    head = _HEAD.match(body)
    if head is not None and "arguments" in obj:
        _, end = json.JSONDecoder().raw_decode(body, head.end())
        return obj["name"], body[head.end():end]
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (held back: the marker may be coming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallParser:
    """Reads a reply's text as it streams: :meth:`feed` a piece, get what is ready to send as a list of
    ``("content", text)`` and ``("tool_call", item)`` (``item``: an OpenAI ``tool_calls`` entry with its
    ``index``); :meth:`finish` once the reply ended. A call goes out whole once its closing marker arrives (or at
    the end, if its JSON is complete); a block that is no valid call goes out as content. Whitespace next to a call
    is not content; a reply without calls is content exactly as generated.

    ``incremental`` (for a forced call, which a grammar keeps valid): a call goes out as OpenAI streams it, a first
    item with its ``id``, ``type``, ``function.name`` and empty ``function.arguments`` once the name is written,
    then items ``{"index", "function": {"arguments": piece}}`` as the arguments come."""

    fmt: ToolFormat
    names: set[str] | None = None  # the tools' names (None: any name)
    incremental: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False
    _space: str = ""  # whitespace held after content: sent only if more content follows
    _live: dict[str, Any] | None = None  # the call going out piece by piece (incremental)
    _args_at: int = 0  # where its arguments begin in _buf
    _scanned: int = 0  # characters of its arguments read (and sent)
    _depth: int = 0  # the arguments' JSON nesting at _scanned
    _quoted: bool = False  # inside a JSON string there
    _escaped: bool = False  # after a backslash in it

    def _live_call(self, limit: int) -> list[tuple[str, Any]]:
        """Incremental: the call's first item once its head is written, then its arguments read so far (within
        ``_buf[:limit]``)."""
        out: list[tuple[str, Any]] = []
        if self._live is None:
            head = _HEAD.match(self._buf)
            if head is None:
                return out
            try:
                name = json.loads('"' + head.group(1) + '"')
            except ValueError:  # a bad escape: not a call
                return out
            if self.names is not None and name not in self.names:
                return out
            self._space = ""
            self._live = {"index": len(self.calls), "id": tool_call_id(), "type": "function",
                          "function": {"name": name, "arguments": ""}}
            self.calls.append(self._live)
            self._args_at, self._scanned, self._depth, self._quoted, self._escaped = head.end(), 0, 0, False, False
            out.append(("tool_call", {**self._live, "function": {"name": name, "arguments": ""}}))
        start = self._args_at + self._scanned
        end = start
        while end < limit and not (self._depth == 0 and self._scanned + end - start > 0):
            ch = self._buf[end]
            if self._escaped:
                self._escaped = False
            elif self._quoted:
                self._quoted, self._escaped = ch != '"', ch == "\\"
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
            elif ch == '"':
                self._quoted = True
            end += 1
        piece = self._buf[start:end]
        self._scanned += len(piece)
        if piece:
            self._live["function"]["arguments"] += piece
            out.append(("tool_call", {"index": self._live["index"], "function": {"arguments": piece}}))
        return out

    def _text(self, text: str) -> list[tuple[str, Any]]:
        """Content ``text``, its trailing whitespace held back."""
        if not text:
            return []
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        out = self._space + body
        self._space = text[len(body):]
        return [("content", out)]

    def _close(self, body: str, closed: bool) -> list[tuple[str, Any]]:
        if self._live is not None:  # sent already, as it came
            self._live = None
            return []
        found = _call(body.strip(), self.names)
        if found is None:
            return self._text(self.fmt.open + body + (self.fmt.close if closed else ""))
        self._space = ""  # whitespace before a call is not content
        item = {"index": len(self.calls), "id": tool_call_id(), "type": "function",
                "function": {"name": found[0], "arguments": found[1]}}
        self.calls.append(item)
        return [("tool_call", item)]

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        """What ``piece`` (the next text of the reply) makes ready to send."""
        self._buf += piece
        out: list[tuple[str, Any]] = []
        while True:
            if self._in_call:
                at = self._buf.find(self.fmt.close)
                if self.incremental:
                    out += self._live_call(len(self._buf) if at < 0 else at)
                if at < 0:
                    return out
                body, self._buf = self._buf[:at], self._buf[at + len(self.fmt.close):]
                self._in_call = False
                out += self._close(body, closed=True)
            else:
                at = self._buf.find(self.fmt.open)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.fmt.open)
                    ready = self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(ready):]
                    return out + self._text(ready)
                out += self._text(self._buf[:at])
                self._buf = self._buf[at + len(self.fmt.open):]
                self._in_call = True

    def finish(self) -> list[tuple[str, Any]]:
        """What is left once the reply ended: an unclosed call (a call if its JSON is complete, else content) or
        held text; whitespace held after content goes out only when no call was made."""
        out: list[tuple[str, Any]] = []
        if self._in_call:
            out += self._close(self._buf, closed=False)
        else:
            out += self._text(self._buf)
        self._buf, self._in_call = "", False
        if self._space and not self.calls:
            out.append(("content", self._space))
        self._space = ""
        return out


@dataclass
class ParsedReply:
    """A whole reply: its content (None when the reply is calls only) and its OpenAI ``tool_calls`` items."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_tool_calls(text: str, fmt: ToolFormat, names: set[str] | None = None) -> ParsedReply:
    """``text`` (a whole reply) as content and tool calls, exactly as :class:`ToolCallParser` streams them."""
    parser = ToolCallParser(fmt, names)
    events = parser.feed(text) + parser.finish()
    content = "".join(v for kind, v in events if kind == "content")
    calls = [{k: v for k, v in item.items() if k != "index"} for kind, item in events if kind == "tool_call"]
    return ParsedReply(content if content or not calls else None, calls)
