"""The OpenAI request bodies the server accepts, checked field by field, and the OpenAI error body.

A request is parsed from raw bytes (not by FastAPI's model validation) so that every mistake gets OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the field, and HTTP 400:
malformed JSON, a body that is not an object, a field of the wrong type or out of range, a field the server does
not know (OpenAI answers "Unrecognized request argument" too), and a known OpenAI field that asks for something
the server does not do (``n`` > 1, penalties ...). Those known fields are accepted when they carry their
neutral value (``n: 1``, ``frequency_penalty: 0``, ``user: "..."``), since OpenAI clients often send them.

Log-probabilities: chat takes ``logprobs: true`` and ``top_logprobs`` (0 to :data:`MAX_TOP_LOGPROBS`, which needs
``logprobs: true``, as OpenAI); completions take ``logprobs: K`` (0 to :data:`MAX_TOP_LOGPROBS`). Both become
:attr:`GenerationRequest.logprobs` (the number of alternatives per token; None: off), shaped by
:mod:`speculant.serve.logprobs`.

Defaults follow OpenAI's API: ``temperature`` 1.0, ``top_p`` 1.0; ``max_tokens`` 16 on ``/v1/completions`` and
the rest of the context on ``/v1/chat/completions``. ``top_k``, ``ignore_eos`` and ``return_token_ids`` (the
prompt's and the completion's token ids in the response) are vLLM's extensions. ``speculant_sources`` (speculant's,
streaming only) adds to each chunk how its text came: ``"speculant": {"sources": [[chars, "draft" | "target"],
...], "tokens": n, "accepted": a}`` (the web page colours accepted draft tokens with it);
``speculant_speculation`` (``auto``, ``on``, ``off``) sets this request's speculation over the server's
``--speculation`` (``speculant bench serve --speculation`` compares them on one server).

Tools and structured outputs (chat): ``tools`` (function tools), ``tool_choice`` (``none``, ``auto``,
``required``, ``{"type": "function", "function": {"name"}}``) and ``parallel_tool_calls`` are checked by
:mod:`speculant.structured.tool_calls`; assistant messages may carry ``tool_calls`` (their ``arguments`` strings
are parsed to objects, as templates render them) and ``tool`` messages a ``tool_call_id``. ``response_format``
(``text``, ``json_object``, ``json_schema``, and speculant's ``regex`` and ``grammar``) is checked in shape here;
its schema compiles once the tokenizer is known.

Fill-in-the-middle: ``/v1/completions`` takes OpenAI's legacy ``suffix`` (with a text ``prompt``; chat refuses
it), and :func:`parse_infill_request` reads llama.cpp's ``/infill`` body with llama.cpp's field names and
defaults.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["APIError", "GenerationRequest", "COMPLETION_MAX_TOKENS", "INFILL_DEFAULTS", "MAX_TOP_LOGPROBS",
           "error_body", "parse_body", "parse_chat_request", "parse_completion_request", "parse_infill_request"]

COMPLETION_MAX_TOKENS = 16
"""``max_tokens`` of a ``/v1/completions`` request that gives none (OpenAI's legacy default)."""

MAX_STOPS = 16
"""At most this many stop strings per request."""

MAX_TOP_LOGPROBS = 20
"""At most this many alternatives per token in ``top_logprobs`` (chat) or ``logprobs`` (completions): OpenAI's
limit for chat."""

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered with OpenAI's body: HTTP ``status``, ``message``, ``type``, ``param`` (the field at
    fault, or None) and ``code``; ``headers`` go on the response."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # extra response headers (429: Retry-After)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


CLIP = 80
"""At most this many characters of a client's value are echoed back in an error message."""


