"""How much a second (third, ...) sibling adds, and what tree shape that implies, for the bundled pair.

Low-variance, analytic view of speculative sampling that complements the wall-clock benchmarks: the target
samples continuations of held-out ``code`` prompts at temperature T; both models are then teacher-forced on
those sequences, and at every generated position (p = target, q = draft, both at temperature T):

* ``alpha`` = Σ min(p, q): the chance one draft token is accepted (1 − TVD), for several VocabTrim sizes;
* ``within[m]``: the chance that one of m siblings is accepted, for siblings drawn WITHOUT replacement
  (Gumbel-top-m, recursive rejection sampling with the residual p and q renormalised without the rejected
  tokens, as RSD verifies) and WITH replacement (i.i.d., SpecInfer's rule), estimated exactly given each draw
  and averaged over ``--draws`` draws per position.

From the sibling curve it builds, under Sequoia's position-independence assumption, the tree with the largest
expected τ for each node budget (a dynamic programme over subtree sizes) and compares it with the chain of the
same budget. The chain's expected τ under the same assumption is also compared with the measured one in the
notes. Writes one JSON file.

    python benchmarks/sibling_acceptance.py [--prompts 24] [--max-new-tokens 128] [--temperatures 1.0,0.6]
        [--trims 0,2048,4096,8192] [--draws 16] [--out benchmarks/results/sibling_acceptance.json]
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from pathlib import Path

import torch

import speculant
from speculant.data.prompts import builtin_prompts
from speculant.bench.speed import machine_info
from speculant.drafters.vocab_trim import load_calibration


def _sequences(target, prompts, max_new, temperature, seed):
    out = []
    for i, ids in enumerate(prompts):
        gen = speculant.generate(target, ids, None, max_new_tokens=max_new, temperature=temperature,
                                 seed=seed + i, eos_token_id=[])
        out.append((ids, gen.token_ids))
    return out


@torch.no_grad()
def _logits(model, ids, new):
    """``[len(new), V]`` next-token logits at the positions that predicted ``new``."""
    x = torch.tensor([ids + new])
    logits = model(input_ids=x).logits[0, len(ids) - 1 : -1].float()
    return logits


def _within(p: torch.Tensor, q: torch.Tensor, m: int, draws: int, replacement: bool, gen) -> list[float]:
    """Mean P(one of the first j siblings accepted), j = 1..m; p, q ``[N, V]``."""
    n, v = q.shape
    res = torch.zeros(m)
    for _ in range(draws):
        pr, qr = p.clone(), q.clone()
        alive = torch.ones(n)  # P(all previous siblings rejected)
        for j in range(m):
            if replacement:
                x = torch.multinomial(q, 1, generator=gen)[:, 0]
                qj = q
            else:
                g = -torch.log(-torch.log(torch.rand(n, v, generator=gen).clamp_min(1e-20)))
                x = (qr.clamp_min(1e-30).log() + g).argmax(-1)  # a draw from the renormalised remaining q
                qj = qr
            rows = torch.arange(n)
            px, qx = pr[rows, x], qj[rows, x].clamp_min(1e-30)
            a = torch.minimum(torch.ones_like(px), px / qx)
            a = torch.where(qj[rows, x] > 0, a, torch.zeros_like(a))
            alive = alive * (1 - a)
            res[j] += float((1 - alive).mean())
            pr = (pr - qj).clamp_min(0)
            pr = pr / pr.sum(-1, keepdim=True).clamp_min(1e-30)
            if not replacement:
                qr = qr.clone()
                qr[rows, x] = 0
                qr = qr / qr.sum(-1, keepdim=True).clamp_min(1e-30)
    return (res / draws).tolist()


def best_trees(alpha: float, within: list[float], budget: int) -> dict[int, float]:
    """Expected τ of the best tree with n ≤ budget nodes, for every n, when the first child of any node is
    accepted with probability ``alpha`` and the k-th (k ≥ 2) with ``within[k-1] - within[k-2]``, independently
    of depth (Sequoia's model). ``alpha`` is exact; the sibling increments are Monte-Carlo estimates."""
    r = [alpha] + [within[k] - within[k - 1] for k in range(1, len(within))]

    @cache
    def sub(n: int) -> float:
        """Expected accepted tokens below a node that has n descendants available."""
        return kids(n, 0)

    @cache
    def kids(n: int, rank: int) -> float:
        """Best value from children of rank ≥ rank using at most n nodes."""
        if n == 0 or rank >= len(r):
            return 0.0
        best = kids(n, len(r))  # no more children
        for size in range(1, n + 1):  # this child's subtree: itself + size-1 descendants
            best = max(best, r[rank] * (1 + sub(size - 1)) + kids(n - size, rank + 1))
        return best

    return {n: 1 + sub(n) for n in range(1, budget + 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="1.0,0.6")
    ap.add_argument("--trims", default="0,2048,4096,8192", help="VocabTrim sizes (0 = full head)")
    ap.add_argument("--siblings", type=int, default=4)
    ap.add_argument("--draws", type=int, default=16)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sibling_acceptance.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = speculant.load_pretrained("default-target")
    draft, _ = speculant.load_pretrained("default-draft")
    ranking = load_calibration(draft.name_or_path)["token_ids"]
    prompts = [tok(r["prompt"])["input_ids"] for r in builtin_prompts("code", args.prompts)]
    trims = [int(t) for t in args.trims.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    result = {"benchmark": "sibling_acceptance", "machine": machine_info(), "settings": vars(args) | {"out": str(args.out)},
              "temperatures": {}}
    for temp in [float(t) for t in args.temperatures.split(",")]:
        seqs = _sequences(target, prompts, args.max_new_tokens, temp, args.seed)
        p = torch.cat([(_logits(target, i, n) / temp).softmax(-1) for i, n in seqs])  # [N, V]
        q_logits = torch.cat([_logits(draft, i, n) / temp for i, n in seqs])[:, : p.shape[1]]
        row = {"positions": p.shape[0], "trims": {}}
        for trim in trims:
            logits = q_logits
            if trim:
                mask = torch.full((p.shape[1],), float("-inf"))
                mask[torch.tensor(ranking[:trim])] = 0
                logits = q_logits + mask
            q = logits.softmax(-1)
            alpha = float(torch.minimum(p, q).sum(-1).mean())
            wo = _within(p, q, args.siblings, args.draws, False, gen)
            wr = _within(p, q, args.siblings, args.draws, True, gen)
            trees = best_trees(alpha, wo, args.budget)
            chain = {n: sum(alpha**d for d in range(n + 1)) for n in range(1, args.budget + 1)}
            row["trims"][str(trim)] = {
                "alpha": alpha, "within_without_replacement": wo, "within_with_replacement": wr,
                "expected_tau_best_tree": trees, "expected_tau_chain": chain,
            }
            print(f"T={temp} trim={trim}: alpha={alpha:.3f} w/o={[round(x, 3) for x in wo]} "
                  f"w/={[round(x, 3) for x in wr]} tree/chain@8={trees[8] / chain[8]:.3f} "
                  f"@16={trees[16] / chain[16]:.3f}", flush=True)
        result["temperatures"][str(temp)] = row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
