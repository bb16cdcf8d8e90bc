"""The base of drafters that wrap another drafter: its capabilities are the inner drafter's.

A wrapper (prompt lookup merged into a tree, the observed drafter of online adaptation, the text-only view of a
vision-language prompt) changes what one protocol step does and nothing the engine reads: the inner drafter's
declared capabilities (its model, whether it reads the target's states and which) are taken once, through
:func:`~.base.capability`, and stored as this drafter's own attributes (so :func:`speculant.bench.cost.drafter_models`
finds the model among them); the three protocol methods pass through unless a subclass overrides them.
"""

from __future__ import annotations

from ..core.types import DraftTree
from .base import DecodeState, Drafter, capability

__all__ = ["DrafterWrapper"]


class DrafterWrapper(Drafter):
    """A drafter around ``inner``, with its capabilities; ``begin``/``propose``/``commit`` pass through."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.model = capability(inner, "model")
        self.uses_target_hidden = capability(inner, "uses_target_hidden")
        self.target_taps = capability(inner, "target_taps")

    def params_per_forward(self) -> int | None:
        """What one draft forward of the inner drafter reads, for MBSU; None where it declares none (the bench
        then counts the model this drafter holds)."""
        return capability(self.inner, "params_per_forward")

    def begin(self, state: DecodeState) -> None:
        self.inner.begin(state)

    def propose(self, state: DecodeState) -> DraftTree:
        return self.inner.propose(state)

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        self.inner.commit(state, accepted)
