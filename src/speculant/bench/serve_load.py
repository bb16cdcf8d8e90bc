"""The load generator of ``speculant bench serve``: a fixed number of streamed requests per concurrency level
against a running OpenAI-compatible server on this machine, with client-side latencies and the server's
speculative-decoding counters.

For each concurrency level C, C client tasks send the level's N requests (prompt i of the set for request i,
cycling; the same prompts at every level) and stop once all N are answered: the load is bounded by construction.
Every request streams (``stream_options.include_usage``), so the client sees:

* TTFT: request sent to the first chunk that carries text;
* TPOT: (end - first text) / (completion tokens - 1), per request;
* end-to-end latency; and per level request throughput (answered requests / level wall time) and output
  tokens/s (completion tokens / level wall time).

Around each level ``/metrics`` is scraped and the difference kept: drafts, draft tokens, accepted tokens (vLLM's
``vllm:spec_decode_*``), generation tokens and target calls (τ = generation tokens / target calls), the
acceptance rate (accepted / draft tokens) and the per-position acceptance (accepted at depth i / drafts).

Chat records (``messages``) go to ``/v1/chat/completions``, text records (``prompt``) to ``/v1/completions``,
fill-in-the-middle records (``prefix`` and ``suffix``, ``builtin:fim``) to ``/v1/completions`` with ``suffix``.
Structured records go with their constraint: a ``response_format`` (``builtin:json-extract``) or ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (``builtin:tools``) are sent as given, the streamed tool calls are put together, and each answer
is checked (:func:`speculant.data.answers.check_answer`): per level, the share of valid answers (parses and matches
the schema or a tool's parameters) and of exact ones (equal to the record's reference or expected call).
Only loopback URLs are accepted: this is a benchmark for one's own server, not a load tool for other hosts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..data.answers import check_answer, is_structured

__all__ = ["LoadSettings", "RequestResult", "Streamed", "check_url", "list_models", "percentile", "run_load",
           "scrape_metrics", "stream_post", "wait_ready"]


@dataclass(frozen=True)
class LoadSettings:
    """One ``bench serve`` run: ``requests`` per level at each of ``concurrency``; ``warmup`` untimed requests
    first; ``temperature`` 0 is greedy; ``ignore_eos`` asks for exactly ``max_tokens`` tokens (vLLM's extension,
    which ``speculant serve`` takes too); ``speculation``: run every level once per mode (the modes in turn at each
    level), each request asking for it (``speculant_speculation``: ``auto``, ``on``, ``off``), to compare them on one
    ``speculant serve``."""

    url: str
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    requests: int = 32
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    warmup: int = 1
    timeout_s: float = 600.0
    ready_timeout_s: float = 900.0  # how long to wait for a server still loading its model (GET /health 503)
    api_key: str | None = None
    model: str | None = None
    speculation: tuple[str, ...] = ()  # each level once per mode, in turn (speculant_speculation); (): the server's own


@dataclass
class RequestResult:
    """What the client saw of one request (seconds); ``error`` is None when it was answered in full."""

    prompt_id: str
    e2e_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None
    valid: bool | None = None  # structured records only (check_answer): the answer is what the request requires
    exact: bool | None = None  # ... and equals the record's reference (None: no reference)


def check_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``, or a one-line ValueError unless it is http(s) on a loopback
    host (localhost, 127.0.0.0/8, ::1)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url {url!r}: expected http://HOST:PORT (e.g. http://127.0.0.1:8000)")
    host = parts.hostname
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise ValueError(f"--url {url!r}: bench serve only loads servers on this machine (localhost, 127.0.0.1, "
                         "::1)")
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _distribution(values: Sequence[float]) -> dict[str, float | None]:
    return {"median": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None, "n": len(values)}


# ---------------------------------------------------------------------------------------------- metrics

_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "prompt_tokens": "vllm:prompt_tokens",
    "target_calls": "speculant:target_calls",
    "cancelled": "speculant:requests_cancelled",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


async def scrape_metrics(client, base: str, model: str | None) -> dict[str, Any] | None:
    """The server's counters (:data:`_COUNTERS` and the per-position acceptance), or None when ``/metrics`` is
    missing or unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get(base + "/metrics")
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except Exception:  # noqa: BLE001: a server without Prometheus metrics: no acceptance figures
        return None
    out: dict[str, Any] = {key: 0.0 for key in _COUNTERS}
    out["per_position"] = {}
    by_name = {name: key for key, name in _COUNTERS.items()}
    for family in families:
        for sample in family.samples:
            if model is not None and sample.labels.get("model_name", model) != model:
                continue
            name = sample.name[: -len("_total")] if sample.name.endswith("_total") else sample.name
            if name in by_name:
                out[by_name[name]] += sample.value
            elif name == _PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                out["per_position"][pos] = out["per_position"].get(pos, 0.0) + sample.value
    return out


