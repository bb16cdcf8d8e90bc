"""Token trees drafted by a draft model: SpecInfer, SpecTr, RSD-C, RSD-S and the greedy dynamic tree.

Every drafter here builds its tree level by level with ONE batched draft forward per level: the nodes of a level are
fed together with tree attention (a node sees the committed tokens, its ancestors and itself; position = root
position + depth), using the mask machinery of :mod:`speculant.core.tree` over the draft cache, whose layout after
the root is exactly the fed nodes in feed order. Nodes of the last level are never fed (their distributions are not
needed). On commit the draft cache keeps the fed nodes of the accepted path (:meth:`DraftModelBase.commit`), so
nothing is re-prefilled.

What the one verifier gets, per method and sampling mode:

* ``specinfer`` (Miao et al. 2024): ``width`` i.i.d. draft sequences merged into a prefix tree;
  ``replacement=True`` with ``draw_order`` listing, at each node, the child reached by each sequence through it,
  in sequence order, duplicates repeated (the with-replacement rule needs every i.i.d. draw).
* ``spectr`` (Sun et al. 2023): the same tree, ``coupling="kseq"``: the K-SEQ rule over each node's draws.
* ``rsd-c`` (Jeon et al. 2024, constant branching): the children of a node at depth ``l - 1`` are the
  Gumbel-top-``b_l`` of ``p``, in descending Gumbel order (sampling without replacement, in draw order);
  ``replacement=False``.
* ``rsd-s`` (Jeon et al. 2024; stochastic beam search, Kool et al. 2019): Gumbel-top-``width`` over sequences,
  level by level; each node's kept children are a prefix of its Gumbel order; ``replacement=False``.
* ``tree`` (greedy dynamic tree, EAGLE-2 style, Li et al. 2024): expand the ``topk`` best frontier nodes by
  cumulative draft log-probability, keep the ``budget`` best nodes. Deterministic: ``draft_probs=None``, so at
  temperature > 0 it is verified by the deterministic-draft rule (y ~ q, descend if a child is y): lossless.

``draft_probs`` rows (stochastic trees) are the draft's full warped distribution at each internal node (lifted to
the shared vocabulary with VocabTrim); leaf rows are zeros (never read). At temperature 0 every method proposes
a deterministic tree verified by the greedy rule: top-``b_l`` children (rsd-c), beam search of width ``width``
(specinfer, rsd-s), the dynamic tree (tree).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..core.checks import check_positive_int
from ..core.sampling import sample_rows, warp
from ..core.tree import TreeAttention
from ..core.types import DraftTree
from .base import DecodeState
from .calibration import AcceptanceCalibrator
from .model import DraftModelBase

__all__ = ["DynamicTreeDrafter", "RSDCDrafter", "RSDSDrafter", "SpecInferDrafter", "SpecTrDrafter",
           "TreeDrafterBase"]

_LN2 = math.log(2.0)


def gumbel_keys(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``log p + G`` with ``G ~ Gumbel(0, 1)`` i.i.d. (``-inf`` where ``p = 0``): ``[..., V]``. The top-k of these
    keys, in descending order, is a sample of k tokens drawn sequentially without replacement from ``p``."""
    e = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return probs.log() - e.log()  # G = -log(E), E ~ Exp(1)


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a <= 0``, stable at both ends (Mächler 2012)."""
    return torch.where(a > -_LN2, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def truncated_gumbel(parent: torch.Tensor, keys: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Kool et al. (2019), stochastic beam search: children's Gumbels conditioned on their maximum being the
    parent's (truncated) value ``parent``: ``-log(exp(-parent) - exp(-top) + exp(-keys))``, computed stably
    (``top`` = the row maximum of ``keys``; ``-inf`` keys stay ``-inf``). Broadcasts; use float64."""
    v = parent - keys + _log1mexp(keys - top)
    return parent - torch.nn.functional.softplus(v)


