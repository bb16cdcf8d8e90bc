"""What the engine needs of an output constraint (JSON mode, a JSON Schema, a regex, a grammar): allowed-token masks
for a draft tree, the tokens it forces, and whether it is complete. The implementation lives above ``core``
(:mod:`speculant.structured`, on llguidance); the engine knows only this protocol.

How a constrained step stays exact (the :class:`Sequence` does it, with the one verifier unchanged):

* the target's distribution at every row is the *constrained* one: its logits are masked (forbidden tokens to
  ``-inf``) before :func:`~speculant.core.sampling.warp` applies temperature, top-k and top-p; that is what plain
  constrained decoding samples from, and it is what the verifier is handed;
* a draft node whose token the constraint forbids (after its parent's path) is *not* fed to the target (nor are its
  descendants): its path can never be committed. It stays in the tree the verifier sees, with a dummy logits row
  that is never read: under the mask ``q(x) = 0`` at its parent, so greedy never follows it (the argmax of a masked
  row is allowed), the deterministic-draft rule never draws it, and rejection sampling rejects it with probability
  one, *updating the residual exactly as the algorithm prescribes for a drafted token* (the next sibling's test
  and the correction are drawn from ``norm((q - p)+)``). Deleting such a node instead would change the sibling
  rules' residual updates (the draws of a SpecInfer node are i.i.d. from ``p``, a drafted forbidden draw among
  them included) and bias the output;
* tokens the constraint forces (:meth:`Constraint.forced`) are proposed as a deterministic chain, verified as any
  draft (each forced row's mask allows one token, so they are accepted).
"""

from __future__ import annotations

import abc

import torch

from .types import DraftTree

__all__ = ["Constraint"]


class Constraint(abc.ABC):
    """One generation's output constraint, advanced token by token (:meth:`commit`) as the sequence commits.

    A mask is a bool tensor over the model's logits width ``V`` (which may exceed the tokenizer's vocabulary: the
    padding ids are always forbidden); True = allowed. A *stop token* (one of the ids :meth:`begin` names) is
    allowed exactly where the constraint is complete (accepting); where nothing but a stop can follow, only the
    stops are. ``mask_s`` and ``masks`` count the seconds spent and the masks computed, the engine's statistics.
    """

    mask_s: float = 0.0
    masks: int = 0

    @abc.abstractmethod
    def begin(self, vocab: int, stops: set[int]) -> None:
        """Start a generation over logits of width ``vocab`` that ends at any of ``stops``."""

    @abc.abstractmethod
    def tree_masks(self, tree: DraftTree) -> tuple[torch.Tensor, list[bool]]:
        """``(masks [N + 1, V] bool, allowed [N])`` for ``tree`` rooted at the committed state: row 0 is the mask
        after the committed tokens, row ``n + 1`` the mask after the path to node ``n`` (the verifier's logits
        rows); ``allowed[n]``: node ``n``'s token is allowed after its parent's path, and its parent is allowed. The
        row of a node that is not allowed is a dummy (all True: never read); the row of a node after which nothing
        is committed (a stop token, a complete format) allows none of its children's tokens (what the verifier
        emits there is cut) and has at least one True, so no row the verifier reads is empty."""

    @abc.abstractmethod
    def mask_after(self, path: list[int]) -> torch.Tensor | None:
        """The mask ``[V]`` after the committed tokens and ``path``; None when ``path`` is not allowed, ends at a
        stop token, or leaves nothing to allow (a drafter drafting under the constraint stops there)."""

    @abc.abstractmethod
    def commit(self, tokens: list[int]) -> int:
        """Advance over committed ``tokens`` (each allowed); a stop token ends it. Returns how many were taken:
        fewer than ``len(tokens)`` when the constraint completed (:attr:`finished`) before the rest."""

    @abc.abstractmethod
    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the constraint forces next (the only continuation it allows), possibly none."""

    @property
    @abc.abstractmethod
    def finished(self) -> bool:
        """Nothing but a stop token may follow: the generation ends here."""
