"""ConFu drafting (Qin, Goel, Gagrani et al. 2026, "ConFu: Contemplate the Future for Better Speculative Sampling").

An EAGLE-3 feature drafter (:mod:`.feature`) that also reads a *future vector* ``f`` from the target: the final
state of a contemplate token ``[con]`` that rides in the verification forward after a verified row, reading the
context and ConFu's soft prompt (:mod:`speculant.models.confu_contemplation`). Each drafter row adds ``future_fc(f)`` to
its input.

Which ``f`` a row reads (the rule training follows, :mod:`speculant.train.drafter.confu_training`): the row of
position ``t`` reads the future vector of the latest anchor at or before ``t``; draft rows read the latest one.
Where ``[con]`` rides is a cost choice (``contemplate``):

* ``"root"`` (the default on a CPU): one ``[con]`` per forward, after the root. Every row the next proposal feeds
  (the root, the accepted tokens, the draft) then reads that one ``f``. One extra row per verification.
* ``"all"``: a ``[con]`` after the root and after every tree node, as the paper does; the next proposal's rows
  then read the ``f`` of their own position (the root's and the accepted nodes'), draft rows the last accepted
  node's. ``len(tree) + 1`` extra rows per verification.

The target's output is untouched: tree rows never see ``[con]`` or the soft prompt (a masked extra row, dropped
from the cache with the rejected ones), so the one verifier decides exactly as without contemplation. The prompt's
rows are fed before any contemplation and read none (zeros), as in training, where the first anchor is the prompt's
last token (the first root) and the rows before it read zeros. With ``mixture`` > 1 every contemplate token of a
step is routed by the state before the root (the last one known before the forward); training routes each anchor
by the state before it, which is the same thing for ``"root"`` and an approximation for ``"all"``.

ConFu's three parts are named ``confu*`` in the layer each belongs to, as EAGLE-3's are (its drafter
:mod:`.feature`, its training :mod:`speculant.train.drafter.feature_train`):

* :mod:`speculant.models.confu_contemplation`: the learned parameters a ConFu drafter model holds (soft prompt,
  contemplate embeddings and router, future input map). The attached-drafter format saves and loads them with the
  drafter's weights, and the registry tells a ConFu drafter from an EAGLE-3 one by them, so they sit with models.
* this module: the drafter, which the method registry builds like EAGLE-3's feature drafters.
* :mod:`speculant.train.drafter.confu_training`: the objective of ``speculant train draft --kind confu``, built on
  EAGLE-3's (:mod:`speculant.train.drafter.feature_train`).

One package for all three would make ``models`` and ``drafters`` import a package above them.
"""

from __future__ import annotations

import functools

import torch

from ..core.types import DraftTree, Probes
from ..models.confu_contemplation import contemplation_of, kv_shape
from .base import DecodeState
from .feature import FeatureDrafter, FeatureInputs, FeatureTreeDrafter, feature_variant, mixin_variant

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
        # [1 + a, H] per verified step since the last proposal: the future vector of each row its catch-up feeds
        self._queued: list[torch.Tensor] = []
        self._row_futures: torch.Tensor | None = None  # [n, H] the catch-up rows' own, while they are fed
        self._h_last: torch.Tensor | None = None  # [H] the target's last known final state (routes [con])

    def begin(self, state: DecodeState) -> None:
        want = kv_shape(state.target.config)
        got = tuple(self.contemplation.soft_keys.shape[i] for i in (0, 1, 3))
        if got != want:
            raise ValueError(f"the ConFu drafter's soft prompt is for a target with (layers, KV heads, head dim) "
                             f"{got}; this target has {want}")
        super().begin(state)
        self._future = self._row_futures = self._h_last = None
        self._queued = []

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        h = self.model.config.hidden_size
        if state.target_hidden:
            self._h_last = state.target_hidden[-1][-1, -h:]  # the state of the token before the root
        n = sum(block.shape[0] for block in state.target_hidden)
        self._row_futures = self._futures_of(n)
        try:
            return super()._catch_up(state)
        finally:
            self._row_futures = None
            self._queued = []

    def _futures_of(self, n: int) -> torch.Tensor | None:
        """The future vectors ``[n, H]`` of the ``n`` rows this catch-up feeds: zeros for the prompt's (fed before
        any contemplation), then each verified step's (:meth:`commit`); None when there is none at all."""
        if not self._queued:
            return None
        rows = torch.cat(self._queued)  # [q, H]
        if rows.shape[0] < n:  # the prompt's rows come first
            rows = torch.cat([rows.new_zeros((n - rows.shape[0], rows.shape[1])), rows])
        return rows[-n:]

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        """Take this step's contemplation (``state.probe_hidden``): the future vector of each row the step added
        to the target's cache (the root and the accepted nodes), queued for the next catch-up; a step that
        drafted nothing (adaptive speculation) contemplated nothing, and its row keeps the latest vector."""
        probe, state.probe_hidden = state.probe_hidden, None
        rows = 1 + len(state.last_accepted)
        if probe is not None:
            f = probe[:, -self.model.config.hidden_size:]  # [P, H] the [con] rows' final states
            if self.contemplate == "root":
                block = f[0].expand(rows, -1)
            else:  # anchors in slot order: the root, then every tree node
                block = f[[0] + [1 + a for a in state.last_accepted]]  # [1 + a, H]
            self._future = block[-1]
        elif self._future is not None:
            block = self._future.expand(rows, -1)
        else:
            block = None
        if block is not None:
            self._queued.append(block)
        super().commit(state, accepted)

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


class ConFuDrafter(ContemplateInputs, FeatureDrafter):
    """A chain of ``k`` tokens from a ConFu drafter (:class:`~speculant.drafters.feature.FeatureDrafter` plus
    contemplation). Args as that class, and ``contemplate``."""


class ConFuTreeDrafter(ContemplateInputs, FeatureTreeDrafter):
    """EAGLE-2's dynamic tree from a ConFu drafter (how the paper drafts). Args as
    :class:`~speculant.drafters.feature.FeatureTreeDrafter`, and ``contemplate``."""


@functools.cache
def confu_variant(cls: type) -> type:
    """The ConFu class of the draft-model drafter class ``cls`` (:class:`ContemplateInputs` over its feature
    variant; one class per ``cls``)."""
    return mixin_variant(ContemplateInputs, feature_variant(cls),
                         {FeatureDrafter: ConFuDrafter, FeatureTreeDrafter: ConFuTreeDrafter}, "ConFu",
                         "ConFu's contemplation")
