"""What a chat, agent or editor user waits for: conversations and editor-like fill-in-the-middle requests replayed
turn by turn against one or more servers on this machine (``speculant bench serve --conversations`` /
``--fim-replay``).

**Conversations.** Each conversation (:mod:`speculant.data.conversations`) is replayed turn by turn to
``/v1/chat/completions``: turn k sends the system message, every earlier user text with its *recorded* reply, and
user text k; greedy (temperature 0), ``max_tokens`` per answer, streamed. Every server is sent exactly the same
prompts. A conversation whose replies are not all recorded is answered live by the first server (its own replies
become the history, and are sent to the others in the same round), so prompts still match; ``--record`` keeps them
for later runs.

**FIM replay.** An editor moving down one source file: at each cursor position (the start of the code on a line,
every ``every`` lines) one request to llama.cpp's ``/infill`` API with the file's text before the cursor
(``input_prefix``, at most :data:`FIM_PREFIX_LINES` lines) and after the cursor's line (``input_suffix``, at most
:data:`FIM_SUFFIX_LINES` lines), ``n_predict``, ``cache_prompt: true``, greedy, streamed. ``first_line_match``
says whether the completion's first line is the line that was taken out.

Per request the client records the time to the first text (TTFT), the total, and what the server reported of the
prompt: prompt tokens and the cached prompt tokens (OpenAI's ``usage.prompt_tokens_details.cached_tokens``, else
llama.cpp's ``timings.cache_n`` / ``tokens_cached``; None when the server reports neither), and output tokens.
Several servers are interleaved round by round (``concurrency`` conversations, or one FIM position, on each
server in turn) after a warm-up of each, so a drifting machine hurts none of them alone.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..data.conversations import Conversation, turn_messages
from .serve_load import check_url, list_models, stream_post, wait_ready

__all__ = ["FIM_PREFIX_LINES", "FIM_SUFFIX_LINES", "FimPosition", "ReplaySettings", "Server", "TurnResult",
           "fim_positions", "parse_server", "read_fim_source", "run_conversations", "run_fim", "summarise"]

FIM_PREFIX_LINES = 256
"""Lines of text before the cursor an FIM request sends (llama.vim's default window)."""

FIM_SUFFIX_LINES = 64
"""Lines of text after the cursor's line an FIM request sends (llama.vim's default window)."""

WARMUP_CHAT = [{"role": "user", "content": "Say hello."}]
"""The warm-up request (untimed): it shares no prefix with any conversation, so it warms no cache."""

WARMUP_FIM = ("def greet(name):\n    ", "\n")


@dataclass(frozen=True)
class ReplaySettings:
    """A replay run: ``servers`` (``URL`` or ``NAME=URL``, loopback only), ``max_tokens`` per answer (greedy),
    ``concurrency`` conversations at once on a server, ``warmup`` untimed requests per server first."""

    servers: tuple[str, ...]
    max_tokens: int = 128
    concurrency: int = 1
    warmup: int = 1
    timeout_s: float = 600.0
    ready_timeout_s: float = 900.0
    api_key: str | None = None
    model: str | None = None


@dataclass(frozen=True)
class Server:
    """One server of a run: its ``label`` in the tables, base ``url`` and the ``model`` requested."""

    label: str
    url: str
    model: str | None = None


@dataclass
class TurnResult:
    """One timed request (seconds): a conversation's turn (``turn`` 1-based) or an FIM position (``turn`` = the
    position's index, ``line`` its 1-based line). Token counts are the server's; None when it reported none."""

    server: str
    conversation: str
    turn: int
    e2e_s: float
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_chars: int = 0
    line: int | None = None
    first_line_match: bool | None = None
    server_timings: dict | None = None  # llama.cpp's own timings of the request (prompt_ms, predicted_ms, ...)
    error: str | None = None


def parse_server(spec: str, index: int) -> Server:
    """``URL`` or ``NAME=URL`` as a :class:`Server` (label ``NAME``, else ``server-INDEX`` counted from 1); a
    one-line ValueError for a URL that is not on this machine."""
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:
        name, url = f"server-{index + 1}", spec
    if not name.strip():
        raise ValueError(f"--url {spec!r}: the name before '=' is empty")
    return Server(name.strip(), check_url(url))


def _int(value) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _counts(got) -> tuple[int | None, int | None, int | None]:
    """(prompt, cached prompt, output) tokens from OpenAI's usage, else llama.cpp's native fields."""
    usage = got.usage or {}
    timings = got.native.get("timings") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = _int(details.get("cached_tokens"))
    if cached is None:
        cached = _int(timings.get("cache_n"))
    if cached is None:
        cached = _int(got.native.get("tokens_cached"))
    prompt = _int(usage.get("prompt_tokens"))
    if prompt is None and "prompt_n" in timings:
        prompt = (_int(timings["prompt_n"]) or 0) + (_int(timings.get("cache_n")) or 0)
    if prompt is None:
        prompt = _int(got.native.get("tokens_evaluated"))
    output = _int(usage.get("completion_tokens"))
    if output is None:
        output = _int(timings.get("predicted_n"))
    if output is None:
        output = _int(got.native.get("tokens_predicted"))
    return prompt, cached, output


def _turn(got, server: str, conversation: str, turn: int, prompt_chars: int) -> TurnResult:
    prompt, cached, output = _counts(got)
    return TurnResult(server=server, conversation=conversation, turn=turn, e2e_s=got.e2e_s, ttft_s=got.ttft_s,
                      prompt_tokens=prompt, cached_tokens=cached, completion_tokens=output,
                      prompt_chars=prompt_chars, server_timings=got.native.get("timings"), error=got.error)


def _chat_body(server: Server, messages: list[dict], s: ReplaySettings) -> dict:
    return {"model": server.model, "messages": messages, "max_tokens": s.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


def _headers(s: ReplaySettings) -> dict:
    return {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}


async def _connect(client, servers: list[Server], s: ReplaySettings, progress, models: bool) -> list[Server]:
    import httpx

    ready = []
    for server in servers:
        try:
            await wait_ready(client, server.url, s.ready_timeout_s, progress)
            ids = await list_models(client, server.url, _headers(s)) if models else []
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot reach {server.url}: {exc}") from None
        ready.append(Server(server.label, server.url, s.model or (ids[0] if ids else None)))
    return ready


async def _conversation(client, server: Server, conv: Conversation, s: ReplaySettings,
                        live: bool) -> tuple[list[TurnResult], float]:
    """Replay ``conv`` on ``server``; ``live``: fill the replies not recorded with this server's answers."""
    results = []
    t0 = time.perf_counter()
    for turn in range(1, len(conv.users) + 1):
        try:
            messages = turn_messages(conv, turn)
        except ValueError as exc:  # an earlier live turn failed: nothing to send
            results.append(TurnResult(server.label, conv.id, turn, 0.0, error=str(exc)))
            continue
        got = await stream_post(client, server.url + "/v1/chat/completions", _chat_body(server, messages, s),
                                _headers(s))
        results.append(_turn(got, server.label, conv.id, turn, sum(len(m["content"]) for m in messages)))
        if live and conv.assistants[turn - 1] is None and got.error is None:
            conv.assistants[turn - 1] = got.text
    return results, time.perf_counter() - t0


def _client(s: ReplaySettings, connections: int):
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(s.timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=connections + 4))


def _client_info() -> dict:
    """The machine the client (and, on loopback, the servers) ran on."""
    from .. import __version__

    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "speculant": __version__,
            "cpu": cpu, "cpus": os.cpu_count()}


