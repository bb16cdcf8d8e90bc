"""One model, one decoding thread, a bounded FIFO queue in front of it.

The HTTP handlers (asyncio) tokenise a request and :meth:`Worker.submit` a :class:`Job`; the worker thread takes
jobs in arrival order and decodes one at a time with its :class:`speculant.session.Session` (loaded from the
settings, as every front-end loads), a fresh drafter per job (drafters hold per-generation state). Each verification step's committed tokens go through the job's
:class:`~speculant.models.text.Detokenizer` and :class:`~speculant.models.text.StopMatcher` and are handed back to
the handler's event loop as events (``("text", str)``, then ``("done", Result)`` or ``("error", str)``).

Stopping a generation early: the engine has no cancel flag, so the stream callback raises (:class:`_Stop`) at the
next step when the job was cancelled (its client went away), aborted (the server is shutting down: it ends with
``finish_reason`` ``abort``, vLLM's name) or a stop string is complete; ``generate`` lets it propagate. A failure
in one job is logged and answered as an error; the thread goes on with the next job.

Shutting down (:mod:`speculant.serve.shutdown`): :meth:`Worker.stop_admitting`, then wait for :meth:`Worker.idle`,
then :meth:`Worker.abort` what is left.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.types import SamplingParams
from .logprobs import token_entries
from .metrics import ServerMetrics
from .settings import ServeSettings
from ..models.text import Detokenizer, StopMatcher

__all__ = ["ABORT", "Job", "QueueFull", "Result", "ShuttingDown", "Worker"]

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already (answered 429)."""


class ShuttingDown(Exception):
    """The server is shutting down and takes no new job (answered 503)."""


ABORT = "abort"
"""The ``finish_reason`` of a generation ended by the server's shutdown (vLLM's: its FINISH_REASON_STRINGS)."""


class _Stop(Exception):
    """Raised from the stream callback to end a generation at this step (cancelled, or a stop string)."""


@dataclass
class Result:
    """How a generation ended: ``finish_reason`` (``stop``: end-of-sequence token or stop string; ``length``;
    :data:`ABORT`: the server shut down first),
    token counts, the ids of the returned text and the speculative statistics of this response (the ``speculant``
    field). After a stop string, ``completion_tokens`` and ``token_ids`` cover what was returned only: the
    shortest prefix of the generated tokens whose text holds the returned text (a token the cut falls inside
    counts; the tokens a speculative step generated past the stop string do not)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # the token entries of token_ids (serve.logprobs) when asked for


@dataclass(eq=False)
class Job:
    """One request: prompt ids and sampling settings in, events out to the event loop that submitted it."""

    ids: list[int]
    max_tokens: int
    chat: bool
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs (then no "logprobs" events)
    arrived: float = field(default_factory=time.perf_counter)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)  # nobody listens any more
    aborted: threading.Event = field(default_factory=threading.Event)  # the server ends it (shutdown)

    def __post_init__(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.events is None:
            self.events = asyncio.Queue()

    def emit(self, kind: str, payload: Any) -> None:
        """Hand an event to the submitting loop (thread-safe); dropped when that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop was closed (server shutting down)
            pass


