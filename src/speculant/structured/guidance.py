"""The llguidance-backed :class:`~speculant.core.constraint.Constraint`: one ``LLMatcher`` per generation, advanced
over the committed tokens and walked over each step's draft tree (consume, mask, roll back).

A mask comes from llguidance as a bitmask over the tokenizer's vocabulary (one bit per token, 32 per int32 word),
written in place into a reused buffer and unpacked with ``numpy.unpackbits`` (tens of microseconds for 150k tokens;
``llguidance.torch.apply_token_bitmask_inplace`` costs milliseconds on a CPU). It is then laid over the model's
logits width: ids past the tokenizer's vocabulary (padding rows) are forbidden, llguidance's own end-of-sequence
bit is replaced by the generation's stop tokens, allowed exactly where the grammar is accepting.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import torch

from ..core.constraint import Constraint
from ..core.types import DraftTree

__all__ = ["GuidanceConstraint"]

log = logging.getLogger(__name__)


class GuidanceConstraint(Constraint):
    """A :class:`Constraint` on a fresh ``llguidance.LLMatcher`` (``matcher``) over ``ll_tokenizer``'s vocabulary.
    :meth:`~speculant.structured.formats.CompiledFormat.constraint` builds it."""

    def __init__(self, matcher, ll_tokenizer) -> None:
        self._matcher = matcher
        self._n = int(ll_tokenizer.vocab_size)  # the tokenizer's vocabulary: the bits of a llguidance mask
        self._eos = [int(t) for t in ll_tokenizer.eos_tokens]
        self._bits = np.zeros((self._n + 31) // 32, dtype=np.int32)  # [words] the reused llguidance bitmask
        self._vocab = self._n
        self._stops: list[int] = []
        self._spec: list[int] = []  # tokens consumed past the committed state (a tree walk), rolled back after
        self._root: np.ndarray | None = None  # [V] the mask after the committed tokens, until the next commit
        self._after: dict[tuple[int, ...], np.ndarray] = {}  # path -> its mask [V], until the next commit
        self._ended = False  # a stop token was committed, or the matcher failed
        self.mask_s = 0.0
        self.masks = 0

    def begin(self, vocab: int, stops: set[int]) -> None:
        self._vocab = int(vocab)
        self._stops = sorted(t for t in stops if 0 <= t < self._vocab)
        self._root = None
        self._after.clear()

    # ------------------------------------------------------------------------------------------------ masks

    def _mask(self) -> np.ndarray:
        """The mask ``[V]`` (bool) at the matcher's current state."""
        start = time.perf_counter()
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._n).view(bool)  # [n]
        out = np.zeros(self._vocab, dtype=bool)  # [V]: padding ids past the tokenizer stay forbidden
        width = min(self._n, self._vocab)
        out[:width] = bits[:width]
        for e in self._eos:  # llguidance's end of sequence: replaced by the generation's own stop tokens
            if e < self._vocab:
                out[e] = False
        if m.is_accepting() and not m.is_error():
            out[self._stops] = True
        self.mask_s += time.perf_counter() - start
        self.masks += 1
        return out

    def _goto(self, path: list[int]) -> bool:
        """Put the matcher at the committed state plus ``path`` (rolling back what differs); False if a token of
        ``path`` is not allowed (the matcher then stays at the allowed part)."""
        k = 0
        while k < len(path) and k < len(self._spec) and path[k] == self._spec[k]:
            k += 1
        if len(self._spec) > k:
            self._matcher.rollback(len(self._spec) - k)
            del self._spec[k:]
        for t in path[k:]:
            if not 0 <= t < self._n or t in self._stops or self._matcher.try_consume_tokens([t]) != 1:
                return False
            self._spec.append(t)
        return True

    def _root_mask(self) -> np.ndarray:
        if self._root is None:
            self._goto([])
            self._root = self._mask()
        return self._root

    def _mask_after(self, path: list[int]) -> np.ndarray | None:
        """The mask after the committed tokens and ``path`` (None: ``path`` not allowed), computed once per path
        between commits (a drafter drafting under the constraint and the verifier's rows ask for the same paths)."""
        if not path:
            return self._root_mask()
        key = tuple(path)
        hit = self._after.get(key)
        if hit is None:
            if not self._goto(list(path)):
                return None
            hit = self._after[key] = self._mask()
        return hit

    def tree_masks(self, tree: DraftTree) -> tuple[torch.Tensor, list[bool]]:
        """See :meth:`Constraint.tree_masks`. A node after which nothing is committed (a stop token, or where the
        format is complete and no stop token exists) has no allowed child; if it has children its row allows one
        token that none of them holds, so the verifier accepts none of them (whatever it emits there is cut)."""
        n = len(tree)
        rows = np.ones((n + 1, self._vocab), dtype=bool)  # [N + 1, V]; dummy rows stay all True
        rows[0] = self._root_mask()
        allowed = [False] * n
        end = [False] * n  # nothing after it is ever committed: a stop token, or a complete format
        paths: list[list[int]] = [[] for _ in range(n)]
        for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents)):
            if par >= 0 and (not allowed[par] or end[par]):
                continue
            if not (0 <= tok < self._vocab and rows[par + 1, tok]):
                continue
            allowed[i] = True
            if tok in self._stops:
                end[i] = True
                continue
            paths[i] = (paths[par] if par >= 0 else []) + [tok]
            row = self._mask_after(paths[i])
            if row is None:  # allowed by the mask but refused by the matcher: never expected
                allowed[i] = False
                continue
            if row.any():
                rows[i + 1] = row
            else:  # complete, and no stop token to end it with
                end[i] = True
        self._goto([])
        for i in range(n):
            kids = tree.children[i + 1]
            if end[i] and kids:
                held = {tree.tokens[c] for c in kids}
                rows[i + 1] = False
                rows[i + 1, next(t for t in itertools.chain(self._stops, range(self._vocab)) if t not in held)] = True
        return torch.from_numpy(rows), allowed

    def mask_after(self, path: list[int]) -> torch.Tensor | None:
        out = self._mask_after(list(path))
        if out is None or (path and not out.any()):
            return None
        return torch.from_numpy(out.copy())

    # ------------------------------------------------------------------------------------------------ commit

    def commit(self, tokens: list[int]) -> int:
        self._goto([])
        self._root = None
        self._after.clear()
        taken = 0
        for t in tokens:
            if self.finished:
                break
            taken += 1
            if t in self._stops:
                self._ended = True
                break
            self._root = None
            self._after.clear()
            if not self._matcher.consume_token(int(t)):
                log.warning("the output constraint refused committed token %d (%s); the generation ends here", t,
                            self._matcher.get_error())
                self._ended = True
                break
        return taken

    def forced(self, limit: int) -> list[int]:
        if limit <= 0 or self.finished:
            return []
        self._goto([])
        return [int(t) for t in self._matcher.compute_ff_tokens()[:limit]]

    @property
    def finished(self) -> bool:
        self._goto([])
        if self._ended or self._matcher.is_error() or self._matcher.is_stopped():
            return True
        if not self._matcher.is_accepting():
            return False
        root = self._root_mask()  # accepting: finished when nothing but a stop token is allowed
        return not root.any() or bool(root.sum() == np.count_nonzero(root[self._stops]))
