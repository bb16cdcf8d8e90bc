"""The one verifier: every drafter's tree is accepted or rejected here (speculative sampling: Leviathan et al.
2023, Chen et al. 2023; over a tree: SpecInfer, Miao et al. 2024).

Rules, chosen from the tree and the sampling settings, never from the drafter's name:

* greedy (temperature 0): follow the child equal to the target's argmax; emit the argmax after the path;
* deterministic draft (``tree.draft_probs is None``), sampling: y ~ q at each node, descend if a child is y;
* stochastic draft, sampling: recursive rejection sampling over the children of each node, ``p`` updated
  without replacement (``tree.replacement == False``: chains, Gumbel-top-k / RSD) or kept (with replacement:
  i.i.d. siblings, SpecInfer). A chain is the single-child case, i.e. Leviathan/Chen speculative sampling;
* i.i.d. siblings with ``tree.coupling == "kseq"``: SpecTr's K-SEQ rule (Sun et al. 2023) at each node instead.

All of them preserve the target distribution exactly (greedy: token-identical output).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import numpy as np
import torch

from .sampling import sample, uniform, warp
from .types import DraftTree, SamplingParams, Verdict

__all__ = ["kseq_rho", "residual", "verify"]


def residual(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """norm((q - p)+): the distribution to draw from after a rejection. Falls back to ``q`` if it vanishes."""
    r = (q - p).clamp_min_(0.0)
    total = r.sum()
    return q if float(total) <= 0.0 else r / total


def verify(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Verify ``tree`` against the target's logits ``[N + 1, V]`` (row 0: after the root; row n+1: after node n).

    ``generator`` drives every random choice (required unless greedy). Returns the accepted path and the
    bonus/correction token.
    """
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tree) + 1:
        raise ValueError(f"target_logits must be [{len(tree) + 1}, V], got {tuple(target_logits.shape)}")
    if params.greedy:
        return _verify_greedy(tree, target_logits)
    if generator is None:
        raise ValueError("sampling verification needs a torch.Generator")
    if tree.draft_probs is None:
        return _verify_deterministic(tree, target_logits, params, generator)
    return _verify_rejection(tree, target_logits, params, generator)