async def run_conversations(settings: ReplaySettings, convs: list[Conversation],
                            progress: Callable[[str], None] | None = None) -> dict:
    """Replay ``convs`` on every server of ``settings`` (module doc); returns ``{"servers", "turns",
    "conversations", "summary", "client"}``. Replies the first server gives where none was recorded are written
    into ``convs``. A one-line ValueError when a server cannot be reached or lists no model."""
    servers = [parse_server(spec, i) for i, spec in enumerate(settings.servers)]
    say = progress or (lambda message: None)
    live = {c.id for c in convs if not c.complete()}
    async with _client(settings, settings.concurrency) as client:
        servers = await _connect(client, servers, settings, progress, models=True)
        for server in servers:
            if server.model is None:
                raise ValueError(f"{server.url}/v1/models lists no model")
            if settings.warmup:
                say(f"{server.label}: warm-up, {settings.warmup} request(s)")
                for _ in range(settings.warmup):
                    await stream_post(client, server.url + "/v1/chat/completions",
                                      _chat_body(server, WARMUP_CHAT, settings), _headers(settings))
        if live:
            say(f"{len(live)} conversation(s) without recorded replies: {servers[0].label} answers them live and "
                "its replies are sent to the others")
        turns: list[TurnResult] = []
        walls: list[dict] = []
        step = settings.concurrency
        for start in range(0, len(convs), step):
            batch = convs[start: start + step]
            say(f"conversations {start + 1}-{start + len(batch)} of {len(convs)}")
            for k, server in enumerate(servers):
                done = await asyncio.gather(*(_conversation(client, server, c, settings, k == 0 and c.id in live)
                                              for c in batch))
                for conv, (results, wall) in zip(batch, done):
                    turns += results
                    walls.append({"server": server.label, "conversation": conv.id, "wall_s": wall,
                                  "turns": len(results), "failed": sum(r.error is not None for r in results)})
    return {"servers": [asdict(s) for s in servers], "turns": [asdict(t) for t in turns], "conversations": walls,
            "live_conversations": sorted(live), "summary": summarise(turns, walls, [s.label for s in servers]),
            "client": _client_info()}


