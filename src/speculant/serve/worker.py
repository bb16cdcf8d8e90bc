"""One model, one decoding thread, a bounded FIFO queue in front of it, continuous batching behind it.

The HTTP handlers (asyncio) tokenise a request and :meth:`Worker.submit` a :class:`Job`; the worker thread keeps a
:class:`speculant.core.batch.Batch` of up to ``max_batch`` jobs (``--max-batch``), each with a fresh drafter of the
session's method (drafters hold per-generation state), its own sampling settings, seed and stop tokens. At each
step boundary waiting jobs join in arrival order (their prompts are prefilled as they join, or, joining running
jobs, ``--prefill-chunk`` tokens per step inside the batch's forward: a long prompt does not stall the running
streams), then one batched step drafts for every job and verifies them all in one target forward. Each job's committed tokens go through its
:class:`~speculant.models.text.Detokenizer` and :class:`~speculant.models.text.StopMatcher` and are handed back to the
handler's event loop as events (``("text", str)``, then ``("done", Result)`` or ``("error", str)``). The statistics
of a response (τ, accepted per position) are the engine's own step events (:class:`~speculant.core.types.StepEvent`),
not recomputed.

A job leaves the batch at the next step boundary when it finished, when a stop string is complete, when its client
went away (streaming or not: :meth:`Worker.cancel`) or when the server aborts it (shutdown: ``finish_reason``
``abort``, vLLM's name); the others go on. A failure while joining fails that job; a failure inside a step fails
the jobs of that step; either way it is logged, answered as an error, and the thread goes on.

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
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..core.speculation import Speculation, row_cost
from ..core.types import SamplingParams, StepEvent
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
    cached_tokens: int = 0  # prompt tokens whose keys/values were reused from the prefix cache


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
    sources: bool = False  # a ("sources", {...}) event before each text event: which characters were drafts
    speculation: str | None = None  # this request's speculation mode (None: the server's --speculation)
    prompt_embeds: Any = None  # [1, len(ids), H]: an image prompt's embeddings (a vision-language target)
    eos: list[int] | None = None  # its own stop tokens, never shown as text (None: the worker's, by ``chat``)
    constraint: Any = None  # a speculant.structured CompiledFormat: the reply follows it (a fresh matcher per job)
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


class _Active:
    """A job in the batch: its sequence, the text handed out so far (detokenizer, stop strings, logprob entries)
    and the statistics of its steps, read from the engine's step events."""

    def __init__(self, worker: Worker, job: Job, index: int, start: float) -> None:
        self.worker, self.job, self.index, self.start = worker, job, index, start
        self.detok = Detokenizer(worker.tokenizer, worker.tokenizer_lock)
        self.stops = StopMatcher(job.stop)
        self.steps = {"calls": 0, "tokens": 0, "draft": 0, "accepted": 0, "per_pos": []}
        self.first: float | None = None
        self.drafter = None  # its observed drafter (--online): what the adapter learns from
        self.cached = 0  # prompt tokens reused from the prefix cache
        self.generated: list[int] = []
        self.returned = 0  # characters of text handed to the client
        self.entries: list[dict] = []  # logprob entries of generated (job.logprobs set)
        self.sent = 0  # entries handed to the client
        self._held: list[list] = []  # [chars, source] of text fed to the stop matcher and not handed out yet
        self.hidden = frozenset(job.eos or ())  # stop tokens that are no text even when the tokenizer has them

    def release(self, upto: int) -> None:
        """A ("logprobs", entries) event for generated[sent:upto], before its text."""
        if self.job.logprobs is not None and upto > self.sent:
            self.job.emit("logprobs", self.entries[self.sent:upto])
            self.sent = upto

    def on_step(self, event: StepEvent) -> bool:
        """Take one step's event (its committed tokens go out as text); True when the job must stop now: its client
        went away, a stop string is complete, or the server aborts it."""
        job, steps, m = self.job, self.steps, self.worker.metrics
        steps["calls"] += 1
        steps["tokens"] += len(event.tokens)
        steps["draft"] += event.drafted
        steps["accepted"] += event.accepted
        for pos in range(event.accepted):
            if pos == len(steps["per_pos"]):
                steps["per_pos"].append(0)
            steps["per_pos"][pos] += 1
        m.step(len(event.tokens), event.drafted, event.accepted)
        self.generated.extend(event.tokens)
        if event.logprobs is not None:
            self.entries.extend(token_entries(self.worker.tokenizer, event.logprobs, self.worker.tokenizer_lock))
        if self.first is None:
            self.first = time.perf_counter()
            m.ttft.observe(self.first - job.arrived)
        if job.cancelled.is_set():
            return True
        shown = event.tokens
        if event.done and shown and shown[-1] in self.hidden:
            shown = shown[:-1]  # e.g. a FIM end token the tokenizer would print (<|file_sep|>)
        text = self._text(event, shown) if job.sources else self.stops.feed(self.detok.push(shown))
        if text:
            self.returned += len(text)
            # with stop strings, only the tokens of text handed out: held text may yet be trimmed
            if job.logprobs is not None:  # the prefix search decodes: only when logprobs are asked for
                self.release(self.worker._tokens_for(self.generated, self.returned) if job.stop
                             else len(self.generated))
            job.emit("text", text)
        return self.stops.hit or job.aborted.is_set()  # aborted: this step's text was handed over

    def _text(self, event: StepEvent, shown: list[int]) -> str:
        """The text of ``event``'s tokens ``shown`` to hand out now, preceded by a ("sources", ...) event that says
        which of its characters came from accepted draft tokens and which from the target's own (bonus) token."""
        cut = event.accepted if len(event.tokens) > event.accepted else len(event.tokens)
        out = ""
        for part, source in ((shown[:cut], "draft"), (shown[cut:], "target")):
            piece = self.detok.push(part) if part else ""
            if piece:
                self._held.append([len(piece), source])
                out += self.stops.feed(piece)
        if out:
            self.job.emit("sources", {"sources": self._spans(len(out)), "tokens": len(event.tokens),
                                      "accepted": event.accepted})
        return out

    def _spans(self, chars: int) -> list[list]:
        """``[[chars, source], ...]`` of the next ``chars`` characters handed out (oldest held text first)."""
        spans = []
        while chars and self._held:
            n = min(chars, self._held[0][0])
            spans.append([n, self._held[0][1]])
            self._held[0][0] -= n
            chars -= n
            if not self._held[0][0]:
                self._held.pop(0)
        if chars:  # text the detokenizer held back (a split character) and released at the end
            spans.append([chars, "target"])
        return spans

    def finish(self, reason: str | None) -> tuple[str, Any] | None:
        """The job's last event once its sequence ended (``reason``: the engine's finish reason, ``"cancelled"``
        when the worker stopped it); None when nobody listens any more."""
        job, m, stops = self.job, self.worker.metrics, self.stops
        if job.cancelled.is_set() and not stops.hit:
            m.cancelled.inc()
            m.cancelled_tokens.inc(self.steps["tokens"])
            return "error", "cancelled"
        generated = self.generated
        if not stops.hit:
            tail = stops.feed(self.detok.finish())
            tail += stops.flush()
            self.release(len(generated))
            if tail:
                if job.sources:
                    job.emit("sources", {"sources": self._spans(len(tail)), "tokens": 0, "accepted": 0})
                job.emit("text", tail)
        if stops.hit:
            final = "stop"
            generated = generated[:self.worker._tokens_for(generated, self.returned)]
            self.release(len(generated))
        elif reason in ("stop", "length"):
            final = reason
        else:  # stopped by the server's shutdown before its end
            final = ABORT
        end = time.perf_counter()
        m.e2e.observe(end - job.arrived)
        if self.first is not None and self.steps["tokens"] > 1:
            m.tpot.observe((end - self.first) / (self.steps["tokens"] - 1))
        m.finished(final)
        stats = _stats(self.worker.settings.method, self.steps, end - self.start)
        return "done", Result(final, len(job.ids), len(generated), stats, generated,
                              self.entries[:len(generated)] if job.logprobs is not None else None, self.cached)