def _follow(tree: DraftTree, pick: Callable[[int], int]) -> Verdict:
    """Walk down from the root: the target's token at a node (``pick(row)``, row 0 after the root) is accepted
    if a child drafted it, and is the bonus token otherwise. Greedy and deterministic-draft verification are
    this walk; they differ only in how the target's token is picked (argmax, or one draw per visited node)."""
    path: list[int] = []
    node = -1
    while True:
        want = pick(node + 1)
        nxt = next((c for c in tree.children[node + 1] if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want)
        path.append(nxt)
        node = nxt


def _verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    best = target_logits.argmax(-1).tolist()  # one host sync for the whole tree
    return _follow(tree, best.__getitem__)


def _verify_deterministic(tree, target_logits, params, generator) -> Verdict:
    q_all = warp(target_logits, params)  # [N + 1, V]: one batched warp for every node
    return _follow(tree, lambda row: sample(q_all[row], generator))


def _verify_rejection(tree, target_logits, params, generator) -> Verdict:
    device = target_logits.device
    q_all = warp(target_logits, params)  # [N + 1, V]: one batched warp for every node
    step = _kseq_step if tree.coupling == "kseq" else _recursive_step
    path: list[int] = []
    node = -1
    while True:
        q = q_all[node + 1]  # [V]
        kids = tree.children[node + 1]
        if tree.replacement and tree.draw_order is not None:
            kids = tree.draw_order[node + 1]
        if not kids:
            return Verdict(path, sample(q, generator))
        p = tree.draft_probs[node + 1].to(device=device, dtype=torch.float32)  # [V]
        if p.shape[0] < q.shape[0]:  # draft vocabulary smaller than the target's padded one
            p = torch.nn.functional.pad(p, (0, q.shape[0] - p.shape[0]))
        chosen, q = step(tree, kids, p, q, generator)
        if chosen is None:
            return Verdict(path, sample(q, generator))
        path.append(chosen)
        node = chosen


def _draft_prob(p: torch.Tensor, x: int) -> float:
    """``p(x)`` of a drafted token, which must be positive (the drafter drew it from ``p``)."""
    px = float(p[x])
    if px <= 0.0:
        raise ValueError(f"draft token {x} has draft probability 0: the drafter's p is inconsistent")
    return px


def _recursive_step(tree, kids, p, q, generator) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling over ``kids`` (in verification order): the accepted child, or None and the
    distribution to sample the correction from."""
    for c in kids:
        x = tree.tokens[c]
        if uniform(generator, q.device) * _draft_prob(p, x) < float(q[x]):  # accept with probability min(1, q/p)
            return c, q
        q = residual(q, p)
        if not tree.replacement:
            p = p.clone()
            p[x] = 0.0
            total = p.sum()
            if float(total) > 0.0:
                p = p / total
    return None, q


def kseq_rho(p: torch.Tensor, q: torch.Tensor, k: int, iterations: int = 60) -> float:
    """SpecTr's ``rho`` for ``k`` i.i.d. drafts from ``p`` (target ``q``): a root of ``g(beta(rho)) = rho`` in
    ``[1, k]``, approached from the side where ``g(beta(rho)) <= rho``, with ``beta(rho) = sum_x min(p(x), q(x) / rho)``
    and ``g(beta) = (1 - (1 - beta)^k) / beta`` (``k`` at ``beta = 0``).

    The K-SEQ rule is exact for every ``rho`` with ``g(beta(rho)) <= rho`` (its residual is then non-negative;
    ``rho = k`` always qualifies) and accepts most at the root. ``beta`` is evaluated in O(log V) from the sorted
    ratios ``q/p`` in ``[1, k)`` and their cumulative masses (``min(p, q/rho)`` is ``q/rho`` exactly where
    ``q/p < rho``), so the bisection costs one host transfer and a sort of those few ratios."""
    if k <= 1:
        return 1.0
    p64 = p.detach().double().cpu().numpy()
    q64 = q.detach().double().cpu().numpy()
    drafted = p64 > 0  # tokens with p = 0 add nothing to beta
    p64, q64 = p64[drafted], q64[drafted]
    ratio = q64 / p64
    below, above = ratio < 1.0, ratio >= k  # for rho in [1, k]: always q/rho, always p
    mid = ~(below | above)
    order = np.argsort(ratio[mid], kind="stable")
    # Python lists, not arrays: the bisection below makes ~60 scalar lookups, each far cheaper in plain Python
    ratio = ratio[mid][order].tolist()  # only these ratios can fall on either side of rho
    cum_q = (float(q64[below].sum()) + np.concatenate([[0.0], np.cumsum(q64[mid][order])])).tolist()
    cum_p = np.concatenate([[0.0], np.cumsum(p64[mid][order])]).tolist()
    p_above = float(p64[above].sum())

    def excess(rho: float) -> float:  # g(beta(rho)) - rho
        i = bisect.bisect_left(ratio, rho)  # ratios below rho: those tokens give q/rho
        beta = cum_q[i] / rho + (cum_p[-1] - cum_p[i]) + p_above
        g = float(k) if beta <= 0.0 else -math.expm1(k * math.log1p(-min(beta, 1.0))) / beta
        return g - rho

    lo, hi = 1.0, float(k)
    if excess(lo) <= 0.0:
        return lo
    for _ in range(iterations):
        centre = 0.5 * (lo + hi)
        if excess(centre) <= 0.0:
            hi = centre
        else:
            lo = centre
    return hi


def _kseq_step(tree, kids, p, q, generator) -> tuple[int | None, torch.Tensor]:
    """SpecTr's K-SEQ over the ``K = len(kids)`` i.i.d. draws at a node (duplicates included, in draw order):
    accept draw ``x`` with probability ``min(1, q(x) / (rho p(x)))``, the first acceptance wins; if none, the
    correction comes from ``(q - min(p, q / rho) * p_acc / beta) / (1 - p_acc)``, ``p_acc = 1 - (1 - beta)^K``."""
    k = len(kids)
    rho = kseq_rho(p, q, k)
    for c in kids:
        x = tree.tokens[c]
        if uniform(generator, q.device) * rho * _draft_prob(p, x) < float(q[x]):
            return c, q
    q64, p64 = q.double(), p.double()
    accepted = torch.minimum(p64, q64 / rho)  # [V]
    beta = float(accepted.sum())
    p_acc = 1.0 - (1.0 - beta) ** k
    if beta <= 0.0 or p_acc >= 1.0:
        return None, q  # nothing could be accepted (disjoint supports) / every draw is always accepted
    left = (q64 - accepted * (p_acc / beta)).clamp_min_(0.0)
    total = float(left.sum())
    return None, (q if total <= 0.0 else (left / total).to(q.dtype))
