"""Graceful shutdown: on SIGTERM or Ctrl-C, drain the queue within ``--shutdown-grace`` seconds, then exit.

uvicorn's own shutdown closes the listening socket at once and cuts every open stream after a fixed timeout, with
no final event. Here the first signal starts a :class:`Drain` instead, while the server keeps listening:

1. new generation requests are answered 503 with ``Retry-After`` (and ``/health`` 503 ``shutting_down``, so a
   load balancer stops sending): a client hears why, rather than finding the port closed;
2. the running and queued requests go on until all are done or the grace period is over;
3. what is left is aborted (:meth:`speculant.serve.worker.Worker.abort`): a stream still running ends with a
   last chunk whose ``finish_reason`` is ``abort`` (vLLM's name for it) and ``data: [DONE]``, a non-streaming
   request gets a 503 error body; the worker stops at its next step;
4. then uvicorn shuts down as usual (stops listening, lets the last responses go out).

A second signal during the drain aborts at once (step 3); a third is uvicorn's own (Ctrl-C: force quit).
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from .worker import Worker

__all__ = ["ABORT_WAIT_S", "Drain", "DrainingServer"]

log = logging.getLogger(__name__)

_POLL_S = 0.05
ABORT_WAIT_S = 30.0
"""After the abort, how long the drain waits for the running job to reach its next step (a step is short, but
the prefill of a long prompt on a CPU is not: the engine checks only between steps) before exiting anyway."""


class Drain:
    """The graceful end of one app's ``worker``: :meth:`run` stops admitting, waits up to ``grace`` seconds for
    the worker to be idle, then aborts what is left. ``draining`` is true from the start of :meth:`run` on (the
    routes answer 503)."""

    def __init__(self, worker: Worker, grace: float) -> None:
        self.worker = worker
        self.grace = grace
        self.draining = False
        self._forced = False

    def force(self) -> None:
        """Abort now rather than at the end of the grace period."""
        self._forced = True

    async def _until_idle(self, deadline: float, forcible: bool) -> bool:
        while not self.worker.idle():
            if time.monotonic() >= deadline or (forcible and self._forced):
                return False
            await asyncio.sleep(_POLL_S)
        return True

    async def run(self) -> None:
        """Drain (steps 1-3 of the module docstring); returns once the worker is idle or given up on."""
        self.draining = True
        self.worker.stop_admitting()
        if not self.worker.idle():
            log.warning("shutting down: letting the running and queued requests finish (up to %g s; a second "
                        "signal ends them now)", self.grace)
        if await self._until_idle(time.monotonic() + self.grace, forcible=True):
            return
        log.warning("shutting down: ending the requests still running or queued (finish_reason 'abort')")
        self.worker.abort()
        if not await self._until_idle(time.monotonic() + ABORT_WAIT_S, forcible=False):
            log.warning("shutting down: the running request did not reach its next step in %g s", ABORT_WAIT_S)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT runs ``drain`` (:class:`Drain`) before the usual shutdown; the
    second forces the drain's abort; later ones are uvicorn's. The exit code is 0 after a drain."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None
        self._signals = 0

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        self._signals += 1
        if self._loop is None or self.should_exit or self._signals > 2:
            super().handle_exit(sig, frame)
        elif self._signals == 1:
            # a signal handler interrupts the loop's own code: hand the work to the loop, thread-safely
            self._loop.call_soon_threadsafe(self._begin)
        else:
            self.drain.force()

    def _begin(self) -> None:
        self._draining = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        except Exception:  # noqa: BLE001: the server still has to exit
            log.exception("draining failed")
        finally:
            self.should_exit = True
