"""The drafter interface and the base of drafters that wrap another drafter.

:class:`Drafter` (the protocol ``begin``/``propose``/``commit`` and the declared capabilities
``uses_target_hidden``, ``target_taps``, ``model``, ``params_per_forward``, ``drafts_constrained``), :class:`DecodeState` and
:func:`capability` are defined in :mod:`speculant.core.drafting`, because the engine (``core``) drives drafters and
must not import from this package; drafters import them from here. Subclass :class:`Drafter` and override the
capabilities your drafter has; a class with only the three protocol methods works too (the defaults apply).

:class:`DrafterWrapper` is the base of a drafter around another one (prompt lookup merged into a tree, the observed
drafter of online adaptation, the text-only view of a vision-language prompt): it changes what one protocol step
does and nothing the engine reads. The inner drafter's declared capabilities (its model, whether it reads the
target's states and which, whether it drafts under an output constraint) are taken once, through :func:`capability`, and stored as the wrapper's own attributes
(so :func:`speculant.bench.cost.drafter_models` finds the model among them); the three protocol methods pass through
unless a subclass overrides them.
"""

from __future__ import annotations

from ..core.drafting import CAPABILITIES, DecodeState, Drafter, capability
from ..core.types import DraftTree

__all__ = ["CAPABILITIES", "DecodeState", "Drafter", "DrafterWrapper", "capability"]


class DrafterWrapper(Drafter):
    """A drafter around ``inner``, with its capabilities; ``begin``/``propose``/``commit`` pass through."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.model = capability(inner, "model")
        self.uses_target_hidden = capability(inner, "uses_target_hidden")
        self.target_taps = capability(inner, "target_taps")
        self.drafts_constrained = capability(inner, "drafts_constrained")

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

    def prefill(self, state: DecodeState, stop: int) -> None:
        hook = getattr(self.inner, "prefill", None)
        if hook is not None:
            hook(state, stop)
