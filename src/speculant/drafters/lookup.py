"""Prompt-lookup drafting (Saxena 2023, "Prompt Lookup Decoding"): no draft model, no extra forward.

The last ``n`` committed tokens (n = ``ngram`` down to 1) are searched for earlier in prompt + generated text;
the ``k`` tokens that followed the most recent earlier occurrence are proposed as a chain. The draft is a point
mass (``draft_probs=None``), verified by the greedy rule or, when sampling, by the deterministic-draft rule, so
decoding stays lossless. Strong when the answer copies from the prompt (code edits, quoting), useless otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.checks import check_positive_int
from ..core.types import DraftTree
from .base import DecodeState, Drafter

__all__ = ["PromptLookupDrafter", "lookup_continuation", "merge_chain"]


def lookup_continuation(ids: list[int], ngram: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of ``ids`` of
    length ``ngram`` .. 1 (``[]`` when no suffix occurs earlier)."""
    n_ids = len(ids)
    for n in range(min(ngram, n_ids - 1), 0, -1):
        suffix = ids[n_ids - n :]
        first = suffix[0]
        # scan backwards from the latest possible start (the suffix itself excluded)
        for start in range(n_ids - n - 1, -1, -1):
            if ids[start] == first and ids[start : start + n] == suffix:
                follow = ids[start + n : start + n + k]
                if follow:
                    return follow
    return []


def merge_chain(tokens: list[int], parents: list[int], chain: Sequence[int]) -> tuple[list[int], list[int]]:
    """The tree ``(tokens, parents)`` with ``chain`` added as a path from the root: existing nodes with the same
    token at the same place are reused, the rest is appended (topological order and distinct siblings hold)."""
    tokens, parents = list(tokens), list(parents)
    node = -1
    for tok in chain:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == tok), None)
        if child is None:
            tokens.append(tok)
            parents.append(node)
            child = len(tokens) - 1
        node = child
    return tokens, parents


class PromptLookupDrafter(Drafter):
    """Drafts up to ``k`` tokens copied from earlier text after a matching n-gram (at most ``ngram`` long)."""

    def __init__(self, ngram: int = 3, k: int = 8) -> None:
        self.ngram = check_positive_int("ngram", ngram)
        self.k = check_positive_int("k", k)

    def begin(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        k = min(self.k, state.draft_limit)
        return DraftTree.chain(lookup_continuation(state.ids, self.ngram, k))  # deterministic: draft_probs None

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        pass

    def params_per_forward(self) -> int:
        """No draft model: drafting reads no parameters (for MBSU)."""
        return 0
