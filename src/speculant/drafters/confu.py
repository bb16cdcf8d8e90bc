"""ConFu drafting (Qin, Goel, Gagrani et al. 2026, "ConFu: Contemplate the Future for Better Speculative Sampling").

An EAGLE-3 feature drafter (:mod:`.feature`) that also reads a *future vector* ``f`` from the target: the final
state of a contemplate token ``[con]`` that rides in the verification forward after a verified row, reading the
context and ConFu's soft prompt (:mod:`speculant.models.contemplate`). Each drafter row adds ``future_fc(f)`` to
its input.

Which ``f`` a row reads (the rule training follows, :mod:`speculant.train.drafter.confu_train`): the row of
position ``t`` reads the future vector of the latest anchor at or before ``t``; draft rows read the latest one.
Where ``[con]`` rides is a cost choice (``contemplate``):

* ``"root"`` (the default on a CPU): one ``[con]`` per forward, after the root. Every row the next proposal feeds
  (the root, the accepted tokens, the draft) then reads that one ``f``. One extra row per verification.
* ``"all"``: a ``[con]`` after the root and after every tree node, as the paper does; the next proposal's rows
  then read the ``f`` of their own position (the root's and the accepted nodes'), draft rows the last accepted
  node's. ``len(tree) + 1`` extra rows per verification.

The target's output is untouched: tree rows never see ``[con]`` or the soft prompt (a masked extra row, dropped
from the cache with the rejected ones), so the one verifier decides exactly as without contemplation. Before the
first verification (the prompt's rows) there is no ``f`` and rows read none (zeros), as training's rows before
their first anchor do.
"""

from __future__ import annotations

import functools

import torch

from ..core.checks import num_layers
from ..core.types import DraftTree, Probes
from ..models.contemplate import contemplation_of
from .base import DecodeState
from .feature import FeatureInputs, feature_variant
from .model import DraftModelBase, DraftModelDrafter
from .trees import DynamicTreeDrafter

__all__ = ["CONTEMPLATE", "ConFuDrafter", "ConFuTreeDrafter", "ContemplateInputs", "confu_variant"]

CONTEMPLATE = ("root", "all")
"""Where contemplate tokens ride in the verification forward (module docstring)."""


class ContemplateInputs(FeatureInputs):
    """Mixin over a feature drafter class: ConFu's contemplate tokens in each verification forward and the future
    input of every drafter row (module docstring). ``contemplate``: ``"root"`` or ``"all"``."""

    def __init__(self, draft_model: torch.nn.Module, *args, contemplate: str = "root", **kwargs) -> None:
        super().__init__(draft_model, *args, **kwargs)
        self.contemplation = contemplation_of(draft_model)
        if self.contemplation is None:
            raise ValueError(f"{type(draft_model).__name__} is not a ConFu drafter (it has no contemplation): train "
                             "one with speculant train draft --kind confu, or use eagle3 for an EAGLE-3 drafter")
        if contemplate not in CONTEMPLATE:
            raise ValueError(f"contemplate must be one of {', '.join(CONTEMPLATE)}, got {contemplate!r}")
        self.contemplate = contemplate
        self._future: torch.Tensor | None = None  # [H] the latest future vector (None before the first one)
        self._row_futures: torch.Tensor | None = None  # [n, H] the catch-up rows' own, while they are fed
        self._h_last: torch.Tensor | None = None  # [H] the target's last known final state (routes [con])

    def begin(self, state: DecodeState) -> None:
        layers = num_layers(state.target)
        if self.contemplation.soft_keys.shape[0] != layers:
            raise ValueError(f"the ConFu drafter's soft prompt has {self.contemplation.soft_keys.shape[0]} layers; "
                             f"the target has {layers}")
        super().begin(state)
        self._future = self._row_futures = self._h_last = None

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        h = self.model.config.hidden_size
        if state.target_hidden:
            self._h_last = state.target_hidden[-1][-1, -h:]  # the state of the token before the root
        n = sum(block.shape[0] for block in state.target_hidden)
        self._row_futures = self._take_futures(state, n)
        try:
            return super()._catch_up(state)
        finally:
            self._row_futures = None

    def _take_futures(self, state: DecodeState, n: int) -> torch.Tensor | None:
        """The future vectors ``[n, H]`` of the ``n`` rows this catch-up feeds, from the last verification's
        contemplate tokens (``state.probe_hidden``, consumed here); None when there is none yet."""
        probe, state.probe_hidden = state.probe_hidden, None
        if probe is not None:
            f = probe[:, -self.model.config.hidden_size:]  # [P, H] the [con] rows' final states
            if self.contemplate == "root":
                self._future = f[0]
            else:  # anchors in slot order: the root, then every tree node
                rows = f[[0] + [1 + a for a in state.last_accepted]]  # [1 + a, H]: the rows this catch-up feeds
                self._future = rows[-1]
                if rows.shape[0] == n:
                    return rows
        return None if self._future is None else self._future.expand(n, -1)

    def _extra_input(self, rows: int) -> torch.Tensor | None:
        if self._row_futures is not None and self._row_futures.shape[0] == rows:
            f = self._row_futures
        elif self._future is not None:
            f = self._future.expand(rows, -1)
        else:
            return None
        return self.contemplation.future_input(f)  # [rows, H]

    def propose(self, state: DecodeState) -> DraftTree:
        tree = super().propose(state)
        if tree.probes is not None:
            raise ValueError(f"{type(self).__name__}'s tree already carries probes")
        c = self.contemplation
        anchors = 1 if self.contemplate == "root" else len(tree) + 1
        with torch.no_grad():
            embeds = c.token_embeds(None if self._h_last is None else self._h_last[None])  # [1, H]
        tree.probes = Probes(anchors=list(range(anchors)), length=1, embeds=embeds.expand(anchors, -1),
                             soft_keys=c.soft_keys.detach(), soft_values=c.soft_values.detach(), logits=False)
        return tree


@functools.cache
def confu_variant(cls: type) -> type:
    """The ConFu class of the draft-model drafter class ``cls`` (:class:`ContemplateInputs` over its feature
    variant; one class per ``cls``)."""
    if not issubclass(cls, DraftModelBase):
        raise ValueError(f"{cls.__name__} does not draft with a draft model")
    known = {DraftModelDrafter: ConFuDrafter, DynamicTreeDrafter: ConFuTreeDrafter}
    if cls in known:
        return known[cls]
    return type(f"ConFu{cls.__name__}", (ContemplateInputs, feature_variant(cls)),
                {"__doc__": f"{cls.__name__} with ConFu's contemplation.", "__module__": __name__})


class ConFuDrafter(ContemplateInputs, feature_variant(DraftModelDrafter)):
    """A chain of ``k`` tokens from a ConFu drafter (:class:`~speculant.drafters.feature.FeatureDrafter` plus
    contemplation). Args as that class, and ``contemplate``."""


class ConFuTreeDrafter(ContemplateInputs, feature_variant(DynamicTreeDrafter)):
    """EAGLE-2's dynamic tree from a ConFu drafter (how the paper drafts). Args as
    :class:`~speculant.drafters.feature.FeatureTreeDrafter`, and ``contemplate``."""