# ---------------------------------------------------------------------------------------------- FIM


@dataclass(frozen=True)
class FimPosition:
    """One cursor position: ``line`` (1-based) is the line taken out and predicted (``middle``, without its
    indentation); ``prefix`` ends at the cursor, after the line's indentation; ``suffix`` starts at the next line."""

    line: int
    prefix: str
    suffix: str
    middle: str


def read_fim_source(source: str) -> tuple[str, str]:
    """``(name, text)`` of the FIM replay's file: a path, or ``stdlib:MODULE`` (a standard-library module's
    source, e.g. ``stdlib:textwrap``). A one-line ValueError when it is missing or not UTF-8 text."""
    if source.startswith("stdlib:"):
        name = source[len("stdlib:"):]
        path = Path(sysconfig.get_paths()["stdlib"]) / (name.replace(".", "/") + ".py")
        if not name or not path.is_file():
            path = path.with_suffix("") / "__init__.py"
        if not name or not path.is_file():
            raise ValueError(f"--fim-replay {source!r}: no such standard-library module")
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"--fim-replay file {source!r} does not exist")
    try:
        return source, path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--fim-replay file {source!r} is not UTF-8 text") from None


def _code_lines(text: str, lines: list[str]) -> list[int]:
    """0-based lines where a statement starts (Python source), else every line neither blank nor a comment."""
    import ast

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return [i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith(("#", "//"))]
    starts = {node.lineno - 1 for node in ast.walk(tree) if isinstance(node, ast.stmt)}
    return sorted(i for i in starts if i < len(lines))


