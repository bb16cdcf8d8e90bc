"""Keep web pages from driving the server: a ``Host`` check (DNS rebinding) and an ``Origin`` check (cross-site
requests), with CORS for the origins ``--allow-origin`` names.

A server without an API key answers whoever reaches it. A web page the user visits can reach a loopback server in
two ways, and this ASGI middleware closes both:

* **DNS rebinding**: the page's own name is made to resolve to 127.0.0.1, so the browser sends same-origin
  requests with ``Host: evil.example``. Without an API key the ``Host`` header must name this server: a loopback
  name (``localhost``, ``127.0.0.1``, ``[::1]``), the ``--host`` address itself, or, when listening on every
  interface (``0.0.0.0``, ``::``), any IP address (an address is never a rebound name). Otherwise 421.
* **cross-site requests**: a page on another origin POSTs to ``http://127.0.0.1:8000`` (a "simple" request
  needs no preflight, and does its work even though the page cannot read the answer). A request whose ``Origin``
  is neither this server's own origin nor one ``--allow-origin`` names (``*``: any) is answered 403. Allowed
  origins get CORS headers, and their preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered
  204. Requests without ``Origin`` (curl, SDKs, servers) are not browser requests and pass.

With an API key the key protects the server (a page cannot know it): ``Host`` is not checked, and ``Origin`` is
checked only when ``--allow-origin`` is given (then the same rule applies, so a browser app that holds the key is
limited to those origins and gets CORS headers).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from .protocol import clip, error_body

__all__ = ["BrowserGuard", "check_origins", "host_name"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

_WILDCARD = {"0.0.0.0", "::", ""}
_PREFLIGHT_MAX_AGE = "600"


def check_origins(origins: str | Sequence[str]) -> tuple[str, ...]:
    """``--allow-origin`` values (one string: one origin) normalised (``scheme://host[:port]``, lower case, no trailing slash), or ``*``;
    a one-line ValueError for anything else (a path, no scheme)."""
    out = []
    for origin in [origins] if isinstance(origins, str) else origins:
        o = origin.strip()
        if o == "*":
            out.append(o)
            continue
        parts = urlsplit(o.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or \
                parts.fragment or parts.username is not None:
            raise ValueError(f"--allow-origin {clip(origin, 80)!r}: expected an origin such as "
                             "http://localhost:3000 (scheme, host and port only), or *")
        out.append(f"{parts.scheme}://{parts.netloc.lower()}")
    return tuple(dict.fromkeys(out))


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without the port and brackets, lower case: ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    name, colon, _ = host.rpartition(":")
    return (name if colon else host).rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class BrowserGuard:
    """ASGI middleware: the ``Host`` and ``Origin`` rules of the module docstring for the server that listens on
    ``host`` (``--host``), with ``api_key_set`` and the ``allow_origin`` list (normalised by
    :func:`check_origins`)."""

    def __init__(self, app: ASGIApp, host: str, api_key_set: bool, allow_origin: Sequence[str] = ()) -> None:
        self.app = app
        self.listen = host_name(host) if host not in _WILDCARD else ""
        self.check_host = not api_key_set
        self.check_origin = not api_key_set or bool(allow_origin)
        self.any_origin = "*" in allow_origin
        self.origins = frozenset(o for o in allow_origin if o != "*")

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        ip = _ip(name)
        if name == "localhost" or (ip is not None and ip.is_loopback):
            return True
        if not self.listen:  # every interface: any address, never a name (names can be rebound)
            return ip is not None
        return name == self.listen

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        o = origin.strip().lower().rstrip("/")
        if self.any_origin or o in self.origins:
            return True
        # the server's own origin (a page it served): same-origin, and the Host was checked already
        return host is not None and o in (f"http://{host.strip().lower()}", f"https://{host.strip().lower()}")

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = headers.get("host")
        if self.check_host and host is not None and not self.host_allowed(host):
            await _error(send, 421, f"this server does not answer for host {clip(host, 80)!r} (without an API key "
                                    "only its own address and loopback names are served: DNS rebinding)",
                         "misdirected_request")
            return
        origin = headers.get("origin")
        if origin is None or not self.check_origin:
            await self.app(scope, receive, send)
            return
        if not self.origin_allowed(origin, host):
            await _error(send, 403, f"cross-origin requests from {clip(origin, 80)!r} are not allowed (the server "
                                    "names the origins it serves with --allow-origin)", "origin_not_allowed")
            return
        cors = [(b"access-control-allow-origin", (origin if not self.any_origin else "*").encode("latin-1")),
                (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            asked = headers.get("access-control-request-headers", "authorization, content-type")
            await send({"type": "http.response.start", "status": 204, "headers": cors + [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", asked.encode("latin-1")),
                (b"access-control-max-age", _PREFLIGHT_MAX_AGE.encode())]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", ())) + cors}
            await send(message)

        await self.app(scope, receive, send_with_cors)


async def _error(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
