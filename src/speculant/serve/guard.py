"""Keep web pages from driving the server: a ``Host`` check (DNS rebinding) and an ``Origin`` check (cross-site
requests), with CORS for the origins ``--allow-origin`` names; and the security headers of every response.

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

Either way a ``Host`` header that is not ``host[:port]`` (RFC 7230: a name, an IPv4 address or a bracketed IPv6
address, then an optional port of at most five digits; no user info ``@``, path, fragment or spaces), or a request
with several, is answered 400 (:func:`parse_host`): ``127.0.0.1:8000@evil.example`` names no host of this server.
Every response carries ``X-Content-Type-Options: nosniff``; the web page's own headers (a Content-Security-Policy
that admits only its inline script and style, and no framing) are :func:`page_headers`.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from .protocol import clip, error_body

__all__ = ["BrowserGuard", "check_origins", "page_headers", "parse_host"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

_WILDCARD = {"0.0.0.0", "::", ""}
_PREFLIGHT_MAX_AGE = "600"
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._~-]+))(?::(?P<port>[0-9]{1,5}))?", re.ASCII)
"""RFC 7230's ``Host``: ``uri-host [":" port]``, the host an IP literal in brackets or a name of RFC 3986's
unreserved characters (an IPv4 address is one); percent-encoding and sub-delimiters, which no DNS name holds,
are left out."""
_NOSNIFF = (b"x-content-type-options", b"nosniff")


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


def parse_host(value: str) -> str | None:
    """The host a ``Host`` header names, lower case, without the port, the brackets of an IPv6 address and a
    trailing dot (``[::1]:8000`` -> ``::1``, ``Example.COM.:80`` -> ``example.com``); None when the header is not
    ``host[:port]`` (see :data:`_HOST`): user info (``127.0.0.1@evil.example``), a path or fragment, spaces, a
    port that is not a number up to 65535, an address in brackets that is not IPv6."""
    match = _HOST.fullmatch(value.lower())
    if match is None or (match["port"] is not None and int(match["port"]) > 65535):
        return None
    if match["ipv6"] is not None:
        try:
            return str(ipaddress.IPv6Address(match["ipv6"]))
        except ValueError:
            return None
    return match["name"].rstrip(".") or None


def _listen_name(host: str) -> str:
    """``--host`` as :func:`parse_host` names it (an IPv6 address is given without brackets): "" for every
    interface."""
    if host in _WILDCARD:
        return ""
    ip = _ip(host.strip("[]"))
    return str(ip) if ip is not None else host.strip().lower().rstrip(".")


def page_headers(page: str) -> dict[str, str]:
    """The security headers of the HTML document ``page``: a Content-Security-Policy that runs only the server's own
    script and style files and the page's own inline ``<script>`` and ``<style>`` blocks, if any (by their SHA-256;
    no inline event handlers or style attributes), loads nothing from elsewhere (``default-src 'self'``,
    ``connect-src 'self'``, ``img-src 'self' data:``), takes no ``<base>``, plugins or framing
    (``frame-ancestors 'none'``, with ``X-Frame-Options: DENY`` for older browsers)."""

    def sources(tag: str) -> str:
        blocks = [b for b in re.findall(rf"<{tag}\b[^>]*>(.*?)</{tag}\s*>", page, re.S | re.I) if b.strip()]
        digests = (base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)
        return " ".join(["'self'", *(f"'sha256-{d}'" for d in digests)])

    policy = (f"default-src 'self'; script-src {sources('script')}; style-src {sources('style')}; "
              "connect-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; "
              "frame-ancestors 'none'")
    return {"Content-Security-Policy": policy, "X-Frame-Options": "DENY"}


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
        self.listen = _listen_name(host)
        self.check_host = not api_key_set
        self.check_origin = not api_key_set or bool(allow_origin)
        self.any_origin = "*" in allow_origin
        self.origins = frozenset(o for o in allow_origin if o != "*")

    def host_allowed(self, name: str) -> bool:
        """Whether the host ``name`` (:func:`parse_host`) may be served without an API key."""
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
        raw = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", ())]
        headers = dict(raw)
        hosts = [v for k, v in raw if k == "host"]
        host = hosts[0] if hosts else None
        name = parse_host(host) if host is not None else None
        if len(hosts) > 1 or (host is not None and name is None):
            shown = clip(", ".join(hosts), 80)
            await _error(send, 400, f"malformed Host header {shown!r}: expected host[:port] (a name, an IPv4 "
                                    "address or an IPv6 address in brackets), once", "invalid_host")
            return
        if self.check_host and name is not None and not self.host_allowed(name):
            await _error(send, 421, f"this server does not answer for host {clip(host, 80)!r} (without an API key "
                                    "only its own address and loopback names are served: DNS rebinding)",
                         "misdirected_request")
            return
        origin = headers.get("origin")
        if origin is None or not self.check_origin:
            await self.app(scope, receive, _adding(send, []))
            return
        if not self.origin_allowed(origin, host):
            await _error(send, 403, f"cross-origin requests from {clip(origin, 80)!r} are not allowed (the server "
                                    "names the origins it serves with --allow-origin)", "origin_not_allowed")
            return
        cors = [(b"access-control-allow-origin", (origin if not self.any_origin else "*").encode("latin-1")),
                (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            asked = headers.get("access-control-request-headers", "authorization, content-type")
            await send({"type": "http.response.start", "status": 204, "headers": [_NOSNIFF, *cors,
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", asked.encode("latin-1")),
                (b"access-control-max-age", _PREFLIGHT_MAX_AGE.encode())]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, _adding(send, cors))


def _adding(send, extra: list[tuple[bytes, bytes]]):
    """``send`` with ``extra`` headers and ``X-Content-Type-Options: nosniff`` added to the response's start."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), _NOSNIFF, *extra]}
        await send(message)

    return sending


async def _error(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            _NOSNIFF]})
    await send({"type": "http.response.body", "body": body})