class _CountingDrafter:
    """Passes a drafter through and remembers the size of its last proposal (draft tokens of this step); every
    other attribute is the drafter's own (e.g. its ``model``, which a KV policy may use)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.proposed = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def begin(self, state) -> None:
        self.inner.begin(state)

    def propose(self, state):
        tree = self.inner.propose(state)
        self.proposed = len(tree)
        return tree

    def commit(self, state, accepted) -> None:
        self.inner.commit(state, accepted)


class Worker:
    """Loads the model (:meth:`load`), then decodes queued jobs one at a time on its own thread.

    ``ready`` is set once the model is loaded; ``load_error`` holds the one-line reason when loading failed.
    ``tokenizer_lock`` guards the tokenizer, used by the handlers (encode) and the thread (decode)."""

    def __init__(self, settings: ServeSettings, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.tokenizer_lock = threading.Lock()
        self.session = None  # a speculant.session.Session once loaded
        self.target = self.tokenizer = self.draft_model = None
        self.context_length: int | None = None
        self.token_chars = 1  # the most characters one token stands for (limits.longest_token_chars)
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._admitting = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ model

    def load(self) -> None:
        """Load the target (and draft) of the settings through :mod:`speculant.session`; raises what loading
        raises."""
        from ..core.checks import context_length
        from .limits import longest_token_chars
        from .settings import plan

        session = plan(self.settings).load()
        self.session = session
        self.target, self.tokenizer, self.draft_model = session.target, session.tokenizer, session.draft
        self.context_length = context_length(session.target)
        self.token_chars = longest_token_chars(session.tokenizer)
        log.info("loaded %s (method %s)", self.settings.served_name, session.method.spec)

    def stop_ids(self, chat: bool) -> list[int] | None:
        """The end-of-sequence ids of a request: end of the assistant's turn for chats, the model's own EOS
        (generate()'s default) for plain completions."""
        from ..models.chat import stop_ids

        return stop_ids(self.tokenizer, self.target) if chat else None

    # ------------------------------------------------------------------------------------------ thread

    def start(self, load: bool = True, on_ready: Callable[[], None] | None = None,
              on_fatal: Callable[[str], None] | None = None) -> None:
        """Start the decoding thread; with ``load`` it loads the model first (``ready`` is set after, then
        ``on_ready()`` is called), and a failure to load is logged, kept in ``load_error`` and passed to
        ``on_fatal``."""

        def main() -> None:
            if load:
                try:
                    self.load()
                except Exception as exc:  # noqa: BLE001: any failure to load ends the server with its message
                    self.load_error = " ".join(str(exc).split()) or type(exc).__name__
                    if on_fatal is not None:  # the caller reports it (speculant serve: one error line)
                        log.debug("loading the model failed", exc_info=True)
                        on_fatal(self.load_error)
                    else:
                        log.error("loading the model failed: %s", self.load_error, exc_info=True)
                    return
            self.ready.set()
            if on_ready is not None:
                on_ready()
            self._loop()

        self._thread = threading.Thread(target=main, name="speculant-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop taking jobs; the running one is cancelled at its next step, waiting ones are dropped."""
        with self._cond:
            self._closed = True
            if self._running is not None:
                self._running.cancelled.set()
            for job in self._queue:
                job.cancelled.set()
                job.emit("error", "the server is shutting down")
            self._queue.clear()
            self.metrics.waiting.set(0)
            self._cond.notify_all()

    def submit(self, job: Job) -> None:
        """Queue ``job``; QueueFull when ``max_queue`` jobs wait already (and one is being decoded), ShuttingDown
        once :meth:`stop_admitting` or :meth:`close` was called."""
        with self._cond:
            if self._closed or not self._admitting:
                raise ShuttingDown("the server is shutting down")
            busy = len(self._queue) + (self._running is not None)
            if busy > self.settings.max_queue:
                raise QueueFull(f"the queue is full ({self.settings.max_queue} requests waiting)")
            self._queue.append(job)
            self.metrics.waiting.set(len(self._queue))
            self._cond.notify()

    def stop_admitting(self) -> None:
        """Take no new job (:meth:`submit` raises ShuttingDown); the running and queued ones go on."""
        with self._cond:
            self._admitting = False

    def idle(self) -> bool:
        """Whether no job runs or waits."""
        with self._cond:
            return self._running is None and not self._queue

    def abort(self) -> None:
        """End every job now, with ``finish_reason`` :data:`ABORT`: the running one at its next step (with what it
        generated), the queued ones at once (nothing generated)."""
        with self._cond:
            if self._running is not None:
                self._running.aborted.set()
            for job in self._queue:
                job.aborted.set()
                self.metrics.finished(ABORT)
                job.emit("done", Result(ABORT, len(job.ids), 0, _stats(self.settings.method, {}, 0.0)))
            self._queue.clear()
            self.metrics.waiting.set(0)

    def cancel(self, job: Job) -> None:
        """The client of ``job`` went away: drop it from the queue, or stop its generation at the next step."""
        with self._cond:
            job.cancelled.set()
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.waiting.set(len(self._queue))
                self.metrics.cancelled.inc()

    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            job = self._queue.popleft()
            self._running = job
            self.metrics.waiting.set(len(self._queue))
            self.metrics.running.set(1)
            return job

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            try:
                last = self._run(job)
            except Exception as exc:  # noqa: BLE001: one request's failure never stops the server
                log.exception("request failed")
                self.metrics.failed.inc()
                last = ("error", f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500])
            with self._cond:  # free before the client hears the end, so that its next request finds room
                self._running = None
                self.metrics.running.set(0)
            if last is not None:
                job.emit(*last)

    # ------------------------------------------------------------------------------------------ one job

    def _run(self, job: Job) -> tuple[str, Any] | None:
        """Decode ``job``, emitting its text as it comes; returns its last event (None: nobody listens)."""
        from ..core.checks import resolve_eos

        m = self.metrics
        start = time.perf_counter()
        m.queue_time.observe(start - job.arrived)
        if job.cancelled.is_set():
            m.cancelled.inc()
            return None
        m.prompt_tokens.inc(len(job.ids))
        drafter = self.session.drafter()
        counting = _CountingDrafter(drafter) if drafter is not None else None
        detok = Detokenizer(self.tokenizer, self.tokenizer_lock)
        stops = StopMatcher(job.stop)
        steps = {"calls": 0, "tokens": 0, "draft": 0, "accepted": 0, "per_pos": []}
        first: list[float] = []
        generated: list[int] = []

        returned = [0]  # characters of text handed to the client
        entries: list[dict] = []  # logprob entries of generated (job.logprobs set)
        sent = [0]  # entries handed to the client

        def release(upto: int) -> None:  # a ("logprobs", entries) event for generated[sent:upto], before its text
            if job.logprobs is not None and upto > sent[0]:
                job.emit("logprobs", entries[sent[0]:upto])
                sent[0] = upto

        def on_step(new_ids: list[int], logprobs=None) -> None:
            proposed = counting.proposed if counting is not None else 0
            if counting is not None:
                counting.proposed = 0  # a step without a proposal (the last token) drafts nothing
            accepted = len(new_ids) - 1 if proposed else 0
            steps["calls"] += 1
            steps["tokens"] += len(new_ids)
            steps["draft"] += proposed
            steps["accepted"] += accepted
            for pos in range(accepted):
                if pos == len(steps["per_pos"]):
                    steps["per_pos"].append(0)
                steps["per_pos"][pos] += 1
            m.step(len(new_ids), proposed)
            generated.extend(new_ids)
            if logprobs is not None:
                entries.extend(token_entries(self.tokenizer, logprobs, self.tokenizer_lock))
            if not first:
                first.append(time.perf_counter())
                m.ttft.observe(first[0] - job.arrived)
            if job.cancelled.is_set():
                raise _Stop
            text = stops.feed(detok.push(new_ids))
            if text:
                returned[0] += len(text)
                # with stop strings, only the tokens of text handed out: held text may yet be trimmed
                if job.logprobs is not None:  # the prefix search decodes: only when logprobs are asked for
                    release(self._tokens_for(generated, returned[0]) if job.stop else len(generated))
                job.emit("text", text)
            if stops.hit or job.aborted.is_set():  # aborted: this step's text was handed over
                raise _Stop

        eos = [] if job.ignore_eos else self.stop_ids(job.chat)
        try:
            self.session.generate(job.ids, drafter=counting, max_new_tokens=job.max_tokens,
                                  temperature=job.sampling.temperature, top_k=job.sampling.top_k,
                                  top_p=job.sampling.top_p, seed=job.sampling.seed, eos_token_id=eos, stream=on_step,
                                  logprobs=job.logprobs)
        except _Stop:
            pass
        if job.cancelled.is_set() and not stops.hit:
            m.cancelled.inc()
            m.cancelled_tokens.inc(steps["tokens"])
            return "error", "cancelled"
        if not stops.hit:
            tail = stops.feed(detok.finish())
            tail += stops.flush()
            release(len(generated))
            if tail:
                job.emit("text", tail)
        ended_by_eos = bool(generated) and generated[-1] in resolve_eos(self.target, eos)
        complete = stops.hit or ended_by_eos or len(generated) >= job.max_tokens
        reason = "stop" if stops.hit or ended_by_eos else ("length" if complete or not job.aborted.is_set()
                                                           else ABORT)
        if stops.hit:
            generated = generated[:self._tokens_for(generated, returned[0])]
            release(len(generated))
        end = time.perf_counter()
        m.e2e.observe(end - job.arrived)
        if first and steps["tokens"] > 1:
            m.tpot.observe((end - first[0]) / (steps["tokens"] - 1))
        m.finished(reason)
        stats = _stats(self.settings.method, steps, end - start)
        return "done", Result(reason, len(job.ids), len(generated), stats, generated,
                              entries[:len(generated)] if job.logprobs is not None else None)

    def _tokens_for(self, ids: list[int], chars: int) -> int:
        """The fewest leading tokens of ``ids`` whose text (as the detokenizer decodes it) has ``chars``
        characters: a binary search, since a longer prefix never decodes shorter."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            with self.tokenizer_lock:
                n = len(self.tokenizer.decode(ids[:mid], skip_special_tokens=True))
            if n >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo


def _stats(method: str, steps: dict, decode_s: float) -> dict[str, Any]:
    """The ``speculant`` field of a response from its step counts (``{}``: a job that never ran)."""
    calls, tokens = steps.get("calls", 0), steps.get("tokens", 0)
    return {
        "method": method,
        "acceptance_length": tokens / calls if calls else 0.0,
        "target_calls": calls,
        "draft_tokens": steps.get("draft", 0),
        "accepted_tokens": steps.get("accepted", 0),
        "accepted_per_position": steps.get("per_pos", []),
        "decode_s": round(decode_s, 6),
    }
