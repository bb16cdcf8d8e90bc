"""When an online update runs: a round taken one step at a time, between requests or after a quiet period.

A round (train a copy, check it, swap it in or roll it back) is a generator that yields after each forward (and
backward), so whoever drives it decides when the next step runs. :class:`RoundScheduler` holds the round under way
and starts one when the adapter says one is due. A server's decoding thread takes one step (:meth:`work`) whenever
no request has run or waited for ``quiet_s``, so a request that arrives waits for one step at most; that thread and
not one of its own, because on a machine with few cores torch ops issued from a second thread (its own OpenMP team)
slow every later parallel op of the decoding thread for as long as that thread lives, even while it idles.
:meth:`RoundScheduler.start` still runs rounds on a background thread for Python programs that want one, each step
after a quiet period (:meth:`RoundScheduler.set_busy`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

__all__ = ["RoundScheduler", "run_steps"]

log = logging.getLogger(__name__)


def run_steps(steps: Generator[None, None, Any]) -> Any:
    """Drive a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class RoundScheduler:
    """Drives update rounds a step at a time: ``due()`` says whether a round should start, ``new_round()`` starts
    one (a generator returning the round's result); ``quiet_s``: the idleness a background thread waits for."""

    def __init__(self, due: Callable[[], bool], new_round: Callable[[], Generator[None, None, Any]],
                 quiet_s: float) -> None:
        self._due, self._new_round, self.quiet_s = due, new_round, quiet_s
        self._current: Generator[None, None, Any] | None = None  # the round under way
        self.stopping = threading.Event()  # set by stop(): a round in flight ends early
        self._free = threading.Event()  # set while no request waits: a background round may take a step
        self._free.set()
        self._free_since = time.monotonic()
        self._server = False  # set_busy() was called: background steps wait for quiet periods
        self._thread: threading.Thread | None = None

    def pending(self) -> bool:
        """Whether :meth:`work` has something to do: a round under way, or one due."""
        return self._current is not None or self._due()

    def work(self) -> Any | None:
        """One step of the current round, starting a round if one is due; the round's result when this step ended
        it, else None."""
        if self._current is None:
            if not self._due():
                return None
            self._current = self._new_round()
        try:
            next(self._current)
        except StopIteration as done:
            self._current = None
            return done.value
        return None

    def drop(self) -> None:
        """Forget the round under way."""
        self._current = None

    def set_busy(self, busy: bool) -> None:
        """For :meth:`start`'s thread: whether requests are running or waiting (its steps run only after
        ``quiet_s`` of idleness)."""
        self._server = True
        if busy and not self.stopping.is_set():  # once stopping, a round in flight runs to its end unhindered
            self._free.clear()
        elif not self._free.is_set():
            self._free_since = time.monotonic()
            self._free.set()

    def wait_quiet(self) -> None:
        """Return once no request has been running or waiting for ``quiet_s`` (at once without :meth:`set_busy`,
        or when stopping)."""
        while self._server and not self.stopping.is_set():
            self._free.wait()
            idle = time.monotonic() - self._free_since
            if self._free.is_set() and idle >= self.quiet_s:
                return
            time.sleep(max(0.0, self.quiet_s - idle) + 0.001)

    def start(self, step: Callable[[], Any], poll_s: float = 0.5) -> None:
        """Call ``step`` (one step of a round, which must not raise) on a background thread whenever a round is
        pending, each call after a quiet period, until :meth:`stop`; checks every ``poll_s`` seconds."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self.stopping.wait(poll_s):
                while self.pending() and not self.stopping.is_set():
                    self.wait_quiet()
                    step()

        self._thread = threading.Thread(target=loop, name="speculant-online", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (a round in flight ends after its current step)."""
        self.stopping.set()
        self._free.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
