"""Refuse oversized work before doing it: request bodies over ``--max-body-bytes`` (413, before the body is read)
and prompts whose text is too long to fit the context (400, before it is tokenised).

Why both: without them a body of tens of MB is read, parsed and tokenised whole (seconds of CPU, gigabytes of
memory) before the server finds that its prompt could never fit. :class:`BodyLimit` answers 413 from the ``Content-Length`` header
alone, and counts the bytes of a chunked body as they arrive (the handler reading it gets a 413
:class:`~speculant.serve.protocol.APIError` once the limit is passed, so at most the limit is ever held).
:func:`check_prompt_chars` bounds the tokens of a prompt from below by its characters: no token of the vocabulary
stands for more than :func:`longest_token_chars` characters, so a text of more than ``context`` times that many
characters has more tokens than the context holds, whatever the tokenizer makes of it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .protocol import APIError, GenerationRequest, error_body

__all__ = ["DISCARD_MAX_BYTES", "BodyLimit", "check_prompt_chars", "longest_token_chars"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


DISCARD_MAX_BYTES = 64 * 2**20
"""At most this many bytes of a refused body are read and dropped before the 413 goes out. Closing a connection
that still has unread data resets it, and a client that is still sending then loses the answer; reading the rest
(into nothing) lets it finish and read the 413. A larger body is cut off: its client sees a reset."""


def _too_large(size: str, limit: int) -> tuple[str, str]:
    return (f"the request body is {size} bytes; this server takes at most {limit} (--max-body-bytes)",
            "request_too_large")


async def _discard(receive, more: bool, budget: int) -> None:
    """Read and drop the rest of a request body (while ``more``), up to ``budget`` bytes."""
    while more and budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        more = message.get("more_body", False)


class BodyLimit:
    """ASGI middleware: HTTP requests whose body is over ``max_bytes`` are answered 413 with OpenAI's error body,
    and the connection is closed.

    A ``Content-Length`` over the limit is answered before the body is parsed: without ``Expect: 100-continue``
    (curl sends it for large bodies, and then waits for the answer instead of sending) the body is read into
    nothing first, up to :data:`DISCARD_MAX_BYTES`, so that the client hears the 413. A chunked body is counted
    as it is received: the message that passes the limit raises a 413 :class:`APIError` in the handler reading
    it (answered by the app's APIError handler), after the rest was read into nothing the same way."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        length = headers.get(b"content-length", b"").strip()
        if length.isdigit() and int(length) > self.max_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await _discard(receive, True, DISCARD_MAX_BYTES)
            message, code = _too_large(length.decode("latin-1"), self.max_bytes)
            body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    await _discard(receive, message.get("more_body", False), DISCARD_MAX_BYTES)
                    text, code = _too_large(f"more than {self.max_bytes}", self.max_bytes)
                    raise APIError(413, text, code=code, headers={"Connection": "close"})
            return message

        await self.app(scope, counted, send)


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` stands for: the longest token string of its
    vocabulary (added tokens included). A byte-level BPE token string has one character per byte, and a text
    character is at least one byte; a SentencePiece piece is its text (``▁`` for a space); byte-fallback pieces
    (``<0x41>``) and WordPiece's ``##`` only overcount: an upper bound either way, for tokenizers whose normalizer
    does not delete characters (those of causal LMs do not)."""
    return max(map(len, tokenizer.get_vocab()), default=1) or 1


def check_prompt_chars(req: GenerationRequest, context: int | None, token_chars: int) -> None:
    """A 400 (``context_length_exceeded``) when the text of ``req`` (its prompt, or its messages' contents: the
    chat template only adds to them) has more characters than ``context`` tokens of at most ``token_chars``
    characters each can hold: such a prompt cannot fit, and tokenising it would cost time for nothing. Token-id
    prompts are counted as they are."""
    if context is None:
        return
    field = "messages" if req.kind == "chat" else "prompt"
    if req.kind == "chat":
        chars = sum(len(c) if isinstance(c, str) else sum(len(p.get("text", "")) for p in c)  # image parts: 0
                    for c in (m.get("content", "") for m in req.messages or ()))
    elif isinstance(req.prompt, str):
        chars = len(req.prompt)
    else:
        if len(req.prompt or ()) >= context:
            raise APIError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                f"{len(req.prompt)}", param=field, code="context_length_exceeded")
        return
    if chars > context * token_chars:
        raise APIError(400, f"this model's maximum context length is {context} tokens; the {field} has {chars} "
                            f"characters, more than {context} tokens of this tokenizer can hold (at most "
                            f"{token_chars} characters per token)", param=field, code="context_length_exceeded")
