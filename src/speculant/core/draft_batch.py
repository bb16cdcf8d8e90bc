"""The draft forwards of a batch's sequences, run together: one forward per draft level for every sequence.

In a :class:`~speculant.core.batch.Batch` step every sequence drafts before the one verification forward. Each
drafter runs its own draft model forwards (a chain: the catch-up, then one per level), so with ``n`` sequences
drafting ``k`` levels a step costs ``n * k`` draft forwards, each reading every draft weight, although a
memory-bound forward over ``n`` rows costs about what one row costs (``benchmarks/batch_drafts.py`` measures it).

:func:`plan_together` plans the sequences as coroutines (greenlets) on the calling thread under a
:class:`ForwardBatcher`: a :class:`~speculant.core.llama_forward.LlamaForward` built with :func:`active` as its
``active_batcher`` (as :func:`~speculant.core.target_forward.llama_forward_for` builds them) does not run at once
when a planning sequence calls its :meth:`~speculant.core.llama_forward.LlamaForward.hidden`; the sequence is
suspended with its request, the next one plans, and when every sequence waits in a forward or is done, the forwards
of one model run as one :meth:`~speculant.core.llama_forward.LlamaForward.hidden_batch` (each sequence's own draft
cache, positions and tree mask) and every waiting sequence resumes with its rows. So the drafters stay as they are
(any of them, whatever its shape of tree or number of levels) and a step costs about ``k`` draft forwards whatever
``n``. Coroutines, not threads: torch ops issued from several OS threads each bring their own OpenMP team, which
makes every later forward of the process several times slower on a small CPU.

Exactness is untouched: the verifier does not care how a draft was computed. With quantized weights a row is the
same bits in a batched forward as alone (row independent), so the drafts are the same too; with float weights
torch's dense products may round a batched row differently, which can change a near-tied draft token (never the
output, only what is proposed), or a sampled draft's ``p`` (the verifier is handed the ``p`` it drew from).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from greenlet import GreenletExit, getcurrent, greenlet

if TYPE_CHECKING:  # types only: a forward is handed :func:`active` by whoever builds it
    from .llama_forward import LlamaForward, Segment

__all__ = ["ForwardBatcher", "active", "plan_together"]


def active() -> ForwardBatcher | None:
    """The batcher the running coroutine plans under (None: forwards run at once)."""
    return getattr(getcurrent(), "batcher", None)


class _Request:
    __slots__ = ("forward", "segment")

    def __init__(self, forward: LlamaForward, segment: Segment) -> None:
        self.forward, self.segment = forward, segment


class _Planner(greenlet):
    """One sequence's planning coroutine; ``batcher`` marks it as planning under one."""

    def __init__(self, run: Callable[[], object], batcher: ForwardBatcher) -> None:
        super().__init__(run)
        self.batcher = batcher


class ForwardBatcher:
    """Suspends the Llama forwards of planning coroutines and runs them together (see the module doc).

    :attr:`forwards` counts the batched forwards run and :attr:`segments` the requests they served (their ratio is
    how many sequences shared a draft forward on average)."""

    def __init__(self) -> None:
        self.forwards = 0
        self.segments = 0

    def hidden(self, forward: LlamaForward, segment: Segment) -> torch.Tensor:
        """``forward.hidden`` of ``segment`` (``[1, T, H]``): suspends the calling coroutine until the batched forward
        ran (an error of that forward is raised here)."""
        return getcurrent().parent.switch(_Request(forward, segment))

    def run(self, requests: list[tuple[_Planner, _Request]]) -> list[tuple[_Planner, torch.Tensor | None,
                                                                           BaseException | None]]:
        """Run ``requests`` grouped by model: ``(planner, rows, error)`` for each."""
        groups: dict[int, list[tuple[_Planner, _Request]]] = {}
        for planner, r in requests:
            groups.setdefault(id(r.forward), []).append((planner, r))
        out = []
        for group in groups.values():
            try:
                rows = group[0][1].forward.hidden_batch([r.segment for _, r in group])  # [1, T_s, H] each
                out += [(planner, h, None) for (planner, _), h in zip(group, rows)]
            except Exception as exc:  # noqa: BLE001: every request of the failed forward gets the error
                out += [(planner, None, exc) for planner, _ in group]
            self.forwards += 1
            self.segments += len(group)
        return out


def plan_together(plans: Sequence[Callable[[], object]]) -> tuple[list, ForwardBatcher]:
    """Run the callables ``plans`` (each sequence's :meth:`~speculant.core.sequence.Sequence.plan`) as coroutines
    under one :class:`ForwardBatcher`; their results in order, and the batcher (its counts). The first exception
    raised by a plan is raised after every plan has ended."""
    batcher = ForwardBatcher()
    results: list = [None] * len(plans)
    error: BaseException | None = None
    waiting: list[tuple[_Planner, _Request]] = []

    def resume(planner: _Planner, i: int, value=None, exc: BaseException | None = None) -> None:
        nonlocal error
        try:
            if exc is not None:
                out = planner.throw(exc)
            else:
                out = planner.switch(value) if planner else planner.switch()  # a greenlet not started is falsy
        except Exception as e:  # noqa: BLE001: the plan failed; the others finish first
            error = error or e
            return
        if planner.dead:
            results[i] = out
        else:
            waiting.append((planner, out))  # suspended in a forward: out is its request

    planners = [_Planner(p, batcher) for p in plans]
    index = {id(p): i for i, p in enumerate(planners)}
    # the coroutines share the thread's autograd modes, and their no_grad blocks interleave (one suspended inside
    # its block while another enters and leaves one), so a block may restore another's mode: inference mode around
    # them all, whose exit here restores the caller's modes whatever they did
    with torch.inference_mode():
        try:
            for i, planner in enumerate(planners):
                resume(planner, i)
            while waiting:
                batch, waiting[:] = list(waiting), []
                for planner, rows, exc in batcher.run(batch):
                    resume(planner, index[id(planner)], rows, exc)
        finally:  # an interrupt (KeyboardInterrupt, SystemExit): end the suspended plans here, inside the mode
            for planner in planners:
                if planner and not planner.dead:
                    planner.throw(GreenletExit)
    if error is not None:
        raise error
    return results, batcher
