"""ESP: training-free multi-token drafting by probing the target with mask tokens (Goel et al. 2026).

No draft model. Each verification forward also carries ``masks`` probe inputs after the root and after every
tree node (:class:`speculant.core.types.Probes`): mask j of node v sits at position ``pos(v) + j``, sees the cache,
the path to v and v's earlier masks, and its logits guess the token j + 1 places after v. After verification
the masks of the deepest accepted node v* hold guesses for the tokens after the bonus, and the next tree is
drafted from them: a static tree (the top-``K_1`` candidates of mask 1, under each the top-``K_2`` of mask 2,
...) or a dynamic tree (the best ``budget - i`` trajectories at depth i by cumulative probability). A candidate
equal to its parent token is skipped for the next-ranked one. The draft is deterministic (``draft_probs=None``):
greedy verification or the deterministic-draft rule when sampling, so decoding stays lossless. Probe slots never
stay in the KV cache (the engine keeps only the accepted path), and the tree-plus-probes attention block is
memoised per tree shape, so a static tree's mask is built once.

Mask embeddings (fed as ``inputs_embeds``): ``mean`` (default) starts from the mean input embedding of the
prompt and follows the committed tokens with an exponential moving average ``m <- m + λ (e - m)``; ``last``
uses the embeddings of the last ``masks`` committed tokens; ``random`` draws them once from a normal with the
embedding table's per-dimension mean and standard deviation (the paper's ablations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.checks import check_positive_int
from ..core.types import DraftTree, Probes
from .base import DecodeState, Drafter

__all__ = ["MaskProbeDrafter"]

_INITS = ("mean", "last", "random")


class MaskProbeDrafter(Drafter):
    """Self-speculative drafting from mask-token probes of the target.

    Args:
        masks: probe tokens after the root and after every tree node (the tree is at most this deep).
        tree: static tree widths ``[K_1, K_2, ...]`` per depth (at most ``masks`` entries).
        budget: dynamic tree instead: keep the best ``budget - i`` trajectories at depth i.
        init: mask embedding: ``mean`` (EMA of committed tokens), ``last`` or ``random`` (see the module doc).
        ema: λ of the ``mean`` embedding's moving average.
        seed: for ``init="random"``.
    """

    def __init__(self, masks: int = 2, tree: Sequence[int] | None = None, budget: int | None = None,
                 init: str = "mean", ema: float = 0.1, seed: int = 0) -> None:
        self.masks = check_positive_int("masks", masks)
        if tree is not None and budget is not None:
            raise ValueError("mask-probe takes either a static tree (tree=K1/K2/...) or a budget, not both")
        if budget is None:
            tree = list(tree) if tree is not None else [4, 2][:masks]
            if not tree or len(tree) > masks or any(isinstance(w, bool) or not isinstance(w, int) or w < 1
                                                    for w in tree):
                raise ValueError(f"mask-probe tree must be 1 to masks={masks} positive widths, got {tree!r}")
        else:
            check_positive_int("budget", budget)
        if init not in _INITS:
            raise ValueError(f"mask-probe init must be one of {', '.join(_INITS)}, got {init!r}")
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"mask-probe ema must be in (0, 1], got {ema!r}")
        self.tree, self.budget, self.init, self.ema, self.seed = tree, budget, init, ema, seed
        self._table: torch.Tensor | None = None  # [V, H] input embeddings of the target
        self._mean: torch.Tensor | None = None  # [H] EMA mask embedding
        self._random: torch.Tensor | None = None  # [masks, H]
        self._guesses: torch.Tensor | None = None  # [masks, V] log-probs of the masks after the last accepted node
        self._seen = 0  # committed tokens folded into the EMA
        self._tree: DraftTree | None = None

    # ------------------------------------------------------------------------------------------ protocol

    def begin(self, state: DecodeState) -> None:
        self._table = state.target.get_input_embeddings().weight.detach()  # [V, H]
        ids = torch.tensor(state.ids, device=self._table.device)
        self._mean = self._table[ids].float().mean(0)  # [H]
        self._seen = len(state.ids)
        self._guesses = None
        if self.init == "random":
            g = torch.Generator(device="cpu").manual_seed(self.seed)
            table = self._table.float().cpu()
            noise = torch.randn((self.masks, table.shape[1]), generator=g)
            self._random = (table.mean(0) + noise * table.std(0)).to(self._table.device)

    def propose(self, state: DecodeState) -> DraftTree:
        tokens, parents = self._nodes(state)
        n_rows = len(tokens) + 1  # root + nodes: every one gets its masks
        probes = Probes(anchors=list(range(n_rows)), length=self.masks, embeds=self._embeds(state, n_rows))
        self._tree = DraftTree(tokens=tokens, parents=parents, probes=probes)
        return self._tree

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        tree = self._tree
        row = state.last_accepted[-1] + 1 if state.last_accepted else 0  # deepest accepted node (0 = root)
        first = len(tree) + 1 + row * self.masks  # its probe slots come after the tree rows, anchor by anchor
        logits = state.last_logits[first : first + self.masks]  # [masks, V]
        self._guesses = torch.log_softmax(logits.float(), dim=-1)
        if self.init == "mean":  # fold the newly committed tokens into the moving average
            new = torch.tensor(state.ids[self._seen :], device=self._table.device)
            for e in self._table[new].float():
                self._mean += self.ema * (e - self._mean)
        self._seen = len(state.ids)

    def params_per_forward(self) -> int:
        """No draft model (for MBSU); the cost is the longer target forward."""
        return 0

    # ------------------------------------------------------------------------------------------ internals

    def _nodes(self, state: DecodeState) -> tuple[list[int], list[int]]:
        """The draft tree's ``(tokens, parents)`` from the masks' guesses (empty on the first step)."""
        depth = min(self.masks, state.draft_limit)
        if self._guesses is None or depth <= 0:
            return [], []
        if self.budget is None:
            return self._static_tree(state.ids[-1], depth)
        return self._dynamic_tree(state.ids[-1], depth)

    def _embeds(self, state: DecodeState, n_rows: int) -> torch.Tensor:
        """``[n_rows * masks, H]`` mask embeddings in slot order (the same masks after every anchor)."""
        if self.init == "mean":
            per_anchor = self._mean.expand(self.masks, -1)
        elif self.init == "last":
            last = state.ids[-self.masks :]
            last = [last[0]] * (self.masks - len(last)) + last
            per_anchor = self._table[torch.tensor(last, device=self._table.device)].float()
        else:
            per_anchor = self._random
        return per_anchor.repeat(n_rows, 1)

    def _ranked(self, depth: int, width: int) -> list[tuple[list[int], list[float]]]:
        """Per mask 1..depth: its ``width + 1`` best tokens and their log-probs (one spare for pruning)."""
        top = torch.topk(self._guesses[:depth], k=min(width + 1, self._guesses.shape[-1]), dim=-1)
        return list(zip(top.indices.tolist(), top.values.tolist()))

    def _static_tree(self, root: int, depth: int) -> tuple[list[int], list[int]]:
        widths = self.tree[:depth]
        ranked = self._ranked(len(widths), max(widths))
        tokens: list[int] = []
        parents: list[int] = []
        level = [(-1, root)]  # (node index, token) of the previous level; the root is -1
        for (cands, _), width in zip(ranked, widths):
            nxt = []
            for node, tok in level:
                for cand in [c for c in cands if c != tok][:width]:  # parent-repeat pruning
                    tokens.append(cand)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, cand))
            level = nxt
        return tokens, parents

    def _dynamic_tree(self, root: int, depth: int) -> tuple[list[int], list[int]]:
        ranked = self._ranked(depth, self.budget)
        tokens: list[int] = []
        parents: list[int] = []
        beams = [(0.0, -1, root)]  # (cumulative log-prob, node index, last token)
        for i, (cands, logps) in enumerate(ranked, start=1):
            keep = self.budget - i
            if keep <= 0:
                break
            ext = [(score + lp, node, c) for score, node, tok in beams for c, lp in zip(cands, logps) if c != tok]
            ext.sort(key=lambda x: -x[0])
            beams = []
            for score, node, c in ext[:keep]:
                tokens.append(c)
                parents.append(node)
                beams.append((score, len(tokens) - 1, c))
        return tokens, parents
