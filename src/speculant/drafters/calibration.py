"""Online calibration of draft probabilities into acceptance probabilities, for trees built by expected value.

A dynamic tree (EAGLE-2) keeps the nodes with the highest cumulative draft probability, which estimates the
chance a node is reached only if the draft is calibrated. A small drafter distilled for greedy agreement is not:
its top-1 token matches the target's far more often than its probability says, and its runner-up far less, so a
tree ranked by raw draft probability trades deep main-path nodes for shallow siblings that are rarely accepted.

:class:`AcceptanceCalibrator` learns ``a(q) = P(node accepted | its parent accepted, draft probability q)`` from
what verification actually accepted: ``q`` is bucketed into equal-width bins, each bin holds hits / trials with a
prior of ``prior_weight`` pseudo-trials at the bin centre (so before any evidence ``a(q) ≈ q``, EAGLE-2's
ranking). The sibling rank is a second key: the top-1 child and a runner-up with the same ``q`` are accepted at
different rates. Whatever it learns, it only shapes the tree: verification, and so the output, is unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["AcceptanceCalibrator"]


class AcceptanceCalibrator:
    """Binned estimate of ``P(accepted | draft probability q, sibling rank)``.

    Args:
        bins: equal-width bins of ``q`` in ``[0, 1]``.
        ranks: sibling ranks told apart (rank ``>= ranks`` share the last row).
        prior_weight: pseudo-trials per bin at the bin centre.
    """

    def __init__(self, bins: int = 20, ranks: int = 2, prior_weight: float = 2.0) -> None:
        self.bins = bins
        self.ranks = ranks
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins  # [bins]
        self.trials = torch.full((ranks, bins), float(prior_weight), dtype=torch.float64)  # [R, bins]
        self.hits = centres.expand(ranks, bins) * prior_weight  # [R, bins]
        self._log: list[list[float]] | None = None  # log(hits / trials), refreshed after updates

    def _cells(self, q: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = rank.clamp(max=self.ranks - 1)
        b = (q.double() * self.bins).long().clamp(0, self.bins - 1)
        return r, b

    def log_accept(self, q: list[list[float]]) -> list[list[float]]:
        """``q``: per row, the draft probabilities of a node's children in descending order (position = sibling
        rank, 0 = the draft's favourite) -> ``log a(q, rank)`` in the same layout: the estimated log-probability
        that each child is accepted once its parent is. Plain floats: a tree level has only a handful."""
        if self._log is None:
            self._log = (self.hits / self.trials).clamp_min(1e-9).log().tolist()
        last_rank, last_bin = self.ranks - 1, self.bins - 1
        return [[self._log[min(r, last_rank)][min(max(int(x * self.bins), 0), last_bin)] for r, x in enumerate(row)]
                for row in q]

    def update(self, q: list[float], rank: list[int], accepted: list[bool]) -> None:
        """Record verified nodes (each one's parent was accepted): probabilities, sibling ranks, outcomes."""
        if not q:
            return
        r, b = self._cells(torch.tensor(q, dtype=torch.float64), torch.tensor(rank))
        self.trials.index_put_((r, b), torch.ones(len(q), dtype=torch.float64), accumulate=True)
        self.hits.index_put_((r, b), torch.tensor(accepted, dtype=torch.float64), accumulate=True)
        self._log = None

    def table(self) -> list[list[float]]:
        """Current estimates ``[ranks][bins]`` (for inspection)."""
        return (self.hits / self.trials).tolist()
