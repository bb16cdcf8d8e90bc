"""Many sequences decoded together: one verification forward per step for all of them.

A :class:`Batch` holds :class:`~speculant.core.sequence.Sequence` objects of one target model, each with its own
prompt length, cache, drafter (chain, tree, lookup ... or none), sampling settings, generator, stop tokens and
budget. Sequences join (:meth:`Batch.add`: the prompt is prefilled then, alone) and leave (finished, or
:meth:`Batch.cancel`) between steps. :meth:`Batch.step` drafts for every active sequence, runs *one* target
forward over all their ``[root] + tree`` rows (:func:`speculant.core.forward.batched_logits`: the matrix products,
LM head included, take every sequence's rows at once, so the weights are read once per step for the whole batch;
attention runs per sequence over its own cache) and verifies each sequence with the one verifier. Ragged
acceptance needs no padding: each sequence keeps only its accepted path in its own cache.

Exactness: with quantized weights (int8, int4, q4, q8) and row-by-row attention a row is the same bits in a batch as
alone, so a batch's greedy output equals each prompt decoded alone, token for token; with float weights torch's
dense products may round a batched row differently (not row independent), which can flip a near-tie.

The engine's entry points (:func:`speculant.core.engine.generate`, ``generate_steps``, ``generate_batch``) are
built on this class; a server keeps one Batch and feeds it requests.
"""

from __future__ import annotations

import time

import torch

from .drafting import Drafter, capability, sync
from .eviction import BudgetedKV
from .forward import TargetForward, batched_logits
from .sequence import Sequence
from .types import Generation, SamplingParams, StepEvent

__all__ = ["Batch"]


class Batch:
    """Sequences of ``target`` decoded together (see the module doc). ``forward``: ``"auto"``, ``"lean"`` or
    ``"model"`` (:class:`~speculant.core.forward.TargetForward`), for every sequence."""

    def __init__(self, target: torch.nn.Module, forward: str = "auto") -> None:
        self.target = target
        self.forward_mode = forward
        self._sequences: dict[int, Sequence] = {}  # active
        self._finished: dict[int, Sequence] = {}  # finished or cancelled, until released
        self._next = 0
        self.steps = 0  # batched steps run
        self.rows = 0  # verification rows of the last step (sum over sequences of 1 + draft tokens)

    def __len__(self) -> int:
        """Active (unfinished) sequences."""
        return len(self._sequences)

    @property
    def active(self) -> list[int]:
        """Indices of the active sequences, in the order they joined."""
        return list(self._sequences)

    def add(self, ids: list[int], drafter: Drafter | None = None, max_new_tokens: int = 128,
            params: SamplingParams | None = None, stops: set[int] | frozenset[int] = frozenset(),
            kv: BudgetedKV | None = None, logprobs: int | None = None) -> int:
        """Add a sequence (checked arguments: :func:`speculant.core.engine.generate_batch` checks them) and prefill
        its prompt; returns its index (``StepEvent.sequence``). A drafter object serves one sequence at a time (it
        keeps per-generation state)."""
        if drafter is not None and any(s.drafter is drafter for s in self._sequences.values()):
            raise ValueError("a drafter object serves one sequence at a time: give each sequence its own drafter")
        forward = TargetForward(self.target, self.forward_mode, max_length=len(ids) + max_new_tokens,
                                taps=capability(drafter, "target_taps"))
        index, self._next = self._next, self._next + 1
        seq = Sequence(index, self.target, forward, ids, drafter, max_new_tokens, params or SamplingParams(),
                       set(stops), kv, logprobs)
        with torch.inference_mode():
            seq.prefill()
        self._sequences[index] = seq
        return index

    def step(self) -> list[StepEvent]:
        """One decoding step for every active sequence: draft, one verification forward for all, verify, commit.
        Returns one event per sequence (finished ones leave the batch; :meth:`result` still has them)."""
        seqs = list(self._sequences.values())
        if not seqs:
            return []
        with torch.inference_mode():
            segments = [s.plan() for s in seqs]
            self.rows = sum(seg.input_ids.shape[1] if seg.input_ids is not None else seg.inputs_embeds.shape[1]
                            for seg in segments)
            start = time.perf_counter()
            logits = batched_logits([s.forward for s in seqs], segments, [s.hidden for s in seqs])
            sync(seqs[0].device)
            elapsed = time.perf_counter() - start
            events = [s.absorb(out[0], elapsed) for s, out in zip(seqs, logits)]
        self.steps += 1
        for seq in seqs:
            if seq.done:
                self._finished[seq.index] = self._sequences.pop(seq.index)
        return events

    def cancel(self, index: int) -> Generation:
        """Stop sequence ``index`` now (finish reason ``"cancelled"``, unless it had finished) and return its
        generation so far."""
        seq = self._sequences.pop(index, None) or self._finished.get(index)
        if seq is None:
            raise ValueError(f"no sequence {index} in this batch")
        seq.cancel()
        self._finished[index] = seq
        return seq.result()

    def result(self, index: int) -> Generation:
        """Sequence ``index``'s generation (complete once it finished); a finished sequence's result is kept until
        :meth:`release`."""
        seq = self._sequences.get(index) or self._finished.get(index)
        if seq is None:
            raise ValueError(f"no sequence {index} in this batch")
        return seq.result()

    def release(self, index: int) -> None:
        """Forget finished sequence ``index`` (its cache and result)."""
        self._finished.pop(index, None)
