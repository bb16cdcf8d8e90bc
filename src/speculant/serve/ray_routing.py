"""Prefix-aware routing for ``speculant serve --ray``, the parts without Ray: the routing key of a request
(:func:`routing_key`), the request as the ingress forwards it (:class:`RoutedRequest`) and the model replica that
answers it (:class:`RoutedReplica`). :mod:`speculant.serve.ray_app` builds the deployments,
:mod:`speculant.serve.ray_ingress` is the ingress; both import this module, which imports neither.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .settings import ServeSettings

__all__ = ["MATCH_RATE_THRESHOLD", "REPLICA_HEADER", "ROUTINGS", "TREE_EVICT_CHARS", "TREE_TARGET_CHARS",
           "RoutedReplica", "RoutedRequest", "routing_key"]

ROUTINGS = ("prefix", "default")
"""The values of ``--ray-routing``."""
REPLICA_HEADER = "x-speculant-replica"
"""The response header naming the replica that answered (with prefix routing)."""
MATCH_RATE_THRESHOLD = 0.1
"""The share of a request's routing key that a replica must already hold for the request to follow it."""
TREE_EVICT_CHARS = 400_000
"""When the routing keys held in the prefix tree pass this many characters, the least recently used are
dropped down to :data:`TREE_TARGET_CHARS` (checked every 10 s)."""
TREE_TARGET_CHARS = 360_000


def routing_key(body: bytes) -> str:
    """The text a request is routed by: the prompt as the server renders it, in order, so a conversation's next
    turn (its earlier messages, the answer, a new message) starts with the key of the turn before, and requests
    that share a system prompt share a key prefix. Chat: each message's text then its role
    (``content\\n<|role|>\\n``: the role after the text, so two conversations do not match on a role name
    alone); completions: the prompt text (token ids as decimal numbers, one space after each); llama.cpp's
    ``/infill``: its repository files, then ``input_prefix`` and ``prompt`` (the order its FIM prompt starts in). A body
    that is not JSON or names no prompt gives ``""`` (the request is then load-balanced, and the replica it
    reaches answers any error)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    messages = data.get("messages")
    if isinstance(messages, list):
        return "".join(f"{_content_text(m.get('content'))}\n<|{m.get('role', '')}|>\n"
                       for m in messages if isinstance(m, dict))
    prompt = data.get("prompt")
    if "input_prefix" in data or "input_extra" in data:  # /infill: its prompt starts with the files, then the prefix
        extra = data.get("input_extra")
        files = "".join(f"{f.get('filename', '')}\n{f.get('text', '')}\n" for f in extra if isinstance(f, dict)) \
            if isinstance(extra, list) else ""
        return "".join(t for t in (files, data.get("input_prefix"), prompt) if isinstance(t, str))
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "".join(f"{t} " for t in prompt)
    return ""


def _content_text(content: Any) -> str:
    """A message's text: a string as it is, a list of parts as their texts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@dataclass
class RoutedRequest:
    """One HTTP request as the ingress hands it to a model replica. ``prompt``: its routing key (the attribute
    Ray's prefix-aware router reads); the rest rebuilds the ASGI request in the replica."""

    prompt: str
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    scheme: str = "http"
    server: tuple[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class RoutedReplica:
    """A model replica behind the prefix-routing ingress: builds the app and loads the model when it starts,
    then answers each :class:`RoutedRequest` by running it through the app, yielding the response head (a dict
    with ``status`` and ``headers``, this replica named in :data:`REPLICA_HEADER`) and then the body's chunks
    as the app sends them (streams stay streams)."""

    async def __init__(self, settings: ServeSettings) -> None:
        from uvicorn.config import Config
        from uvicorn.lifespan.on import LifespanOn

        from speculant.serve.app import create_app

        logging.getLogger("speculant").setLevel(logging.INFO)
        self._app = create_app(settings, load="startup")
        self._lifespan = LifespanOn(Config(self._app, lifespan="on"))
        await self._lifespan.startup()  # loads the model; a failure fails the replica
        if self._lifespan.should_exit:
            raise RuntimeError("the app did not start (see the replica's log)")
        self._name = _replica_name()

    async def __call__(self, req: RoutedRequest) -> AsyncIterator[dict | bytes]:
        messages: asyncio.Queue[dict | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await disconnected.wait()  # the client went away (the generator was closed)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method, "scheme": req.scheme, "path": req.path, "raw_path": req.path.encode(),
                 "query_string": req.query_string, "root_path": "", "headers": req.headers,
                 "client": req.client, "server": req.server, "state": {}}
        task = asyncio.create_task(self._app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        started = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    started = True
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
                    yield {"status": message["status"], "headers": [*headers, (REPLICA_HEADER.encode(),
                                                                                self._name.encode())]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if not started:
                yield {"status": 500, "headers": [(b"content-type", b"application/json")]}
                yield json.dumps({"error": {"message": "the replica gave no response", "type": "server_error",
                                            "param": None, "code": None}}).encode()
        finally:
            disconnected.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), timeout=5)
                except BaseException:  # noqa: BLE001: the app did not end after the disconnect: stop it
                    task.cancel()

    async def __del__(self) -> None:  # Ray Serve awaits it when the replica stops: close the worker
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()

    def check_health(self) -> None:
        """Ray's health check: the replica is healthy while its app has not been told to exit."""
        if self._lifespan.should_exit:
            raise RuntimeError("the app has stopped")


def _replica_name() -> str:
    """This replica's id in Ray Serve (``""`` outside a replica)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001
        return ""
