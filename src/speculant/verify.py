"""The one verifier: every drafter's tree is accepted or rejected here (../shared/ALGORITHMS.md, Verification).

Rules, chosen from the tree and the sampling settings, never from the drafter's name:

* greedy (temperature 0): follow the child equal to the target's argmax; emit the argmax after the path;
* deterministic draft (``tree.draft_probs is None``), sampling: y ~ q at each node, descend if a child is y;
* stochastic draft, sampling: recursive rejection sampling over the children of each node, ``p`` updated
  without replacement (``tree.replacement == False``: chains, Gumbel-top-k / RSD) or kept (with replacement:
  i.i.d. siblings, SpecInfer). A chain is the single-child case, i.e. Leviathan/Chen speculative sampling.

All of them preserve the target distribution exactly (greedy: token-identical output).
"""

from __future__ import annotations

import torch

from .sampling import sample, uniform, warp
from .types import DraftTree, SamplingParams, Verdict

__all__ = ["verify", "residual"]


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


def _verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    best = target_logits.argmax(-1).tolist()  # one host sync for the whole tree
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        nxt = next((c for c in tree.children[node + 1] if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want)
        path.append(nxt)
        node = nxt


def _verify_deterministic(tree, target_logits, params, generator) -> Verdict:
    q_all = warp(target_logits, params)  # [N + 1, V]: one batched warp for every node
    path: list[int] = []
    node = -1
    while True:
        y = sample(q_all[node + 1], generator)
        nxt = next((c for c in tree.children[node + 1] if tree.tokens[c] == y), None)
        if nxt is None:
            return Verdict(path, y)
        path.append(nxt)
        node = nxt


def _verify_rejection(tree, target_logits, params, generator) -> Verdict:
    device = target_logits.device
    q_all = warp(target_logits, params)  # [N + 1, V]: one batched warp for every node
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
        chosen = None
        for c in kids:
            x = tree.tokens[c]
            px, qx = float(p[x]), float(q[x])
            if px <= 0.0:
                raise ValueError(f"draft token {x} has draft probability 0: the drafter's p is inconsistent")
            if uniform(generator, device) * px < qx:  # accept with probability min(1, q/p)
                chosen = c
                break
            q = residual(q, p)
            if not tree.replacement:
                p = p.clone()
                p[x] = 0.0
                total = p.sum()
                if float(total) > 0.0:
                    p = p / total
        if chosen is None:
            return Verdict(path, sample(q, generator))
        path.append(chosen)
        node = chosen
