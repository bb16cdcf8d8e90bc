"""The ``hybrid`` method's training-free drafter: prompt-lookup continuations and mask-probe candidates in ONE tree.

Prompt lookup (Saxena 2023) is strong when the answer copies from its context and silent otherwise; mask probing
(ESP, Goel et al. 2026) always proposes something but rarely more than one or two tokens deep. Both cost no draft
model, and both are verified in the target's forward, so one tree can hold both: the mask-probe tree (static or
dynamic, :class:`~.mask_probe.MaskProbeDrafter`) with the lookup continuation merged into it as a chain from the
root (sharing any prefix the mask tree already has). Every node, lookup ones included, carries the mask probes,
so the next step's mask candidates come from the deepest accepted node whichever branch it is on. The draft stays
deterministic (greedy / deterministic-draft verification): exact at any temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.checks import check_positive_int
from .base import DecodeState
from .lookup import lookup_continuation, merge_chain
from .mask_probe import MaskProbeDrafter

__all__ = ["LookupProbeDrafter"]


class LookupProbeDrafter(MaskProbeDrafter):
    """Mask-probe tree plus the prompt-lookup chain (``ngram``, ``k`` as in
    :class:`~.lookup.PromptLookupDrafter`); the other arguments are :class:`~.mask_probe.MaskProbeDrafter`'s."""

    def __init__(self, masks: int = 2, tree: Sequence[int] | None = None, budget: int | None = None,
                 init: str = "mean", ema: float = 0.1, seed: int = 0, ngram: int = 3, k: int = 5) -> None:
        super().__init__(masks=masks, tree=tree, budget=budget, init=init, ema=ema, seed=seed)
        self.ngram = check_positive_int("ngram", ngram)
        self.k = check_positive_int("k", k)

    def _nodes(self, state: DecodeState) -> tuple[list[int], list[int]]:
        tokens, parents = super()._nodes(state)
        chain = lookup_continuation(state.ids, self.ngram, min(self.k, state.draft_limit))
        return merge_chain(tokens, parents, chain)