def _spec_delta(before: Mapping | None, after: Mapping | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    d = {key: after[key] - before[key] for key in _COUNTERS}
    positions = sorted(set(after["per_position"]) | set(before["per_position"]))
    per_pos = [after["per_position"].get(p, 0.0) - before["per_position"].get(p, 0.0) for p in positions]
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None
    d["mean_acceptance_length"] = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None  # vLLM's
    d["tau"] = d["generation_tokens"] / d["target_calls"] if d["target_calls"] else None
    d["position_acceptance"] = [v / d["drafts"] for v in per_pos] if d["drafts"] else []
    return d


# ---------------------------------------------------------------------------------------------- requests


def _body(record: Mapping, model: str, s: LoadSettings, mode: str | None = None) -> tuple[str, dict]:
    chat = "messages" in record
    body: dict[str, Any] = {"model": model, "max_tokens": s.max_tokens, "temperature": s.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if s.ignore_eos:
        body["ignore_eos"] = True
    if mode is not None:
        body["speculant_speculation"] = mode
    if chat:
        body["messages"] = record["messages"]
        if record.get("tools"):
            body["tools"] = record["tools"]
            body["tool_choice"] = record.get("tool_choice", "auto")
            if "parallel_tool_calls" in record:
                body["parallel_tool_calls"] = bool(record["parallel_tool_calls"])
    elif "prefix" in record and "suffix" in record:  # fill-in-the-middle: OpenAI's legacy suffix
        body["prompt"], body["suffix"] = record["prefix"], record["suffix"]
    else:
        body["prompt"] = record["prompt"]
    if record.get("response_format") is not None:
        body["response_format"] = record["response_format"]
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@dataclass
class Streamed:
    """What one streamed POST gave the client: seconds from sending to the first chunk with text (``ttft_s``) and
    to the end (``e2e_s``), the text, the tool calls (OpenAI's ``function`` objects ``{"name", "arguments"}``, put
    together from the ``delta.tool_calls`` pieces), the last ``usage`` the server sent (OpenAI's), and llama.cpp's
    native fields when it sent them (``timings``, ``tokens_cached``, ``tokens_evaluated``, ``tokens_predicted``)."""

    e2e_s: float
    ttft_s: float | None = None
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    usage: dict | None = None
    native: dict = field(default_factory=dict)
    error: str | None = None


_NATIVE = ("timings", "tokens_cached", "tokens_evaluated", "tokens_predicted")


async def stream_post(client, url: str, body: dict, headers: dict) -> Streamed:
    """POST ``body`` to ``url`` and read the server-sent events: OpenAI's chunks (``choices[].delta.content`` or
    ``choices[].text``) and llama.cpp's native ones (``content``, the last with ``stop``). A failure (an HTTP
    error, an error event, a broken connection) is kept in ``error``, never raised."""
    t0 = time.perf_counter()
    out = Streamed(e2e_s=0.0)
    pieces: list[str] = []
    calls: dict[int, dict] = {}
    first: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                out.error = f"HTTP {r.status_code}: {text}"[:300]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        err = obj["error"]
                        out.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                        break
                    if obj.get("usage"):
                        out.usage = obj["usage"]
                    out.native.update({k: obj[k] for k in _NATIVE if obj.get(k) is not None})
                    found = [(c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                             for c in obj.get("choices") or []]
                    if "choices" not in obj and isinstance(obj.get("content"), str):
                        found.append(obj["content"])
                    for piece in found:
                        if piece:
                            first = time.perf_counter() if first is None else first
                            pieces.append(piece)
                    for c in obj.get("choices") or []:
                        if _add_tool_calls(calls, (c.get("delta") or {}).get("tool_calls")):
                            first = time.perf_counter() if first is None else first
    except Exception as exc:  # noqa: BLE001: a failed request is counted, the run goes on
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.e2e_s = time.perf_counter() - t0
    out.ttft_s = None if first is None else first - t0
    out.text = "".join(pieces)
    out.tool_calls = [calls[i] for i in sorted(calls)]
    return out


def _add_tool_calls(calls: dict[int, dict], deltas: Any) -> bool:
    """Fold one chunk's ``delta.tool_calls`` into ``calls`` (index -> ``{"name", "arguments"}``): the name comes
    once, the arguments in pieces. True when the chunk carried any."""
    if not isinstance(deltas, list) or not deltas:
        return False
    for k, d in enumerate(deltas):
        if not isinstance(d, dict):
            continue
        call = calls.setdefault(int(d.get("index", k)), {"name": "", "arguments": ""})
        fn = d.get("function") or {}
        call["name"] += fn.get("name") or ""
        call["arguments"] += fn.get("arguments") or ""
    return True


async def _request(client, base: str, record: Mapping, model: str, s: LoadSettings, headers: dict,
                   mode: str | None = None) -> RequestResult:
    path, body = _body(record, model, s, mode)
    got = await stream_post(client, base + path, body, headers)
    tokens = int(got.usage["completion_tokens"]) if got.usage else 0
    result = RequestResult(prompt_id=str(record.get("id", "?")), e2e_s=got.e2e_s, ttft_s=got.ttft_s,
                           completion_tokens=tokens, error=got.error)
    if got.ttft_s is not None and tokens > 1:
        result.tpot_s = (got.e2e_s - got.ttft_s) / (tokens - 1)
    if got.error is None and is_structured(record):
        check = check_answer(record, got.text, got.tool_calls)
        result.valid, result.exact = check["valid"], check["exact"]
    return result


async def _level(client, base: str, prompts: Sequence[Mapping], model: str, s: LoadSettings, headers: dict,
                 concurrency: int, n: int, mode: str | None = None) -> tuple[list[RequestResult], float]:
    order = itertools.count()
    results: list[RequestResult] = []

    async def user() -> None:
        while (i := next(order)) < n:
            results.append(await _request(client, base, prompts[i % len(prompts)], model, s, headers, mode))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def _summary(concurrency: int, results: list[RequestResult], wall: float, spec: dict | None,
             mode: str | None = None) -> dict:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    errors = [r.error for r in results if r.error is not None]
    return {
        "concurrency": concurrency,
        "speculation": mode,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "request_throughput": len(ok) / wall if wall > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": _distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _distribution([r.e2e_s for r in ok]),
        "structured": _structured([r for r in ok if r.valid is not None]),
        "spec": spec,
        "per_request": [asdict(r) for r in results],
    }


def _structured(checked: list[RequestResult]) -> dict | None:
    """Of the answered structured requests: how many, the share valid, the share exact (of those with a
    reference); None when there were none."""
    if not checked:
        return None
    refs = [r for r in checked if r.exact is not None]
    return {"checked": len(checked), "valid_share": sum(r.valid for r in checked) / len(checked),
            "exact_share": sum(r.exact for r in refs) / len(refs) if refs else None}


async def wait_ready(client, base: str, timeout_s: float, progress=None, poll_s: float = 2.0) -> None:
    """Return once ``GET /health`` answers 200 (or anything but 503: a server without the route); while it answers
    503 (``speculant serve`` loading its model) poll every ``poll_s`` seconds, saying so once through
    ``progress``; a one-line ValueError after ``timeout_s`` seconds. A load started before the model is ready would
    fail every request."""
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        r = await client.get(base + "/health")
        if r.status_code != 503:
            return
        if time.monotonic() >= deadline:
            raise ValueError(f"{base} still answers GET /health with 503 after {timeout_s:.0f} s (loading or shutting "
                             "down); try again once it answers 200")
        if progress and not told:
            progress(f"waiting for {base} to load its model (GET /health answers 503)")
            told = True
        await asyncio.sleep(poll_s)


async def list_models(client, base: str, headers: dict) -> list[str]:
    """The model ids ``GET /v1/models`` lists; a one-line ValueError when it answers anything but 200."""
    r = await client.get(base + "/v1/models", headers=headers)
    if r.status_code != 200:
        raise ValueError(f"GET {base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    return [m["id"] for m in r.json().get("data", [])]


async def run_load(settings: LoadSettings, prompts: Sequence[Mapping], progress=None) -> dict:
    """Run every level of ``settings`` with ``prompts`` (records with ``messages`` or ``prompt``); returns
    ``{"model", "levels": [summary per level]}``. ``progress(message)`` is told when a level starts."""
    import httpx

    base = check_url(settings.url)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limits = httpx.Limits(max_connections=max(settings.concurrency) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(settings.timeout_s, connect=10.0), limits=limits) as client:
        try:
            await wait_ready(client, base, settings.ready_timeout_s, progress)
            models = await list_models(client, base, headers)
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot reach {base}: {exc}") from None
        model = settings.model or (models[0] if models else None)
        if model is None:
            raise ValueError(f"{base}/v1/models lists no model")
        if settings.warmup:
            if progress:
                progress(f"warm-up: {settings.warmup} request(s)")
            await _level(client, base, prompts, model, settings, headers, 1, settings.warmup)
        levels = []
        modes = settings.speculation or (None,)
        for c in settings.concurrency:  # the modes interleaved level by level (a drifting machine hurts none alone)
            for mode in modes:
                if progress:
                    progress(f"concurrency {c}{'' if mode is None else f', speculation {mode}'}: "
                             f"{settings.requests} requests")
                before = await scrape_metrics(client, base, model)
                results, wall = await _level(client, base, prompts, model, settings, headers, c, settings.requests,
                                             mode)
                after = await scrape_metrics(client, base, model)
                levels.append(_summary(c, results, wall, _spec_delta(before, after), mode) | {"run_order": len(levels)})
    levels.sort(key=lambda lv: modes.index(lv["speculation"]))  # reported mode by mode (a stable sort)
    return {"model": model, "levels": levels}

