"""The server's web page (``GET /``) and the files it loads (``GET /static/...``): a chat client, no build step.

The page (``PAGE``) is HTML only; its script and style are files shipped in the package under
``speculant/assets/web`` (:data:`STATIC`): ``page.js`` and ``page.css``, and the vendored renderers, marked
(markdown), DOMPurify (sanitizing) and highlight.js (code blocks), whose versions and update steps
``assets/web/README.md`` gives. Nothing is fetched from elsewhere, and there is no inline script, style or event
handler: the page works under a Content-Security-Policy of ``default-src 'self'`` (it declares one itself).

The page keeps the conversation and sends it whole to ``/v1/chat/completions`` with each request (``stream: true``,
``stream_options.include_usage`` and ``speculant_sources: true``); "New chat" clears it. The answer is rendered
as markdown while it streams, the model's raw HTML shown as text, each character coloured by how its token came
(an accepted draft token, green, or the target's own) from the chunks' ``speculant.sources`` spans. Under each
answer: its prompt tokens and how many the server reused from its prefix cache
(``usage.prompt_tokens_details.cached_tokens``), its tokens, τ and speed; above the input, live τ (tokens per
target forward), tokens per second and the share of accepted draft tokens. An API key field is there for servers
started with ``--api-key``; a tools field (a JSON array of function tools) sends ``tools`` with each request, and
a tool call the model makes is shown under its answer (the function's name and its arguments as indented JSON,
as text) and kept in the conversation as the assistant's ``tool_calls``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PAGE", "STATIC", "static_file"]

WEB = Path(__file__).resolve().parent.parent / "assets" / "web"
"""The page's files in the package."""

MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

STATIC: dict[str, Path] = {p.relative_to(WEB).as_posix(): p for p in sorted(WEB.rglob("*"))
                           if p.is_file() and p.suffix in MEDIA_TYPES}
"""The files served under ``/static/``: every script and style sheet under ``assets/web``, by relative path."""


def static_file(name: str) -> tuple[bytes, str] | None:
    """``(content, media type)`` of the served file ``name`` (a key of :data:`STATIC`), None for any other name."""
    path = STATIC.get(name)
    if path is None:
        return None
    return path.read_bytes(), MEDIA_TYPES[path.suffix]


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'self'; object-src 'none'; base-uri 'none'">
<title>speculant</title>
<link rel="stylesheet" href="/static/highlight/github.min.css">
<link rel="stylesheet" href="/static/page.css">
<script defer src="/static/marked/marked.umd.js"></script>
<script defer src="/static/dompurify/purify.min.js"></script>
<script defer src="/static/highlight/highlight.min.js"></script>
<script defer src="/static/page.js"></script>
</head>
<body>
<header><h1>speculant</h1><span id="model">loading the model list...</span>
  <button id="new" type="button">New chat</button></header>
<main>
  <div id="log" aria-live="polite"></div>
  <div class="legend">
    <label><input id="drafts" type="checkbox" checked> colour <span class="draft">accepted draft tokens</span></label>
    <span>(uncoloured: the target's own tokens)</span>
  </div>
  <div id="stats">
    <span>τ <b id="tau">-</b></span><span>tokens/s <b id="tps">-</b></span>
    <span>accepted drafts <b id="share">-</b></span><span>tokens <b id="ntok">0</b></span>
    <span id="final"></span>
  </div>
  <form id="form">
    <textarea id="prompt" placeholder="Ask something (Enter sends, Shift+Enter for a new line)"></textarea>
    <button id="send" type="submit">Send</button>
    <button id="stop" type="button" hidden>Stop</button>
  </form>
  <details><summary>settings</summary>
    <p>max tokens <input id="max" type="number" value="256" min="1"> &nbsp;
       temperature <input id="temp" type="number" value="0" min="0" step="0.1"> &nbsp;
       API key <input id="key" type="password" placeholder="if the server has one"></p>
    <p>tools (a JSON array of OpenAI function tools, sent with each request; empty: none)<br>
       <textarea id="tools" rows="3" placeholder='[{"type": "function", "function": {"name": "get_weather", ...}}]'></textarea></p>
  </details>
</main>
</body>
</html>
"""
