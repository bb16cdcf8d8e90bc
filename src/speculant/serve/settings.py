"""The settings of one server (one model per process), and their checks before anything is loaded.

``speculant serve`` reads its defaults from :class:`ServeSettings` (each default is defined here once);
:func:`check_settings` resolves what the command line leaves open (the method, the draft, model names to
directories) through :func:`speculant.plan.resolve`, as every front-end does, and raises a one-line ValueError for anything wrong, before the server listens or loads a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .guard import check_origins

__all__ = ["DEFAULT_TARGET", "MAX_PORT", "ServeSettings", "check_settings", "default_target", "plan"]

DEFAULT_TARGET = "smollm2-135m-instruct"
"""What ``speculant serve`` serves without ``--target``: a packaged chat model (the bundled toy default-target has
no chat template, so an OpenAI client's chat calls would all fail)."""


MAX_PORT = 65535
"""The largest TCP port."""


TRAFFIC_SCORINGS = ("frequent", "recent")
"""The traffic memory's scorings, the default first (:data:`speculant.online.traffic.SCORINGS`, named here without
importing torch)."""


def default_target() -> str:
    """:data:`DEFAULT_TARGET` when its package is installed, else a one-line ValueError saying what to install or
    pass: the server does not fall back to a model that cannot chat."""
    from ..models.sources import PACKAGED, packaged_gguf

    try:
        packaged_gguf(DEFAULT_TARGET)
    except ValueError:
        raise ValueError(
            f"speculant serve needs --target MODEL: its default, the chat model {DEFAULT_TARGET}, is not installed "
            f"(to serve it: {PACKAGED[DEFAULT_TARGET].install_hint()}); the bundled default-target has no chat "
            "template, pass --target default-target to serve it for /v1/completions only") from None
    return DEFAULT_TARGET


@dataclass(frozen=True)
class ServeSettings:
    """What ``speculant serve`` serves and how.

    ``target``, ``draft``, ``method``, ``kv_*``, ``dtype``, ``quantization``, ``threads``, ``device``: as
    :func:`speculant.plan.resolve` (``method`` None: the method measured fastest for a packaged target with its
    shipped drafter, else ``chain``, which needs a draft: ``draft`` or the drafter speculant ships for the target).
    ``target`` None: :func:`default_target` (a packaged chat model, or an error). ``model_name`` None: the target as
    given. ``max_queue``: requests that may wait behind a full batch; one more is answered 429. ``max_batch``:
    requests decoded together (continuous batching: one target forward per step for all of them; 1: one at a time).
    ``prefill_chunk``: prompt tokens per step of a request joining running ones (chunked prefill, folded into the
    step's forward, so that a long prompt does not stall the running streams; 0: the whole prompt at once;
    :class:`speculant.core.batch.Batch`). The default, 32, kept the streams' p99 step within 3x their step before the
    join on a 2-core CPU where 64 did not (``benchmarks/chunked_prefill.py``), and stays within the rows that attend
    row by row (:data:`speculant.core.attention.MAX_ROWS`).
    ``speculation``: how deep each request drafts per step (``auto``: by goodput from its measured acceptance and the
    measured cost of a forward over the batch's rows, :mod:`speculant.core.speculation`; ``on``: as deep as the method
    drafts; ``off``: plain decoding). ``api_key`` None: no authentication (printable ASCII: HTTP headers carry ASCII).
    ``metrics_need_key``: ``GET /metrics`` needs the API key too (by default it is open, as vLLM serves it, like
    ``GET /health``). ``port``: 0 to 65535 (0: a free one). ``allow_origin``: the browser origins
    (``http://localhost:3000``, or ``*``) allowed to call the server cross-origin, with CORS; without an API key
    every other origin, and any ``Host`` that is not this server's address or a loopback name, is refused
    (:mod:`speculant.serve.guard`). ``max_body_bytes``: a larger request body is answered 413 before it is read
    (:mod:`speculant.serve.limits`); the default, 4 MiB, is well above the longest prompt a served model can take: a
    128K-token context is about 0.5 MB of text (4 bytes per token), 1.5 MB if every character is sent as a
    ``\\uXXXX`` escape, and under 1 MB as token ids.
    ``shutdown_grace``: seconds that running and queued requests get to finish after SIGTERM or Ctrl-C, while new ones
    are answered 503; those still running then end with ``finish_reason`` ``abort`` (:mod:`speculant.serve.shutdown`).
    ``online``: adapt the draft model to the traffic (:mod:`speculant.online`): an update every ``online_every``
    finished requests once ``online_min_held`` requests are held back for the check, trained while no request waits,
    kept only if held-back agreement rises by McNemar's z >= ``online_min_z``
    (:class:`speculant.online.OnlineConfig`); ``online_traffic``: also draft up to that many tokens per step
    from earlier requests' tokens (:mod:`speculant.online.traffic`; 0: none), matching context suffixes of at least
    ``online_traffic_min_ngram`` tokens, continued by what followed them most often (``online_traffic_scoring``
    "frequent", the chain ending where its estimated chance falls below ``online_traffic_min_score``, or with
    ``online_traffic_tree`` > 0 a tree of that many nodes) or most recently ("recent"); ``online_distill`` False:
    the traffic memory only, no draft model trained (any method, any draft); ``online_state``: a directory the
    adapted drafter, its buffer and history are saved to on shutdown and resumed from. ``prefix_cache_mb``: MiB of
    keys/values of computed prompt prefixes kept for later requests (:mod:`speculant.core.prefix_cache`; 0: none)."""

    target: str | None = None
    draft: str | None = None
    method: str | None = None
    kv_policy: str | None = None
    kv_budget: int | None = None
    kv_block: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    threads: int | str | None = None
    device: str | None = None
    prefix_cache_mb: float = 2048.0  # speculant.plan.DEFAULT_PREFIX_CACHE_MB (tests hold them equal)
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    max_batch: int = 4
    prefill_chunk: int = 32
    speculation: str = "auto"
    api_key: str | None = None
    metrics_need_key: bool = False
    model_name: str | None = None
    allow_origin: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    shutdown_grace: float = 10.0
    online: bool = False
    online_every: int = 16
    online_min_held: int = 4
    online_min_z: float = 1.64
    online_traffic: int = 0
    online_traffic_min_ngram: int = 1
    online_traffic_scoring: str = TRAFFIC_SCORINGS[0]
    online_traffic_min_score: float = 0.1  # speculant.online.traffic.MIN_SCORE (tests hold them equal)
    online_traffic_tree: int = 0
    online_distill: bool = True
    online_state: str | None = None

    @property
    def served_name(self) -> str:
        return self.model_name or self.target


def plan(settings: ServeSettings):
    """The :class:`speculant.plan.SessionPlan` of ``settings`` (the one place model options are resolved)."""
    from ..plan import resolve

    return resolve(settings.target, settings.draft, settings.method, dtype=settings.dtype,
                   quantization=settings.quantization, device=settings.device,
                   threads=settings.threads, kv_policy=settings.kv_policy, kv_budget=settings.kv_budget,
                   kv_block=settings.kv_block, prefix_cache_mb=settings.prefix_cache_mb)


def check_settings(settings: ServeSettings) -> ServeSettings:
    """``settings`` with the method and draft chosen and model names resolved to checked directories
    (:func:`speculant.plan.resolve`: the rules of every front-end, so a method that needs a draft when none is
    given and speculant ships none for the target is an error, as for ``generate``); one-line ValueErrors for a
    bad method, KV options, device, or model, and for the server's own options. May convert a GGUF target once
    (see docs/models.md). Without a target: :func:`default_target`."""
    if settings.speculation not in ("auto", "on", "off"):  # speculant.core.speculation.MODES (no torch import here)
        raise ValueError(f"--speculation must be auto, on or off, got {settings.speculation!r}")
    if settings.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {settings.max_batch}")
    if settings.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 0, got {settings.prefill_chunk}")
    if settings.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {settings.max_queue}")
    if settings.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {settings.max_body_bytes}")
    if not settings.shutdown_grace >= 0:  # also refuses nan
        raise ValueError(f"--shutdown-grace must be >= 0 seconds, got {settings.shutdown_grace}")
    if settings.online_every < 1:
        raise ValueError(f"--online-every must be >= 1, got {settings.online_every}")
    if settings.online_min_held < 1:
        raise ValueError(f"--online-min-held must be >= 1, got {settings.online_min_held}")
    if not 0 <= settings.online_min_z < float("inf"):  # also refuses nan
        raise ValueError(f"--online-min-z must be >= 0, got {settings.online_min_z}")
    if settings.online_traffic < 0:
        raise ValueError(f"--online-traffic must be >= 0, got {settings.online_traffic}")
    if settings.online_traffic and not settings.online:
        raise ValueError("--online-traffic needs --online")
    if not 1 <= settings.online_traffic_min_ngram <= 3:
        raise ValueError(f"--online-traffic-min-ngram must be 1, 2 or 3, got {settings.online_traffic_min_ngram}")
    if settings.online_traffic_scoring not in TRAFFIC_SCORINGS:
        raise ValueError(f"--online-traffic-scoring must be one of {', '.join(TRAFFIC_SCORINGS)}, got "
                         f"{settings.online_traffic_scoring!r}")
    if settings.online_traffic_scoring != ServeSettings.online_traffic_scoring and not settings.online_traffic:
        raise ValueError("--online-traffic-scoring needs --online-traffic N")
    if not 0 <= settings.online_traffic_min_score < 1:  # also refuses nan
        raise ValueError(f"--online-traffic-min-score must be in [0, 1), got {settings.online_traffic_min_score}")
    if settings.online_traffic_min_score != ServeSettings.online_traffic_min_score and not (
            settings.online_traffic and settings.online_traffic_scoring == "frequent"):
        raise ValueError("--online-traffic-min-score needs --online-traffic N with frequent scoring")
    if settings.online_traffic_tree < 0:
        raise ValueError(f"--online-traffic-tree must be >= 0, got {settings.online_traffic_tree}")
    if settings.online_traffic_tree and not (settings.online_traffic and settings.online_traffic_scoring == "frequent"):
        raise ValueError("--online-traffic-tree needs --online-traffic N with frequent scoring")
    if settings.online_traffic_min_ngram != 1 and not settings.online_traffic:
        raise ValueError("--online-traffic-min-ngram needs --online-traffic N")
    if not settings.online_distill and not (settings.online and settings.online_traffic):
        raise ValueError("--no-online-distill needs --online and --online-traffic N (else nothing adapts)")
    if settings.online_state is not None and not settings.online:
        raise ValueError("--online-state needs --online")
    if not 0 <= settings.port <= MAX_PORT:
        raise ValueError(f"--port must be in [0, {MAX_PORT}], got {settings.port}")
    if settings.api_key is not None and not settings.api_key.strip():
        raise ValueError("--api-key is empty")
    if settings.api_key is not None and not (settings.api_key.isascii() and settings.api_key.isprintable()):
        # a client's header is read as Latin-1 bytes: a non-ASCII key could never match
        raise ValueError("--api-key must be printable ASCII (it travels in an HTTP header)")
    if settings.metrics_need_key and settings.api_key is None:
        raise ValueError("--metrics-need-key needs --api-key (there is no key to require)")
    settings = dataclasses.replace(settings, allow_origin=check_origins(settings.allow_origin))
    if settings.target is None:
        settings = dataclasses.replace(settings, target=default_target())
    p = plan(settings)
    # the resolved quantization too: the target is now a directory, whose packaged default a later resolve
    # would not find (a packaged target would then be served unquantized)
    return dataclasses.replace(settings, target=p.target, draft=p.draft, method=p.method.spec,
                               quantization=p.quantization, model_name=settings.model_name or settings.target)