def fim_positions(text: str, every: int = 8, count: int | None = None) -> list[FimPosition]:
    """Cursor positions down ``text``: every ``every``-th line where code starts (a statement of Python source;
    of other text a line neither blank nor a comment), at most ``count``; a one-line ValueError when there is
    none."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    lines = text.splitlines(keepends=True)
    candidates = _code_lines(text, lines)
    picked = candidates[every - 1:: every][:count]
    if not picked:
        raise ValueError("the FIM file has no line of code to complete")
    out = []
    for i in picked:
        body = lines[i].rstrip("\r\n")
        indent = body[: len(body) - len(body.lstrip())]
        prefix = "".join(lines[max(0, i - FIM_PREFIX_LINES): i]) + indent
        suffix = "".join(lines[i + 1: i + 1 + FIM_SUFFIX_LINES])
        out.append(FimPosition(line=i + 1, prefix=prefix, suffix=suffix, middle=body.lstrip()))
    return out


def _fim_body(server: Server, prefix: str, suffix: str, s: ReplaySettings) -> dict:
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": [], "n_predict": s.max_tokens,
            "cache_prompt": True, "temperature": 0.0, "top_k": 1, "stream": True}
    if server.model:
        body["model"] = server.model
    return body


async def run_fim(settings: ReplaySettings, positions: Sequence[FimPosition],
                  progress: Callable[[str], None] | None = None) -> dict:
    """Send every FIM position to ``POST /infill`` of every server of ``settings``, position by position and
    server by server (module doc); returns ``{"servers", "turns", "conversations", "summary", "client"}`` with one
    "conversation" (the file) per server."""
    servers = [parse_server(spec, i) for i, spec in enumerate(settings.servers)]
    say = progress or (lambda message: None)
    async with _client(settings, 1) as client:
        servers = await _connect(client, servers, settings, progress, models=False)
        for server in servers:
            if settings.warmup:
                say(f"{server.label}: warm-up, {settings.warmup} request(s)")
                for _ in range(settings.warmup):
                    await stream_post(client, server.url + "/infill", _fim_body(server, *WARMUP_FIM, settings),
                                      _headers(settings))
        turns: list[TurnResult] = []
        wall = {server.label: 0.0 for server in servers}
        say(f"{len(positions)} cursor positions")
        for n, pos in enumerate(positions, 1):
            for server in servers:
                got = await stream_post(client, server.url + "/infill",
                                        _fim_body(server, pos.prefix, pos.suffix, settings), _headers(settings))
                result = _turn(got, server.label, "fim", n, len(pos.prefix) + len(pos.suffix))
                result.line = pos.line
                if got.error is None:
                    first = got.text.split("\n", 1)[0].strip()
                    result.first_line_match = bool(first) and first == pos.middle.strip()
                turns.append(result)
                wall[server.label] += got.e2e_s
    walls = [{"server": label, "conversation": "fim", "wall_s": w, "turns": len(positions),
              "failed": sum(t.error is not None for t in turns if t.server == label)} for label, w in wall.items()]
    return {"servers": [asdict(s) for s in servers], "turns": [asdict(t) for t in turns], "conversations": walls,
            "live_conversations": [], "summary": summarise(turns, walls, [s.label for s in servers]),
            "client": _client_info()}


# ---------------------------------------------------------------------------------------------- summary


def _median(values: list) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _group(results: list[TurnResult]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    matches = [r.first_line_match for r in ok if r.first_line_match is not None]
    return {"requests": len(results), "ok": len(ok),
            "ttft_s": _median([r.ttft_s for r in ok]), "e2e_s": _median([r.e2e_s for r in ok]),
            "prompt_tokens": _median([r.prompt_tokens for r in ok]),
            "cached_tokens": _median([r.cached_tokens for r in ok]),
            "cached_reported": sum(r.cached_tokens is not None for r in ok),
            "completion_tokens": _median([r.completion_tokens for r in ok]),
            "first_line_match": sum(matches) / len(matches) if matches else None}


def summarise(turns: Sequence[TurnResult], walls: Sequence[dict], labels: Sequence[str]) -> dict[str, dict]:
    """Per server: medians by turn index (``by_turn``), of turn 1 (``first``) and of turns 2+ (``later``), and the
    conversations' wall time (median and total seconds); medians are over the answered requests."""
    out = {}
    for label in labels:
        mine = [t for t in turns if t.server == label]
        indices = sorted({t.turn for t in mine})
        conv = [w for w in walls if w["server"] == label]
        out[label] = {
            "by_turn": {str(i): _group([t for t in mine if t.turn == i]) for i in indices},
            "first": _group([t for t in mine if t.turn == 1]),
            "later": _group([t for t in mine if t.turn > 1]),
            "all": _group(mine),
            "conversation_wall_s": {"median": _median([w["wall_s"] for w in conv]),
                                    "total": sum(w["wall_s"] for w in conv), "n": len(conv)},
            "failed": sum(t.error is not None for t in mine),
            "errors": [t.error for t in mine if t.error is not None][:5],
        }
    return out
