"""A drafter's tree with one more deterministic chain (or a few paths) merged in, verified in the same target forward.

The base of :class:`~.model_lookup.ModelWithLookup` (the prompt-lookup continuation) and
:class:`speculant.online.traffic.WithTraffic` (earlier requests' continuation, or their tree): the inner drafter's
tree with the chain (each of the paths) added as a path from the root, sharing any prefix the tree already has
(:func:`~.lookup.merge_chain`). The inner drafter's nodes keep their indices and it is told the accepted tokens as
usual, so any drafter works inside. The merged tree has no draft distribution (``draft_probs`` None) and is
verified as a deterministic draft (greedy, or the deterministic-draft rule when sampling), which is exact whatever
proposed the tokens; a sampled chain's tokens then count as point masses (see :mod:`.model_lookup` for what that costs).
"""

from __future__ import annotations

from ..core.checks import check_positive_int
from ..core.types import DraftTree
from .base import DecodeState, Drafter, DrafterWrapper
from .lookup import merge_chain

__all__ = ["MergedChain"]


class MergedChain(DrafterWrapper):
    """``inner``'s draft tree with one more deterministic chain from the root merged in, of at most ``k`` tokens
    (what :meth:`chain` returns for the step, or each path :meth:`chains` returns; subclasses say where it comes from,
    and name their method option in :attr:`option`). The merged tree is verified as a deterministic draft (see the
    module doc); an empty chain leaves the tree as it was."""

    option = "chain"
    optional = False
    """True: a tree whose nodes carry probes (which a chain cannot join) is proposed as it is; False: a ValueError."""

    def __init__(self, inner: Drafter, k: int = 8) -> None:
        super().__init__(inner)
        self.k = check_positive_int("k", k)

    def chain(self, state: DecodeState, k: int) -> list[int]:
        """The chain to merge this step, at most ``k`` tokens (``k`` and the step's ``draft_limit``, the smaller)."""
        raise NotImplementedError

    def chains(self, state: DecodeState, k: int) -> list[list[int]]:
        """The paths from the root to merge this step, each at most ``k`` tokens: :meth:`chain`'s one chain (a
        subclass proposing a tree of its own returns its root-to-leaf paths)."""
        return [self.chain(state, k)]

    def propose(self, state: DecodeState) -> DraftTree:
        tree = self.inner.propose(state)
        if tree.probes is not None and tree.probes.anchors != [0]:
            if self.optional:
                return tree
            raise ValueError(f"{self.option}= cannot merge into a draft whose nodes carry probes (mask probes: use "
                             "the hybrid method; ConFu: contemplate=root)")
        chains = [c for c in self.chains(state, min(self.k, state.draft_limit)) if c]
        if not chains:
            return tree  # unchanged: a sampled chain keeps its q and speculative sampling
        tokens, parents = tree.tokens, tree.parents
        for chain in chains:
            tokens, parents = merge_chain(tokens, parents, chain)
        # no draft_probs: verified as a deterministic draft; probes after the root only (ConFu's) stay valid
        return DraftTree(tokens=tokens, parents=parents, probes=tree.probes)