def clip(text: str, limit: int = CLIP) -> str:
    """``text`` cut to ``limit`` characters (with ``...`` when cut): a client's value quoted in an error, so that a
    5 MB model name is not answered with 5 MB."""
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class GenerationRequest:
    """A checked request. ``messages`` (chat) or ``prompt`` (a string or token ids, completions) is set;
    ``max_tokens`` None means "the rest of the context" (resolved once the prompt is tokenised)."""

    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict[str, Any]] | None = None  # contents: text, or text and image parts (protocol._content)
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False
    sources: bool = False  # speculant_sources: per chunk, which characters were accepted draft tokens
    speculation: str | None = None  # speculant_speculation: this request's auto / on / off (None: the server's)
    logprobs: int | None = None  # alternatives per token to report (0: the emitted token's only); None: off
    max_tokens_param: str = "max_tokens"  # the field that set max_tokens (for errors)
    suffix: str | None = None  # fill-in-the-middle: the text after the cursor (``prompt``: the text before it)
    extra: list[dict[str, str]] | None = None  # fill-in-the-middle: repository files {"filename", "text"}
    tools: list[dict[str, Any]] | None = None  # checked function tools (structured.tool_calls.check_tools)
    tool_choice: str = "none"  # "none" | "auto" | "required" | the name of the function to call
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # None: text; else json_object / json_schema / regex / grammar


# ---------------------------------------------------------------------------------------------- JSON


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: json reads it as inf
        raise APIError(400, f"the number {clip(text, 40)} in the request body is out of range (beyond what a "
                            "64-bit float holds)", code="invalid_value")
    return value


