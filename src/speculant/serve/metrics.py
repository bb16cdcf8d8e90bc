"""Prometheus metrics of the server, named as vLLM names them (so dashboards and load tools written for vLLM read
them), each labelled with ``model_name``; plus speculant's own counters for what vLLM has no name for.

vLLM's names (``prometheus_client`` appends ``_total`` to counters in the exposition):

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges): the requests in the batch being decoded
  (up to ``--max-batch``) and the requests queued behind it;
* ``vllm:prompt_tokens``, ``vllm:generation_tokens`` (counters): tokens read and generated (every generated token,
  also those of a cancelled request);
* ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` (counters): prompt tokens looked up in the prefix cache
  and those of them reused (:mod:`speculant.core.prefix_cache`; with ``--prefix-cache-mb 0``, none);
* ``vllm:request_success`` (counter, label ``finished_reason``: ``stop``, ``length``, or ``abort`` for requests
  the server ended while shutting down, as vLLM counts them);
* ``vllm:time_to_first_token_seconds`` (request arrival to its first generated token, queueing and prefill
  included), ``vllm:time_per_output_token_seconds`` (per request: (end - first token) / (tokens - 1)),
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (histograms);
* speculative decoding, per verification step that carried a draft: ``vllm:spec_decode_num_drafts`` (such
  steps), ``vllm:spec_decode_num_draft_tokens`` (tokens proposed: the draft tree's size),
  ``vllm:spec_decode_num_accepted_tokens`` (draft tokens accepted), ``vllm:spec_decode_num_accepted_tokens_per_pos``
  (label ``position``, 0-based: steps whose draft at depth ``position + 1`` was accepted).

speculant's: ``speculant:target_calls`` (target forwards while decoding: τ = generation tokens / target calls),
``speculant:batch_size`` (gauge: requests in the last batched step), ``speculant:batch_steps`` (counter: batched
steps, one target forward each; per-request ``target_calls`` count each request's share),
``speculant:step_rows`` (histogram: rows of each batched step's target forward, every request's root and draft),
``speculant:shared_draft_forwards`` and ``speculant:shared_draft_requests`` (counters: draft forwards run for
several requests at once, and the requests' forwards they served: their ratio is how many requests shared one),
``speculant:prefill_chunk_tokens`` (counter: prompt tokens that entered in chunks inside the running requests'
steps, ``--prefill-chunk``),
``speculant:requests_cancelled`` (clients that went away, or stop strings never reached: cancelled while still
sending the request body, queued or decoding) and ``speculant:cancelled_generation_tokens`` (tokens generated for
cancelled requests before the generation stopped), ``speculant:requests_failed`` (requests answered 500).

Every server has its own registry (tests and Ray replicas may hold several apps in one process).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

disable_created_metrics()  # no *_created series: they double every counter for nothing a dashboard reads

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                    640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class ServerMetrics:
    """The server's metrics for one served model; the worker calls the methods below as requests progress."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        reg, m = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels: Sequence[str] = ()):
            return Counter(name, doc, [*m, *labels], registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]):
            return Histogram(name, doc, m, buckets=buckets, registry=reg).labels(model_name)

        self.running = Gauge("vllm:num_requests_running", "Requests being decoded", m, registry=reg).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued", m, registry=reg).labels(model_name)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens read").labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated").labels(model_name)
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache").labels(model_name)
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prompt tokens reused from the prefix cache").labels(model_name)
        self._success = counter("vllm:request_success", "Requests finished", ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Request arrival to first token",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first",
                              _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request arrival to last token", _E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time queued before decoding",
                                    _LATENCY_BUCKETS)
        self.drafts = counter("vllm:spec_decode_num_drafts", "Verification steps that carried a draft").labels(
            model_name)
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed").labels(model_name)
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted").labels(
            model_name)
        self._accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Steps whose draft at depth position+1 was accepted", ["position"])
        self.target_calls = counter("speculant:target_calls", "Target forwards while decoding").labels(model_name)
        self.cancelled = counter("speculant:requests_cancelled", "Requests cancelled (client gone)").labels(
            model_name)
        self.cancelled_tokens = counter("speculant:cancelled_generation_tokens",
                                        "Tokens generated for requests that were then cancelled").labels(model_name)
        self.failed = counter("speculant:requests_failed", "Requests that failed (HTTP 500)").labels(model_name)
        self.batch_size = Gauge("speculant:batch_size", "Requests in the last batched step", m,
                                registry=reg).labels(model_name)
        self.batch_steps = counter("speculant:batch_steps", "Batched steps (one target forward each)").labels(
            model_name)
        self.online_version = Gauge("speculant:online_drafter_version", "Updates of the drafter taken online (--online)",
                                    m, registry=reg).labels(model_name)
        self._online_updates = counter("speculant:online_updates", "Online drafter updates, by result", ["result"])
        self.online_buffer = Gauge("speculant:online_buffer_bytes", "Bytes held by the online buffer", m,
                                   registry=reg).labels(model_name)
        self.rows = histogram("speculant:step_rows", "Rows (tokens) of a batched step's target forward", _ROWS)
        self.shared_drafts = counter("speculant:shared_draft_forwards",
                                     "Draft forwards run for several requests at once").labels(model_name)
        self.shared_draft_requests = counter("speculant:shared_draft_requests",
                                             "Requests' draft forwards served by shared ones").labels(model_name)
        self.prefill_chunk_tokens = counter("speculant:prefill_chunk_tokens",
                                            "Prompt tokens prefilled in chunks inside batched steps").labels(model_name)
        for reason in ("stop", "length"):  # present from the start, so a scrape before any request sees 0
            self._success.labels(model_name, reason)
        self.running.set(0)
        self.waiting.set(0)

    def step(self, new_tokens: int, draft_tokens: int, accepted: int) -> None:
        """One request's verification step: ``new_tokens`` committed, ``accepted`` of them accepted draft tokens
        (the engine's :class:`~speculant.core.types.StepEvent`), from a draft of ``draft_tokens`` tokens (0: no
        draft). (In a batch, each request's step counts as one target call: τ stays per request.)"""
        self.target_calls.inc()
        self.generation_tokens.inc(new_tokens)
        if draft_tokens > 0:
            self.drafts.inc()
            self.draft_tokens.inc(draft_tokens)
            self.accepted_tokens.inc(accepted)
            for pos in range(accepted):
                self._accepted_per_pos.labels(self.model_name, str(pos)).inc()

    def batch(self, size: int) -> None:
        """A batched step is about to run over ``size`` requests."""
        self.batch_size.set(size)
        self.batch_steps.inc()

    def online_update(self, accepted: bool, version: int) -> None:
        """An online update ended (``accepted``: swapped in, else rolled back); the drafter's version now."""
        self._online_updates.labels(self.model_name, "accepted" if accepted else "rolled_back").inc()
        self.online_version.set(version)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