class TreeDrafterBase(DraftModelBase):
    """A draft-model drafter that feeds its tree level by level (one batched forward per level).

    Under an output constraint it drafts within it (``drafts_constrained``): the logits :meth:`_start` and
    :meth:`_feed` return are masked with what the constraint allows after each row's path, so every method's ``p``
    (and its greedy beam) is the masked distribution it then draws from (exact). A row where nothing may follow
    (a stop token, nothing allowed among VocabTrim's kept ids) is left unmasked: its children are forbidden and
    cut by the engine."""

    drafts_constrained = True

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self._attn = TreeAttention(self.model.dtype, self.model.device)
        self._fed_tokens: list[int] = []
        self._fed_parents: list[int] = []
        self._fed_paths: list[list[int]] = []  # each fed node's tokens from the root (for the constraint)

    def _start(self, state: DecodeState) -> torch.Tensor:
        """Start a proposal (feed the root and what the cache lacks): the draft logits after the root ``[1, V]``."""
        self._fed_tokens, self._fed_parents, self._fed_paths = [], [], []
        return self._constrained(state, self._catch_up(state)[None], [[]])

    def _constrained(self, state: DecodeState, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``logits [T, V]`` (``[T, M]`` trimmed), row ``i`` masked with what the output constraint allows after
        ``paths[i]`` (see the class doc); as they are without a constraint."""
        if state.constraint is None:
            return logits
        rows = []
        for row, path in zip(logits, paths):
            allowed = self._allowed(state, path)
            rows.append(row if allowed is None else row.masked_fill(~allowed, float("-inf")))
        return torch.stack(rows)

    def _feed(self, state: DecodeState, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Feed one level of nodes in one forward; ``parents`` are positions in the feed order (-1: the root),
        all fed before. Returns the draft logits after each node ``[T, V]`` (``[T, M]`` trimmed).

        The draft cache after the root holds the fed nodes in feed order, so the mask of the new nodes is the last
        ``T`` rows of the tree mask of ``[root] + fed nodes`` over the committed tokens before the root."""
        start = len(self._fed_tokens)
        self._fed_tokens += tokens
        self._fed_parents += parents
        for tok, par in zip(tokens, parents):  # a parent may be fed in this call too
            self._fed_paths.append((self._fed_paths[par] if par >= 0 else []) + [tok])
        paths = self._fed_paths[start:]
        fed = DraftTree(tokens=list(self._fed_tokens), parents=list(self._fed_parents))
        if fed.is_chain():  # the causal mask is the tree mask
            return self._constrained(state, self._all_logits(state, tokens, None, None), paths)
        mask, positions = self._attn.build(fed, self._root_slot())  # [1, 1, Q, L + Q], [1, Q]
        logits = self._all_logits(state, tokens, mask[:, :, start + 1 :], positions[:, start + 1 :])
        return self._constrained(state, logits, paths)

    def _depth(self, state: DecodeState, depth: int) -> int:
        return min(depth, state.draft_limit)  # deeper nodes could never be committed, or the engine caps it

    def _finish(self, state: DecodeState, tokens: list[int], parents: list[int], rows: list[torch.Tensor],
                fed: int | list[int], **tree_options) -> DraftTree:
        """Assemble the tree (``rows``: draft distributions of the internal levels, in node order; the remaining
        rows are leaves) and record it for commit."""
        probs = None
        if rows:
            probs = torch.cat(rows)  # [internal + 1, V]
            probs = torch.cat([probs, probs.new_zeros((len(tokens) + 1 - probs.shape[0], probs.shape[1]))])
        tree = DraftTree(tokens=tokens, parents=parents, draft_probs=probs, **tree_options)
        self._record(state, tree, fed)
        return tree

    def _propose_beam(self, state: DecodeState, logits: torch.Tensor, width: int, depth: int) -> DraftTree:
        """Beam search (temperature 0) or stochastic beam search (sampling) of ``width`` over ``depth`` levels.

        Each frontier node carries ``phi`` = log p(path) and ``score`` (sampling: its truncated Gumbel ``G~``;
        greedy: ``phi``). A node's candidates are its ``width`` best children by Gumbel key (by log-prob when
        greedy); the level keeps the ``width`` best candidates by score, and each node's kept children are the
        first of its candidates (a prefix of its Gumbel order, so the without-replacement rule applies)."""
        greedy = state.params.greedy
        tokens: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor] = []
        frontier = [-1]
        phi = torch.zeros(1, dtype=torch.float64, device=logits.device)
        score = phi
        for level in range(depth):
            if greedy:
                logp = logits.float().log_softmax(-1)  # [F, V]
                keys = logp
            else:
                p = warp(logits, state.params)  # [F, V]
                rows.append(self._lift(p))
                logp = p.log()
                keys = gumbel_keys(p, state.generator)
            vals, idx = keys.topk(min(width, keys.shape[-1]), dim=-1)  # [F, C], descending: draw order
            cand_phi = phi[:, None] + logp.gather(-1, idx).double()  # [F, C]
            if greedy:
                cand_score = cand_phi
            else:
                g = phi[:, None] + vals.double()  # the children's Gumbels G ~ Gumbel(phi_child)
                cand_score = truncated_gumbel(score[:, None], g, g[:, :1])
            flat = cand_score.flatten()
            n_keep = min(width, int(torch.isfinite(flat).sum()))
            counts = torch.bincount(flat.topk(n_keep).indices // idx.shape[1], minlength=idx.shape[0]).tolist()
            ids = self._token_ids(idx).tolist()
            level_start = len(tokens)
            pick_r: list[int] = []
            pick_j: list[int] = []
            for r, par in enumerate(frontier):
                for j in range(counts[r]):  # the first counts[r] candidates of row r
                    tokens.append(ids[r][j])
                    parents.append(par)
                    pick_r.append(r)
                    pick_j.append(j)
            frontier = list(range(level_start, len(tokens)))
            if level + 1 == depth:
                break
            r_t = torch.tensor(pick_r, device=idx.device)
            j_t = torch.tensor(pick_j, device=idx.device)
            phi, score = cand_phi[r_t, j_t], cand_score[r_t, j_t]
            logits = self._feed(state, tokens[level_start:], parents[level_start:])
        return self._finish(state, tokens, parents, rows, len(tokens) - len(frontier))


class _WidthDepthDrafter(TreeDrafterBase):
    """Trees of at most ``width`` nodes per level and ``depth`` levels (SpecInfer, RSD-S)."""

    def __init__(self, draft_model: torch.nn.Module, width: int = 4, depth: int = 4,
                 tokenizers_match: bool | None = None, vocab_trim: int | Sequence[int] | None = None) -> None:
        super().__init__(draft_model, tokenizers_match=tokenizers_match, vocab_trim=vocab_trim)
        self.width = check_positive_int("width", width)
        self.depth = check_positive_int("depth", depth)

    def _extra_slots(self) -> int:
        return self.width * (self.depth - 1)


class SpecInferDrafter(_WidthDepthDrafter):
    """SpecInfer (Miao et al. 2024): ``width`` i.i.d. draft sequences of ``depth`` tokens merged into a prefix
    tree, verified by recursive rejection sampling with replacement. At temperature 0: beam search of ``width``.

    Args:
        draft_model, tokenizers_match, vocab_trim: see :class:`~speculant.drafters.model.DraftModelBase`.
        width: draft sequences W (at most W nodes per level).
        depth: tokens per sequence L (draft forwards per step).
    """

    coupling = "recursive"  # the rule for the i.i.d. siblings (SpecTr: "kseq")

    def propose(self, state: DecodeState) -> DraftTree:
        depth = self._depth(state, self.depth)
        logits = self._start(state)
        if state.params.greedy:
            return self._propose_beam(state, logits, self.width, depth)
        tokens: list[int] = []
        parents: list[int] = []
        draw_order: list[list[int]] = [[]]  # per row (0 = root, n + 1 = node n): children in draw order
        rows: list[torch.Tensor] = []
        frontier = [-1]  # node of each frontier row (the current level's nodes, in node order)
        at = torch.zeros(self.width, dtype=torch.long, device=logits.device)  # each sequence's frontier row
        for level in range(depth):
            p = warp(logits, state.params)  # [F, V]
            rows.append(self._lift(p))
            draws = sample_rows(p[at], state.generator)  # [W]: one i.i.d. draw each
            level_start = len(tokens)
            made: dict[tuple[int, int], int] = {}
            where: list[int] = []
            for r, tok in zip(at.tolist(), self._token_ids(draws).tolist()):
                node = made.get((r, tok))
                if node is None:  # a new prefix: a new node; a repeated one is merged, its draw still listed
                    node = made[(r, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(frontier[r])
                    draw_order.append([])
                draw_order[frontier[r] + 1].append(node)
                where.append(node - level_start)
            frontier = list(range(level_start, len(tokens)))
            if level + 1 == depth:
                break
            at = torch.tensor(where, device=logits.device)
            logits = self._feed(state, tokens[level_start:], parents[level_start:])
        return self._finish(state, tokens, parents, rows, len(tokens) - len(frontier), replacement=True,
                            draw_order=draw_order, coupling=self.coupling)


class SpecTrDrafter(SpecInferDrafter):
    """SpecTr (Sun et al. 2023): SpecInfer's tree of ``width`` i.i.d. draft sequences, verified node by node by
    the K-SEQ rule over the draws at each node (a coupling whose acceptance probability is within a factor
    1 - 1/e of the best any rule achieves with K i.i.d. drafts). At temperature 0: beam search of ``width``, as
    SpecInfer.

    Args:
        draft_model, tokenizers_match, vocab_trim: see :class:`~speculant.drafters.model.DraftModelBase`.
        width: draft sequences W = K (at most W nodes per level).
        depth: tokens per sequence L (draft forwards per step).
    """

    coupling = "kseq"


class RSDCDrafter(TreeDrafterBase):
    """RSD-C, recursive speculative decoding with constant branching (Jeon et al. 2024): the children of every
    node at depth ``l - 1`` are the Gumbel-top-``b_l`` of the draft distribution (drawn without replacement),
    verified by recursive rejection sampling without replacement. At temperature 0: the top-``b_l`` children.

    Args:
        draft_model, tokenizers_match, vocab_trim: see :class:`~speculant.drafters.model.DraftModelBase`.
        branching: ``(b_1, ..., b_L)``: children per node at each level; the tree has
            ``b_1 + b_1 b_2 + ...`` nodes and depth L.
    """

    def __init__(self, draft_model: torch.nn.Module, branching: Sequence[int] = (2, 2, 1),
                 tokenizers_match: bool | None = None, vocab_trim: int | Sequence[int] | None = None) -> None:
        super().__init__(draft_model, tokenizers_match=tokenizers_match, vocab_trim=vocab_trim)
        branching = list(branching) if isinstance(branching, (list, tuple)) else branching
        if not isinstance(branching, list) or not branching:
            raise ValueError(f"branching must be a non-empty list of integers >= 1, got {branching!r}")
        self.branching = [check_positive_int("each branching factor", b) for b in branching]

    def _extra_slots(self) -> int:
        return sum(math.prod(self.branching[: i + 1]) for i in range(len(self.branching) - 1))

    def propose(self, state: DecodeState) -> DraftTree:
        depth = self._depth(state, len(self.branching))
        logits = self._start(state)
        greedy = state.params.greedy
        tokens: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor] = []
        frontier = [-1]
        for level in range(depth):
            if greedy:
                keys = logits  # top-b by draft logits
            else:
                p = warp(logits, state.params)  # [F, V]
                rows.append(self._lift(p))
                keys = gumbel_keys(p, state.generator)
            vals, idx = keys.topk(min(self.branching[level], keys.shape[-1]), dim=-1)  # [F, b]: draw order
            ok = torch.isfinite(vals).tolist()  # fewer children where p has fewer tokens
            ids = self._token_ids(idx).tolist()
            level_start = len(tokens)
            for r, par in enumerate(frontier):
                for tok, good in zip(ids[r], ok[r]):
                    if good:
                        tokens.append(tok)
                        parents.append(par)
            frontier = list(range(level_start, len(tokens)))
            if level + 1 == depth:
                break
            logits = self._feed(state, tokens[level_start:], parents[level_start:])
        return self._finish(state, tokens, parents, rows, len(tokens) - len(frontier), replacement=False)


class RSDSDrafter(_WidthDepthDrafter):
    """RSD-S, recursive speculative decoding with stochastic beam search (Jeon et al. 2024; Kool et al. 2019):
    Gumbel-top-``width`` over draft sequences, level by level (at most ``width`` nodes per level), verified by
    recursive rejection sampling without replacement. At temperature 0: beam search of ``width``.

    Args:
        draft_model, tokenizers_match, vocab_trim: see :class:`~speculant.drafters.model.DraftModelBase`.
        width: beam width W (nodes per level).
        depth: levels L (draft forwards per step).
    """

    def propose(self, state: DecodeState) -> DraftTree:
        logits = self._start(state)
        return self._propose_beam(state, logits, self.width, self._depth(state, self.depth))


class DynamicTreeDrafter(TreeDrafterBase):
    """Greedy dynamic tree (EAGLE-2 style, Li et al. 2024): for ``depth`` levels expand the ``topk`` frontier
    nodes with the highest cumulative draft log-probability (``topk`` children each, one batched forward per
    level), then keep the ``budget`` best nodes of everything generated (a subtree: a parent scores at least as
    high as its children).

    A deterministic draft: greedy verification at temperature 0; at temperature > 0 the log-probabilities are
    those of the warped draft distribution and the deterministic-draft rule verifies it, losslessly.

    Args:
        draft_model, tokenizers_match, vocab_trim: see :class:`~speculant.drafters.model.DraftModelBase`.
        budget: tree tokens per target call N.
        topk: children per expanded node, and nodes expanded per level K.
        depth: levels L (draft forwards per step).
        calibrate: rank nodes by learned acceptance probabilities (:mod:`.calibration`) instead of raw draft
            probabilities: the tree keeps the nodes most likely to be accepted even when the draft is
            over- or under-confident. Learned across generations from what verification accepted (and started
            afresh when the temperature, top-k or top-p change); it never changes the output.
    """

    def __init__(self, draft_model: torch.nn.Module, budget: int = 16, topk: int = 4, depth: int = 4,
                 calibrate: bool = True, tokenizers_match: bool | None = None,
                 vocab_trim: int | Sequence[int] | None = None) -> None:
        super().__init__(draft_model, tokenizers_match=tokenizers_match, vocab_trim=vocab_trim)
        self.budget = check_positive_int("budget", budget)
        self.topk = check_positive_int("topk", topk)
        self.depth = check_positive_int("depth", depth)
        self.calibrator = AcceptanceCalibrator() if calibrate else None
        self._calibrated_for: tuple | None = None  # the sampling settings the calibration was learned under
        self._node_q: list[tuple[float, int]] = []  # (draft probability, sibling rank) of the proposed nodes

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        settings = (state.params.temperature, state.params.top_k, state.params.top_p)
        if self.calibrator is not None and settings != self._calibrated_for:  # acceptance rates depend on them
            self.calibrator = AcceptanceCalibrator()
            self._calibrated_for = settings

    def _extra_slots(self) -> int:
        return self.topk * (self.depth - 1)

    def propose(self, state: DecodeState) -> DraftTree:
        depth = self._depth(state, self.depth)
        logits = self._start(state)
        k = self.topk
        # the candidate pool: token, parent (pool index, -1 = root), cumulative log-prob, depth, feed position
        tok: list[int] = []
        par: list[int] = []
        score: list[float] = []
        dep: list[int] = []
        fed: list[int] = []
        local: list[tuple[float, int]] = []  # (draft probability, sibling rank)
        frontier, frontier_score = [-1], [0.0]
        for level in range(depth):
            if state.params.greedy:
                logp = logits.float().log_softmax(-1)  # [F, V]
            else:
                logp = warp(logits, state.params).log()
            vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [F, K]
            vals = vals.tolist()
            qs = [[math.exp(v) for v in row] for row in vals]  # [F][K] draft probabilities
            if self.calibrator is not None:  # log a(q, rank) in place of log q (-inf stays: never drafted)
                vals = [[c if v > -math.inf else v for v, c in zip(row, cal)]
                        for row, cal in zip(vals, self.calibrator.log_accept(qs))]
            cum = [[base + v for v in row] for base, row in zip(frontier_score, vals)]
            ids = self._token_ids(idx).tolist()
            new: list[int] = []
            for r, parent in enumerate(frontier):
                for rank, (t, s) in enumerate(zip(ids[r], cum[r])):
                    if s > -math.inf:
                        new.append(len(tok))
                        tok.append(t)
                        par.append(parent)
                        score.append(s)
                        dep.append(level + 1)
                        fed.append(-1)
                        local.append((qs[r][rank], rank))
            if level + 1 == depth:
                break
            frontier = sorted(new, key=lambda i: -score[i])[:k]  # stable: earlier candidates win ties
            frontier_score = [score[i] for i in frontier]
            start = len(self._fed_tokens)
            for n, i in enumerate(frontier):
                fed[i] = start + n
            logits = self._feed(state, [tok[i] for i in frontier], [fed[par[i]] if par[i] >= 0 else -1
                                                                     for i in frontier])
        # the best `budget` nodes; a parent never scores below its child and sorts first on ties: a subtree
        best = sorted(range(len(tok)), key=lambda i: (-score[i], dep[i], i))[: self.budget]
        best.sort(key=lambda i: (dep[i], i))  # topological (level) order
        node_of = {i: n for n, i in enumerate(best)}
        tokens = [tok[i] for i in best]
        parents = [node_of[par[i]] if par[i] >= 0 else -1 for i in best]
        self._node_q = [local[i] for i in best]
        return self._finish(state, tokens, parents, [], [fed[i] for i in best])

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        if self.calibrator is not None and self._tree is not None:
            self._learn(self._tree, accepted)
        super().commit(state, accepted)

    def _learn(self, tree: DraftTree, accepted: list[int]) -> None:
        """Every child of an accepted node (the root included) was tried: a hit if it is the next accepted one."""
        q: list[float] = []
        rank: list[int] = []
        hits: list[bool] = []
        node = -1
        for tok in [*accepted, None]:
            nxt = None
            for c in tree.children[node + 1]:
                hit = tok is not None and tree.tokens[c] == tok
                q.append(self._node_q[c][0])
                rank.append(self._node_q[c][1])
                hits.append(hit)
                nxt = c if hit else nxt
            if nxt is None:
                break
            node = nxt
        self.calibrator.update(q, rank, hits)