class Worker:
    """Loads the model (:meth:`load`), then decodes queued jobs on its own thread, up to ``max_batch`` at once
    (continuous batching: :class:`speculant.core.batch.Batch`).

    ``ready`` is set once the model is loaded; ``load_error`` holds the one-line reason when loading failed.
    ``tokenizer_lock`` guards the tokenizer, used by the handlers (encode) and the thread (decode)."""

    def __init__(self, settings: ServeSettings, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.load_ended = threading.Event()  # set once loading succeeded or failed
        self.tokenizer_lock = threading.Lock()
        self.session = None  # a speculant.session.Session once loaded
        self.speculation = None  # its speculant.core.speculation.Speculation (the forward costs it measured)
        self.online = None  # a speculant.online.OnlineAdapter with --online
        self.target = self.tokenizer = self.draft_model = None
        self.context_length: int | None = None
        self.token_chars = 1  # the most characters one token stands for (limits.longest_token_chars)
        self._queue: collections.deque[Job] = collections.deque()
        self._calls: collections.deque[tuple[Callable, tuple, Future]] = collections.deque()  # run by call()
        self._cond = threading.Condition()
        self._running: list[Job] = []  # the jobs in the batch
        self._closed = False
        self._admitting = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ model

    def load(self) -> None:
        """Load the target (and draft) of the settings through :mod:`speculant.session`; raises what loading
        raises."""
        from ..core.checks import context_length
        from .limits import longest_token_chars
        from ..session import load_plan
        from .settings import plan

        session = load_plan(plan(self.settings))
        self.session = session
        self.target, self.tokenizer, self.draft_model = session.target, session.tokenizer, session.draft
        self.context_length = context_length(session.target)
        self.token_chars = longest_token_chars(session.tokenizer)
        self.speculation = Speculation(self.settings.speculation)
        if self.settings.speculation == "auto":  # a first measure of what rows cost, before any request
            self.speculation.cost.calibrate(row_cost(session.target, self._forward()))
        if self.settings.online:
            from ..online import OnlineAdapter

            self.online = OnlineAdapter(session, online_config(self.settings), state_dir=self.settings.online_state)
            self.metrics.online_version.set(self.online.version)
            self.metrics.online_buffer.set(self.online.buffer.nbytes)
            self.online.on_update = lambda entry: self.metrics.online_update(entry["accepted"], entry["version"])
            # no thread of its own: this thread takes its steps while idle (_admit; the adapter's module doc says why)
        log.info("loaded %s (method %s, up to %d requests per batch, speculation %s)", self.settings.served_name,
                 session.method.spec, self.settings.max_batch, self.settings.speculation)

    def _forward(self) -> str:
        return self.session.generate_options().get("forward", "auto")

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
        ``on_fatal``.

        Every torch op of the server runs on this one thread: loading, the forward-cost calibration, decoding, the
        online adapter's steps and image encoding (:meth:`call`). On a machine with few cores, torch ops issued from
        a second thread (its own OpenMP team) slow each later parallel op of this one for as long as that thread
        lives, several times over for a quantized forward."""

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
                    self.load_ended.set()
                    return
            self.ready.set()
            self.load_ended.set()  # after ready: a startup that waited for it finds the model ready
            if on_ready is not None:
                on_ready()
            self._loop()

        self._thread = threading.Thread(target=main, name="speculant-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop taking jobs; the running ones are cancelled at their next step, waiting ones are dropped. With
        ``--online`` the adapter stops (and saves its state)."""
        with self._cond:
            self._closed = True
            for job in self._running:
                job.cancelled.set()
            for job in self._queue:
                job.cancelled.set()
                job.emit("error", "the server is shutting down")
            self._queue.clear()
            self.metrics.waiting.set(0)
            for _, _, future in self._calls:
                future.set_exception(ShuttingDown("the server is shutting down"))
            self._calls.clear()
            self._cond.notify_all()
        if self.online is not None:  # after the jobs: its update in flight ends at its next step, then it saves
            self.online.stop()

    def call(self, fn: Callable, *args: Any) -> Future:
        """Run ``fn(*args)`` on the decoding thread, between two steps (e.g. a vision encoder: every torch op of the
        server runs on that thread, see :meth:`start`); its future (:class:`ShuttingDown` if the server closes
        first)."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                future.set_exception(ShuttingDown("the server is shutting down"))
                return future
            self._calls.append((fn, args, future))
            self._cond.notify()
        return future

    def _run_calls(self) -> bool:
        """Run the calls waiting (:meth:`call`); whether there were any."""
        ran = False
        while True:
            with self._cond:
                if not self._calls:
                    return ran
                fn, args, future = self._calls.popleft()
            ran = True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001: the caller gets it
                    future.set_exception(exc)

    def submit(self, job: Job) -> None:
        """Queue ``job``; QueueFull when ``max_queue`` jobs wait already (beyond a full batch), ShuttingDown once
        :meth:`stop_admitting` or :meth:`close` was called."""
        with self._cond:
            if self._closed or not self._admitting:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) + max(0, len(self._running) - self.settings.max_batch + 1) > self.settings.max_queue:
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
            return not self._running and not self._queue

    def abort(self) -> None:
        """End every job now, with ``finish_reason`` :data:`ABORT`: the running ones at their next step (with what
        they generated), the queued ones at once (nothing generated)."""
        with self._cond:
            for job in self._running:
                job.aborted.set()
            for job in self._queue:
                job.aborted.set()
                self.metrics.finished(ABORT)
                job.emit("done", Result(ABORT, len(job.ids), 0, _stats(self.settings.method, {}, 0.0)))
            self._queue.clear()
            self.metrics.waiting.set(0)

    def cancel(self, job: Job) -> None:
        """The client of ``job`` went away: drop it from the queue, or take it out of the batch at the next step."""
        with self._cond:
            job.cancelled.set()
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.waiting.set(len(self._queue))
                self.metrics.cancelled.inc()
            self._cond.notify()

    def _admit(self, running: int) -> list[Job] | None:
        """The queued jobs that join the batch at this step boundary (up to ``max_batch`` running); waits while
        nothing runs or waits, meanwhile taking the online adapter's steps once idle for its ``quiet_s``; None once
        closed."""
        idle_since = time.monotonic()
        while True:
            if self._run_calls():
                idle_since = time.monotonic()  # a call's work was not idleness
            with self._cond:
                if self._closed:
                    return None
                if self._queue or running:
                    joining = []
                    while self._queue and running + len(joining) < self.settings.max_batch:
                        joining.append(self._queue.popleft())
                    self._running.extend(joining)
                    self.metrics.waiting.set(len(self._queue))
                    return joining
                if self._calls:
                    continue  # run them first (top of the loop)
                if self.online is None or not self.online.pending():
                    self._cond.wait()
                    idle_since = time.monotonic()
                    continue
                left = self.online.config.quiet_s - (time.monotonic() - idle_since)
                if left > 0:
                    self._cond.wait(left)
                    continue
            self._online_step()  # idle long enough: one step, outside the lock

    def _online_step(self) -> None:
        """One step of the online adapter's update (a request arriving meanwhile waits for it); a failing update is
        dropped with the drafter unchanged, and the server goes on."""
        self.online.work_or_abandon()
        self.metrics.online_buffer.set(self.online.buffer.nbytes)

    def _leave(self, job: Job, last: tuple[str, Any] | None) -> None:
        """``job`` left the batch: free its place before its client hears the end (its next request finds room)."""
        with self._cond:
            self._running.remove(job)
            self.metrics.running.set(len(self._running))
        if last is not None:
            job.emit(*last)

    def _loop(self) -> None:
        from ..core.batch import Batch

        batch: Batch | None = None
        active: dict[int, _Active] = {}
        while (joining := self._admit(len(active))) is not None:
            if batch is None:
                batch = Batch(self.target, self._forward(), self.speculation, self.session.prefix_cache,
                              prefill_chunk=self.settings.prefill_chunk)
            for job in joining:
                try:
                    a = self._join(batch, job)
                except Exception as exc:  # noqa: BLE001: one request's failure never stops the server
                    self._leave(job, self._failure(exc))
                    continue
                if a is None:
                    self._leave(job, None)
                else:
                    active[a.index] = a
            self.metrics.running.set(len(active))
            if not active:
                continue
            self.metrics.batch(len(active))
            try:
                events = batch.step()
            except Exception as exc:  # noqa: BLE001: the step failed for every job in it; the server goes on
                last = self._failure(exc)
                for a in active.values():
                    self._leave(a.job, last)
                active.clear()
                batch = None  # a fresh batch: the failed one's caches may be half-written
                continue
            self.metrics.rows.observe(batch.rows)
            self.metrics.shared_drafts.inc(batch.step_draft_forwards)
            self.metrics.shared_draft_requests.inc(batch.step_draft_segments)
            self.metrics.prefill_chunk_tokens.inc(batch.prefill_rows)
            for event in events:
                a = active[event.sequence]
                try:
                    stop = a.on_step(event)
                    if not (event.done or stop):
                        continue
                    reason = event.finish_reason if event.done else ("cancelled" if a.job.cancelled.is_set()
                                                                     else None)
                    last = a.finish(reason)
                except Exception as exc:  # noqa: BLE001: this job's text handling failed; the others go on
                    last, event.done = self._failure(exc), False
                if not event.done:
                    batch.cancel(a.index)
                batch.release(a.index)
                del active[a.index]
                self._observe(a)
                self._leave(a.job, last)
            for index in [i for i, a in active.items() if a.job.cancelled.is_set() or a.job.aborted.is_set()]:
                a = active.pop(index)  # marked between steps: leaves before the next one
                batch.cancel(index)
                batch.release(index)
                try:
                    last = a.finish("cancelled" if a.job.cancelled.is_set() else None)
                except Exception as exc:  # noqa: BLE001
                    last = self._failure(exc)
                self._observe(a)
                self._leave(a.job, last)
        if batch is not None:
            for a in active.values():
                self._leave(a.job, None)

    def _observe(self, a: _Active) -> None:
        """With ``--online``: what verification said of the job's drafts goes to the adapter's buffer."""
        if self.online is not None and a.drafter is not None:
            self.online.observe(a.drafter)
            self.metrics.online_buffer.set(self.online.buffer.nbytes)

    def _failure(self, exc: Exception) -> tuple[str, str]:
        log.error("request failed", exc_info=exc)
        self.metrics.failed.inc()
        return "error", f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]

    # ------------------------------------------------------------------------------------------ one job

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

    def _join(self, batch, job: Job) -> _Active | None:
        """Add ``job`` to the batch (its prompt is prefilled now, or chunk by chunk in the next steps: its first
        token, and so its time to first token, comes once the prompt is in); None when its client went away while it
        waited."""
        m = self.metrics
        start = time.perf_counter()
        m.queue_time.observe(start - job.arrived)
        if job.cancelled.is_set():
            m.cancelled.inc()
            return None
        m.prompt_tokens.inc(len(job.ids))
        eos = [] if job.ignore_eos else job.eos if job.eos is not None else self.stop_ids(job.chat)
        options = {k: v for k, v in self.session.generate_options().items() if k != "forward"}
        s = job.sampling
        observed = self.online.drafter() if self.online is not None else None  # what the adapter learns from
        drafter = observed if observed is not None else self.session.drafter()
        if job.prompt_embeds is not None and drafter is not None:
            drafter = self.session.text_only(drafter)  # the drafter reads the text of an image prompt only
        if job.constraint is not None:
            options["constraint"] = job.constraint.constraint()
        index = batch.add(job.ids, drafter, job.max_tokens, s.temperature, s.top_k, s.top_p, s.seed, eos,
                          logprobs=job.logprobs, speculation=job.speculation, prompt_embeds=job.prompt_embeds,
                          **options)
        a = _Active(self, job, index, start)
        a.drafter = observed
        a.cached = batch.result(index).stats.prompt_cached_tokens
        if self.session.prefix_cache is not None:
            m.prefix_cache_queries.inc(len(job.ids))
            m.prefix_cache_hits.inc(a.cached)
        return a


def online_config(settings: ServeSettings):
    """The :class:`speculant.online.OnlineConfig` of a server's ``--online-*`` options."""
    from ..online import OnlineConfig

    return OnlineConfig(update_every=settings.online_every, min_held=settings.online_min_held,
                        min_z=settings.online_min_z, traffic=settings.online_traffic,
                        traffic_min_ngram=settings.online_traffic_min_ngram,
                        traffic_scoring=settings.online_traffic_scoring,
                        traffic_min_score=settings.online_traffic_min_score,
                        traffic_tree=settings.online_traffic_tree, distill=settings.online_distill)


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
