"""A draft-model drafter's tree with the prompt-lookup continuation merged in: two drafts, one target forward.

A small draft model and prompt lookup (Saxena 2023) fail in different places: the model proposes a plausible
next word or two everywhere, lookup proposes long exact copies where the answer repeats its context (code,
names, quoted phrases) and nothing elsewhere. Both drafts are verified in the same target forward as one tree:
the inner drafter's tree with the lookup chain added as a path from the root (sharing any prefix the tree already
has, :func:`~.lookup.merge_chain`). The inner drafter's nodes keep their indices, and it is told the accepted
tokens as usual (it walks its own tree by token and keeps what it fed), so any drafter works inside.

The merged draft is verified as a deterministic one (greedy, or the deterministic-draft rule when sampling: at each
node the target samples its token and descends if a child holds it), which is exact whatever proposed the tokens.
The greedy chain and the dynamic tree (``tree``) are deterministic already. A chain sampled at temperature > 0
carries its draft distribution q for speculative sampling; a lookup branch beside it has none, so the merged tree
drops q and its sampled tokens are verified as point masses too: still exact, but a sampled draft token is then
accepted with probability p(x) instead of min(1, p(x)/q(x)), so the chain's share of τ is lower than alone.
"""

from __future__ import annotations

from ..core.checks import check_positive_int
from .base import DecodeState, Drafter
from .lookup import lookup_continuation
from .merged_chain import MergedChain

__all__ = ["ModelWithLookup"]


class ModelWithLookup(MergedChain):
    """``inner``'s draft tree plus the prompt-lookup chain (``ngram``, ``k`` as in
    :class:`~.lookup.PromptLookupDrafter`), merged by :class:`~.merged_chain.MergedChain`. Lookup adds no model
    and reads no states: the capabilities are the inner drafter's."""

    option = "lookup"

    def __init__(self, inner: Drafter, ngram: int = 3, k: int = 8) -> None:
        super().__init__(inner, k)
        self.ngram = check_positive_int("ngram", ngram)

    def chain(self, state: DecodeState, k: int) -> list[int]:
        return lookup_continuation(state.ids, self.ngram, k)