def _check_text(body: Any) -> None:
    """APIError 400 naming the field when a string (a value or a key) holds a lone surrogate (``"\\ud800"``: JSON
    escapes can spell one, but it is no Unicode text and no tokenizer takes it)."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:  # iterative: the body may be nested as deeply as json allows
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold one too
                raise APIError(400, f"'{where or 'the request body'}' holds an unpaired surrogate "
                                    f"({value[exc.start]!r} at character {exc.start}), which is not valid Unicode "
                                    "text", param=where or None, code="invalid_value") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{clip(key, 40)}" if where else clip(key, 40)
                stack.append((key, path))
                stack.append((item, path))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or APIError 400 (not UTF-8, not JSON, NaN/Infinity, a number beyond
    float64 such as ``1e400``, a lone surrogate in a string, too deeply nested, or not an object)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    if not text.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}", code="invalid_json")
    _check_text(body)
    return body


def _kind(value: Any) -> str:
    """The JSON type name of ``value`` (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ---------------------------------------------------------------------------------------------- scalars


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(body: Mapping, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise _bad(name, f"'{name}' must be a number, got {_kind(v)}", "invalid_type")
    # compared before any float(): an integer of 400 digits is out of range, not an OverflowError
    if not (isinstance(v, int) or math.isfinite(v)) or v < lo or v > hi or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(name, f"'{name}' must be in {interval}, got {clip(str(v), 40)}")
    return float(v)


def _int(body: Mapping, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(name, f"'{name}' must be an integer, got {_kind(v)}", "invalid_type")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(name, f"'{name}' must be an integer {bound}, got {clip(str(v), 40)}")
    return v


def _speculation(body: Mapping) -> str | None:
    v = body.get("speculant_speculation")
    if v is not None and v not in ("auto", "on", "off"):
        raise _bad("speculant_speculation", f"'speculant_speculation' must be 'auto', 'on' or 'off', got "
                   f"{clip(json.dumps(v))}", "invalid_value")
    return v


def _bool(body: Mapping, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_kind(v)}", "invalid_type")
    return v


def _same(a: Any, b: Any) -> bool:
    """JSON equality that tells booleans from numbers (``0 == False`` in Python, not in JSON)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------------------------- fields

_Neutral = tuple[tuple[Any, ...], str]
"""(values meaning "nothing asked for", what the server does not support)."""

_COMMON_NEUTRAL: dict[str, _Neutral] = {
    "n": ((None, 1), "one choice per request (n = 1)"),
    "frequency_penalty": ((None, 0), "no frequency penalty"),
    "presence_penalty": ((None, 0), "no presence penalty"),
    "repetition_penalty": ((None, 1), "no repetition penalty"),
    "logit_bias": ((None, {}), "no logit bias"),
    "min_p": ((None, 0), "no min-p filter"),
    "min_tokens": ((None, 0), "no min_tokens"),
    "stop_token_ids": ((None, []), "no stop_token_ids (use 'stop' strings)"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the text"),
    "include_stop_str_in_output": ((None, False), "stop strings are always trimmed from the output"),
    "store": ((None, False), "nothing is stored"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
}
_CHAT_NEUTRAL: dict[str, _Neutral] = {
    "functions": ((None, []), "no functions"),
    "function_call": ((None, "none", "auto"), "no functions"),
    "modalities": ((None, ["text"]), "text output only"),
    "audio": ((None,), "no audio"),
    "prediction": ((None,), "no predicted outputs"),
    "reasoning_effort": ((None,), "no reasoning_effort"),
    "web_search_options": ((None,), "no web search"),
    "verbosity": ((None,), "no verbosity setting"),
    "moderation": ((None,), "no moderation"),
    "prompt_cache_options": ((None,), "no prompt-cache options"),
    "prompt_cache_retention": ((None,), "no prompt-cache retention"),
    "suffix": ((None,), "no suffix on chat (fill-in-the-middle is /v1/completions with 'suffix', or /infill)"),
    "add_generation_prompt": ((None, True), "the assistant's turn is always prompted"),
    "continue_final_message": ((None, False), "a new assistant turn is always started"),
}
_COMPLETION_NEUTRAL: dict[str, _Neutral] = {
    "echo": ((None, False), "echo: false"),
    "best_of": ((None, 1), "best_of = 1"),
}
# fields taken as they are, with no effect on generation (their type is checked)
_FREE: dict[str, Callable[[Any], bool]] = {
    "user": lambda v: v is None or isinstance(v, str),
    "metadata": lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "prompt_cache_key": lambda v: v is None or isinstance(v, str),
    "safety_identifier": lambda v: v is None or isinstance(v, str),
}
_SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                  "ignore_eos", "return_token_ids", "speculant_sources",
                  "speculant_speculation"}
_CHAT_FIELDS = _SHARED_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                 "tool_choice", "parallel_tool_calls", "response_format"}
_COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt", "logprobs", "suffix"}


def _check_fields(body: Mapping, known: set[str], neutral: dict[str, _Neutral]) -> None:
    for name, value in body.items():
        if name in known:
            continue
        if name in neutral:
            allowed, what = neutral[name]
            if not any(_same(value, a) for a in allowed):
                shown = clip(json.dumps(value))
                raise _bad(name, f"'{name}' = {shown} is not supported: this server supports {what}",
                           "unsupported_value")
        elif name in _FREE:
            if not _FREE[name](value):
                raise _bad(name, f"'{name}' has the wrong type ({_kind(value)})", "invalid_type")
        else:
            raise _bad(clip(name, 40), f"Unrecognized request argument supplied: {clip(name)}", "unknown_parameter")


def _stop(body: Mapping) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "'stop' must be a string or an array of strings", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"'stop' has {len(stops)} strings: at most {MAX_STOPS}")
    if any(not s for s in stops):
        raise _bad("stop", "'stop' strings must not be empty")
    return list(dict.fromkeys(stops))


def _stream(body: Mapping) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict):
        raise _bad("stream_options", f"'stream_options' must be an object, got {_kind(options)}", "invalid_type")
    for key, value in options.items():
        if key == "include_usage":
            if value is not None and not isinstance(value, bool):
                raise _bad("stream_options.include_usage", "'stream_options.include_usage' must be a boolean",
                           "invalid_type")
        elif key == "continuous_usage_stats":
            if not (value is None or value is False):
                raise _bad("stream_options.continuous_usage_stats",
                           "'stream_options.continuous_usage_stats' is not supported", "unsupported_value")
        else:
            key = clip(key, 40)
            raise _bad(f"stream_options.{key}", f"Unrecognized request argument supplied: stream_options.{key}",
                       "unknown_parameter")
    return stream, bool(options.get("include_usage"))


def _model(body: Mapping) -> str:
    v = body.get("model")
    if v is None:
        raise _bad("model", "'model' is required (GET /v1/models lists the served model)", "missing_required")
    if not isinstance(v, str) or not v:
        raise _bad("model", f"'model' must be a non-empty string, got {_kind(v)}", "invalid_type")
    return v


def _common(body: Mapping, kind: str) -> dict[str, Any]:
    top_k = body.get("top_k")
    if _is_int(top_k) and top_k in (-1, 0):  # vLLM's spelling of "no top-k filter"
        top_k = None
    else:
        top_k = _int(body, "top_k", 1)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    stream, include_usage = _stream(body)
    return {
        "kind": kind,
        "model": _model(body),
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": None if top_p in (None, 1.0) else top_p,
        "top_k": top_k,
        "seed": _int(body, "seed", _SEED_MIN, _SEED_MAX),
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage,
        "ignore_eos": _bool(body, "ignore_eos"),
        "return_token_ids": _bool(body, "return_token_ids"),
        "sources": _bool(body, "speculant_sources"),
        "speculation": _speculation(body),
    }


# ---------------------------------------------------------------------------------------------- requests


def _content(i: int, content: Any) -> str | list[dict]:
    """A message's content: a string, or an array of ``{"type": "text", "text": ...}`` parts (joined into one
    string) and ``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`` parts (then a list of
    ``{"type": "text", "text"}`` / ``{"type": "image", "data": bytes}`` parts, in order). Only ``data:`` URLs: the
    server never fetches a URL."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                parts.append({"type": "image", "data": _image(f"{where}[{j}]", part.get("image_url"))})
            else:
                shown = kind if kind is not None else _kind(part)
                raise _bad(f"{where}[{j}]", f"'{where}[{j}]' must be a text part {{\"type\": \"text\", \"text\": "
                                            f"...}} or an image part {{\"type\": \"image_url\", ...}} (got "
                                            f"{clip(repr(shown), 40)})", "unsupported_value")
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise _bad(where, f"'{where}' must be a string or an array of text and image parts, got {_kind(content)}",
               "invalid_type")


def _image(where: str, value: Any) -> bytes:
    """The bytes of an ``image_url`` part's ``data:`` URL (base64), or a 400 naming what is wrong."""
    import base64
    import binascii

    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise _bad(f"{where}.image_url.url", f"'{where}.image_url.url' must be a string", "invalid_type")
    head, sep, data = url.partition(",")
    if not url.startswith("data:") or not sep:
        raise _bad(f"{where}.image_url.url", f"'{where}.image_url.url' must be a data: URL (data:image/png;base64,"
                                             f"...): this server never fetches a URL (got {clip(repr(url), 40)})",
                   "unsupported_value")
    if not head.endswith(";base64"):
        raise _bad(f"{where}.image_url.url", f"'{where}.image_url.url' must be base64-encoded (data:...;base64,...)",
                   "unsupported_value")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{where}.image_url.url", f"'{where}.image_url.url' holds invalid base64 data") from None


def _messages(body: Mapping) -> list[dict[str, Any]]:
    v = body.get("messages")
    if v is None:
        raise _bad("messages", "'messages' is required", "missing_required")
    if not isinstance(v, list):
        raise _bad("messages", f"'messages' must be an array, got {_kind(v)}", "invalid_type")
    if not v:
        raise _bad("messages", "'messages' is empty: give at least one message")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"'messages[{i}]' must be an object, got {_kind(m)}", "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(_ROLES)}, got "
                                              f"{json.dumps(role)[:40]}")
        allowed = _MESSAGE_KEYS.get(role, ("role", "content", "name"))
        for key in m:
            if key not in allowed:
                key = clip(key, 40)
                raise _bad(f"messages[{i}].{key}", f"'messages[{i}].{key}' is not supported (a {role} message "
                                                   f"carries {', '.join(allowed)})", "unsupported_value")
        if "name" in m and not isinstance(m["name"], str):
            raise _bad(f"messages[{i}].name", f"'messages[{i}].name' must be a string", "invalid_type")
        message: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls")
        if calls is not None:
            message["tool_calls"] = _tool_calls(i, calls)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise _bad(f"messages[{i}].tool_call_id", f"'messages[{i}].tool_call_id' (a string) is required in a "
                                                          "tool message", "missing_required")
            message["tool_call_id"] = m["tool_call_id"]
        if "content" not in m and not message.get("tool_calls"):
            raise _bad(f"messages[{i}].content", f"'messages[{i}].content' is required", "missing_required")
        content = m.get("content")
        message["content"] = "" if content is None and message.get("tool_calls") else _content(i, content)
        out.append(message)
    return out


_MESSAGE_KEYS = {"assistant": ("role", "content", "name", "tool_calls"),
                 "tool": ("role", "content", "name", "tool_call_id")}
"""The fields a message of each role may carry (any other role: role, content and name)."""


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each call's ``arguments`` (a JSON string) parsed to an object, as
    chat templates render them (``tojson``)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(where, f"'{where}' must be an array, got {_kind(calls)}", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str):
            raise _bad(at, f"'{at}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\"}}}}", "invalid_type")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(f"{at}.function.arguments", f"'{at}.function.arguments' is not valid JSON") from None
        if not isinstance(args, dict):
            raise _bad(f"{at}.function.arguments", f"'{at}.function.arguments' must be a JSON object")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _max_tokens(body: Mapping, chat: bool) -> int | None:
    n = _int(body, "max_tokens", 1)
    if chat:
        m = _int(body, "max_completion_tokens", 1)
        if m is not None and n is not None and m != n:
            raise _bad("max_completion_tokens", "'max_tokens' and 'max_completion_tokens' differ: give one")
        return m if m is not None else n
    return COMPLETION_MAX_TOKENS if n is None else n


def parse_chat_request(body: Mapping) -> GenerationRequest:
    """A ``/v1/chat/completions`` body as a :class:`GenerationRequest`, or APIError 400 naming the field."""
    _check_fields(body, _CHAT_FIELDS, {**_COMMON_NEUTRAL, **_CHAT_NEUTRAL})
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    tools, choice, parallel = _tools(body)
    return GenerationRequest(messages=_messages(body), max_tokens=_max_tokens(body, chat=True),
                             max_tokens_param=param, logprobs=_chat_logprobs(body), tools=tools or None,
                             tool_choice=choice, parallel_tool_calls=parallel,
                             response_format=_response_format(body, tools_forced=choice not in ("none", "auto")),
                             **_common(body, "chat"))


def _tools(body: Mapping) -> tuple[list[dict[str, Any]], str, bool]:
    """``(tools, tool_choice, parallel_tool_calls)`` checked (:mod:`speculant.structured.tool_calls`)."""
    from ..structured.tool_calls import ToolSpecError, check_tool_choice, check_tools

    v = body.get("parallel_tool_calls")
    if v is not None and not isinstance(v, bool):
        raise _bad("parallel_tool_calls", f"'parallel_tool_calls' must be a boolean, got {_kind(v)}", "invalid_type")
    try:
        tools = check_tools(body.get("tools") if body.get("tools") is not None else [])
        choice = check_tool_choice(body.get("tool_choice"), tools)
    except ToolSpecError as exc:
        raise _bad(clip(exc.param, 80), clip(str(exc), 400), "invalid_value") from None
    return tools, choice, v is not False


_FORMATS = {"text": (), "json_object": (), "json_schema": ("json_schema",), "regex": ("pattern",),
            "grammar": ("grammar",)}
"""``response_format`` types and the field each needs (``regex`` and ``grammar``: speculant's, an llguidance
regular expression and Lark grammar)."""


def _response_format(body: Mapping, tools_forced: bool) -> dict[str, Any] | None:
    """``response_format`` checked in shape (None: plain text); its schema, pattern or grammar is compiled once the
    model's tokenizer is known (:func:`speculant.structured.compile_response_format`)."""
    v = body.get("response_format")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("response_format", f"'response_format' must be an object, got {_kind(v)}", "invalid_type")
    kind = v.get("type")
    if kind not in _FORMATS:
        raise _bad("response_format.type", f"'response_format.type' must be one of {', '.join(_FORMATS)}, got "
                                           f"{clip(json.dumps(kind), 40)}", "invalid_value")
    for key in v:
        if key != "type" and key not in _FORMATS[kind]:
            key = clip(key, 40)
            raise _bad(f"response_format.{key}", f"'response_format.{key}' is not a field of a {kind} "
                                                 "response_format", "unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema", "'response_format.json_schema' must be an object {\"name\", "
                                                      "\"schema\", \"strict\"}", "invalid_type")
        if not isinstance(spec.get("schema", {}), dict):
            raise _bad("response_format.json_schema.schema", "'response_format.json_schema.schema' must be a JSON "
                                                             "schema (an object)", "invalid_type")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise _bad("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a "
                                                             "boolean", "invalid_type")
        if spec.get("name") is not None and not isinstance(spec["name"], str):
            raise _bad("response_format.json_schema.name", "'response_format.json_schema.name' must be a string",
                       "invalid_type")
    for name in _FORMATS[kind][:1] if kind in ("regex", "grammar") else ():
        if not isinstance(v.get(name), str):
            raise _bad(f"response_format.{name}", f"'response_format.{name}' (a string) is required with type "
                                                  f"{kind}", "missing_required")
    if tools_forced:
        raise _bad("response_format", "'response_format' and a forced 'tool_choice' ('required' or a function) "
                                      "both constrain the reply: give one", "unsupported_value")
    return dict(v)


def _chat_logprobs(body: Mapping) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0..20, only with ``logprobs: true``, as OpenAI) as
    the number of alternatives per token, or None (off)."""
    on = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not on:
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if on else None


def _prompt(body: Mapping) -> str | list[int]:
    v = body.get("prompt")
    if v is None:
        raise _bad("prompt", "'prompt' is required", "missing_required")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt
    elif isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        raise _bad("prompt", f"'prompt' holds {len(v)} prompts: this server takes one prompt per request",
                   "unsupported_value")
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        return list(v)
    raise _bad("prompt", "'prompt' must be a string or a non-empty array of token ids", "invalid_type")


def parse_completion_request(body: Mapping) -> GenerationRequest:
    """A ``/v1/completions`` body as a :class:`GenerationRequest`, or APIError 400 naming the field. A non-empty
    ``suffix`` (a string) makes it fill-in-the-middle: the text prompt before the cursor, the suffix after it."""
    _check_fields(body, _COMPLETION_FIELDS, {**_COMMON_NEUTRAL, **_COMPLETION_NEUTRAL})
    prompt = _prompt(body)
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise _bad("suffix", f"'suffix' must be a string, got {_kind(suffix)}", "invalid_type")
    if suffix and not isinstance(prompt, str):
        raise _bad("suffix", "'suffix' needs a text 'prompt' (fill-in-the-middle builds the prompt from text), not "
                             "token ids", "unsupported_value")
    return GenerationRequest(prompt=prompt, max_tokens=_max_tokens(body, chat=False),
                             logprobs=_int(body, "logprobs", 0, MAX_TOP_LOGPROBS), suffix=suffix or None,
                             **_common(body, "completion"))


# ---------------------------------------------------------------------------------------------- llama.cpp's /infill

INFILL_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
"""The sampling of an ``/infill`` request that sets none: llama.cpp's defaults."""

