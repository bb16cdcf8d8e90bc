"""A drafter that keeps what verification said of its drafts: the raw material of online speculative decoding.

Online speculative decoding (Liu et al. 2024, "Online Speculative Decoding"): the target's verification forward
already computes, for free, its distribution at every position the drafter proposed a token for; a drafter trained
on those distributions (forward KL at the positions where its draft was refused) tracks the traffic it serves.
:class:`ObservedDrafter` wraps any drafter and, after each verified step, keeps for the drafted positions along the
committed path the target's top-``k`` probabilities (softmax of the verification logits, temperature 1) and
whether the draft's token there was refused; :meth:`ObservedDrafter.observation` returns them with the request's
token ids as one :class:`Observation`. Nothing is recomputed and decoding is untouched (the verifier never sees
this wrapper: it proposes exactly the inner drafter's trees).

Which positions: row 0 of the verification logits (the root) and the row of each accepted node predict the
consecutive tokens of the committed path. Every such row but the last had its drafted token accepted; the last
row's drafted token (if the drafter offered one there) was refused, and the bonus token came from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.types import DraftTree
from ..drafters.base import DecodeState, Drafter, DrafterWrapper

__all__ = ["Observation", "ObservedDrafter"]


@dataclass
class Observation:
    """One request's verified positions: what an online drafter update trains and validates on."""

    ids: torch.Tensor  # [N] int32: the request's token ids (prompt + generated), up to the last observed position
    positions: torch.Tensor  # [P] int64: index in ids of the token each distribution predicts (>= 1)
    top_ids: torch.Tensor  # [P, k] int32: the target's k most probable tokens at that position
    top_p: torch.Tensor  # [P, k] float16: their probabilities (temperature 1)
    rejected: torch.Tensor  # [P] bool: the drafted token at that position was refused

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(t.numel() * t.element_size() for t in (self.ids, self.positions, self.top_ids, self.top_p,
                                                             self.rejected))

    def __len__(self) -> int:
        return int(self.positions.numel())


class ObservedDrafter(DrafterWrapper):
    """``inner`` (any drafter) with the target's verdicts on its drafts kept (see the module); ``top_k``: how many
    of the target's most probable tokens to keep per position; ``record`` False: keep nothing but the generation's
    :attr:`token_ids` (no work per step). One generation per object, like every drafter."""

    def __init__(self, inner: Drafter, top_k: int = 32, record: bool = True) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        super().__init__(inner)
        self.top_k, self.record = top_k, record
        self._state: DecodeState | None = None
        self._tree: DraftTree | None = None
        self._positions: list[int] = []
        self._rejected: list[bool] = []
        self._ids: list[torch.Tensor] = []  # [r, k] blocks
        self._p: list[torch.Tensor] = []

    # the protocol
    def begin(self, state: DecodeState) -> None:
        self._state, self._tree = state, None
        self._positions, self._rejected, self._ids, self._p = [], [], [], []
        self.inner.begin(state)

    def propose(self, state: DecodeState) -> DraftTree:
        self._tree = self.inner.propose(state)
        return self._tree

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        tree, logits = self._tree, state.last_logits
        self._tree = None
        if self.record and tree is not None and len(tree) and logits is not None:
            last = state.last_accepted[-1] if state.last_accepted else -1
            refused = bool(tree.children[last + 1])  # the drafter offered a token where the bonus came from
            path = [0] + [1 + n for n in state.last_accepted]  # rows predicting the committed path's tokens
            rows = path if refused else path[:-1]
            if rows:
                before = len(state.ids) - len(accepted) - 1  # ids before this step; row r predicts index before + r
                with torch.no_grad():
                    p = logits[rows].float().softmax(-1)  # [r, V]
                    top = p.topk(min(self.top_k, p.shape[-1]), dim=-1)
                self._ids.append(top.indices.to(torch.int32))
                self._p.append(top.values.to(torch.float16))
                self._positions.extend(before + r for r in range(len(rows)))
                self._rejected.extend([False] * (len(rows) - 1) + [refused])
        self.inner.commit(state, accepted)

    @property
    def token_ids(self) -> list[int]:
        """The generation's committed token ids (prompt + new), as far as it went; [] before it began. (Under a
        text-only view of an image prompt, :mod:`speculant.drafters.text_only`, the view's ids: synced at each step,
        so a last step that ended the generation without a commit is missing.)"""
        return list(self._state.ids) if self._state is not None else []

    def observation(self) -> Observation | None:
        """The generation's observed positions with its token ids; None when no drafted position was verified."""
        if not self._positions or self._state is None:
            return None
        end = max(self._positions) + 1
        return Observation(ids=torch.tensor(self._state.ids[:end], dtype=torch.int32),
                           positions=torch.tensor(self._positions, dtype=torch.int64),
                           top_ids=torch.cat(self._ids), top_p=torch.cat(self._p),
                           rejected=torch.tensor(self._rejected, dtype=torch.bool))
