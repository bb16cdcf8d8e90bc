"""The drafter protocol and the per-generation state the engine shares with a drafter.

A drafter proposes a :class:`~speculant.core.types.DraftTree` each step and is told what was committed; it never
verifies. The engine knows no drafter by name: everything method-specific lives behind this protocol.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..core.types import DraftTree, GenerationStats, SamplingParams

__all__ = ["DecodeState", "Drafter"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeState:
    """What a drafter may read during one generation.

    ``ids`` are all committed token ids (prompt + new); the last one is the root of the next tree (not yet in
    the target's cache). ``remaining`` is how many tokens may still be committed, so a drafter can shorten its
    draft (at most ``remaining - 1`` draft tokens are useful: the step also emits a bonus token).
    """

    target: torch.nn.Module
    ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    max_length: int  # prompt + max_new_tokens: no position at or past it is ever needed
    remaining: int
    stats: GenerationStats = field(default_factory=GenerationStats)
    # the last verification forward: its logits [Q (+ P probe slots), V] and the accepted node indices
    last_logits: torch.Tensor | None = None
    last_accepted: list[int] = field(default_factory=list)
    # for a drafter with ``uses_target_hidden = True`` only: the target's states ([N, F] blocks, in order) of the
    # tokens that entered its cache since the drafter last took them (it clears the list): the outputs of the
    # layers the drafter's ``target_taps`` names, then the final-normed hidden state (F = (taps + 1) H)
    target_hidden: list[torch.Tensor] = field(default_factory=list)

    @contextmanager
    def draft_forward(self, device: torch.device) -> Iterator[None]:
        """Wrap one draft-model forward: counts it and adds its time to ``stats.draft_forward_s``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(device)
            self.stats.draft_forward_s += time.perf_counter() - start
            self.stats.draft_calls += 1


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft trees for the one verifier (``speculant.core.verification``)."""

    def begin(self, state: DecodeState) -> None:
        """Start a generation: validate against ``state.target`` and reset per-generation state (caches)."""

    def propose(self, state: DecodeState) -> DraftTree:
        """Draft the tree for the next step, rooted at ``state.ids[-1]``."""

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        """Called after verification with the accepted draft tokens (bonus excluded); ``state.ids`` already
        holds them and the bonus."""