_INFILL_FIELDS = {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "stream", "temperature",
                  "top_k", "top_p", "seed", "stop", "ignore_eos", "model", "speculant_speculation"}
# llama.cpp's hints that change no token of the answer, taken as they are (their type is checked)
_INFILL_HINTS: dict[str, Callable[[Any], bool]] = {
    "cache_prompt": lambda v: v is None or isinstance(v, bool),
    "id_slot": lambda v: v is None or _is_int(v),
    "t_max_prompt_ms": lambda v: v is None or _is_number(v),
    "t_max_predict_ms": lambda v: v is None or _is_number(v),
    "samplers": lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "response_fields": lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
_INFILL_NEUTRAL: dict[str, _Neutral] = {
    "n_probs": ((None, 0), "no token probabilities (n_probs = 0)"),
    "n_indent": ((None, 0), "no indentation stop (n_indent = 0)"),
    "repeat_penalty": ((None, 1), "no repetition penalty"),
    "presence_penalty": ((None, 0), "no presence penalty"),
    "frequency_penalty": ((None, 0), "no frequency penalty"),
    "min_p": ((None, 0), "no min-p filter"),
    "typical_p": ((None, 1), "no typical-p filter"),
    "mirostat": ((None, 0), "no mirostat"),
}


def _text_field(body: Mapping, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise _bad(name, f"'{name}' must be a string, got {_kind(v)}", "invalid_type")
    return v


def _input_extra(body: Mapping) -> list[dict[str, str]]:
    """llama.cpp's ``input_extra``: an array of ``{"filename": str, "text": str}`` (repository files)."""
    v = body.get("input_extra")
    if v is None:
        return []
    if not isinstance(v, list):
        raise _bad("input_extra", f"'input_extra' must be an array of {{\"filename\", \"text\"}} objects, got "
                                  f"{_kind(v)}", "invalid_type")
    files = []
    for i, item in enumerate(v):
        where = f"input_extra[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"'{where}' must be an object {{\"filename\", \"text\"}}, got {_kind(item)}",
                       "invalid_type")
        for key in item:
            if key not in ("filename", "text"):
                raise _bad(f"{where}.{clip(key, 40)}", f"'{where}.{clip(key, 40)}' is not supported (a file has "
                                                       "filename and text)", "unknown_parameter")
        name, text = item.get("filename", "tmp"), item.get("text")
        if not isinstance(name, str):
            raise _bad(f"{where}.filename", f"'{where}.filename' must be a string, got {_kind(name)}",
                       "invalid_type")
        if not isinstance(text, str):
            raise _bad(f"{where}.text", f"'{where}.text' must be a string, got {_kind(text)}", "invalid_type")
        files.append({"filename": name, "text": text})
    return files


def parse_infill_request(body: Mapping, model: str) -> GenerationRequest:
    """A llama.cpp ``/infill`` body as a :class:`GenerationRequest` (``kind`` ``"infill"``: ``prompt`` the text
    before the cursor, ``input_prefix`` then llama.cpp's ``prompt``; ``suffix`` the text after it; ``extra`` the
    repository files), or APIError 400 naming the field. ``model`` (optional in the body) defaults to the served
    model's name. ``n_predict`` -1 or absent: up to the end of the context; ``seed`` -1: unseeded; ``top_k`` <= 0:
    no top-k filter; sampling otherwise as llama.cpp's defaults (:data:`INFILL_DEFAULTS`)."""
    known = _INFILL_FIELDS | set(_INFILL_HINTS)
    _check_fields(body, known, _INFILL_NEUTRAL)
    for name, ok in _INFILL_HINTS.items():
        if not ok(body.get(name)):
            raise _bad(name, f"'{name}' has the wrong type ({_kind(body.get(name))})", "invalid_type")
    prefix, suffix = _text_field(body, "input_prefix"), _text_field(body, "input_suffix")
    if prefix is None and suffix is None:
        raise _bad("input_prefix", "'input_prefix' and 'input_suffix' are missing: give the text before and after "
                                   "the cursor", "missing_required")
    cursor = _text_field(body, "prompt") or ""
    n = _int(body, "n_predict", -1)
    if n == 0:
        raise _bad("n_predict", "'n_predict' must be -1 (up to the end of the context) or >= 1, got 0")
    top_k = body.get("top_k", INFILL_DEFAULTS["top_k"])
    if _is_int(top_k) and top_k <= 0:
        top_k = None
    else:
        top_k = _int({"top_k": top_k}, "top_k", 1)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_p = INFILL_DEFAULTS["top_p"] if top_p is None else top_p
    seed = _int(body, "seed", _SEED_MIN, _SEED_MAX)
    name = body.get("model", model)
    if not isinstance(name, str) or not name:
        raise _bad("model", f"'model' must be a non-empty string, got {_kind(name)}", "invalid_type")
    return GenerationRequest(
        kind="infill", model=name, prompt=(prefix or "") + cursor, suffix=suffix or "", extra=_input_extra(body),
        max_tokens=None if n in (None, -1) else n, max_tokens_param="n_predict",
        temperature=INFILL_DEFAULTS["temperature"] if temperature is None else temperature,
        top_p=None if top_p == 1.0 else top_p, top_k=top_k, seed=None if seed == -1 else seed, stop=_stop(body),
        stream=_bool(body, "stream"), ignore_eos=_bool(body, "ignore_eos"), speculation=_speculation(body))
