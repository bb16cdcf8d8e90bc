"""Token trees at a matched budget on the bundled pair: τ, MBSU and wall clock of chains, SpecInfer, SpecTr and RSD.

For each budget B (tree tokens per target call, default 8 and 16) every method drafts at most B nodes: the chain
(k = B), SpecInfer and SpecTr (W i.i.d. sequences of B/W), RSD-C (several branching vectors with exactly B nodes) and RSD-S
(width W, depth B/W). Sampling at each temperature (default 1.0 and 0.6), every method interleaved per prompt
with plain decoding (``ar``, the speed reference) after a warm-up; held-out ``code`` prompts. Equal draft depth is
the other axis of ALGORITHMS.md's comparison: every row records its depth (draft forwards per step), its node
count and its measured γ, so both views come from the same JSON. Then greedy: the dynamic ``tree`` drafter
against ``chain:k=4`` (outputs checked identical to ``ar``).

Writes the JSON (machine info, settings, per-method summaries with nodes, depth, c, γ and MBSU, raw runs) and a
PNG of τ and MBSU against the budget.

    python benchmarks/tree_budget.py [--threads 2] [--prompts 16] [--max-new-tokens 128] [--budgets 8,16]
        [--temperatures 1.0,0.6] [--out benchmarks/results/tree_budget.json] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import speculant
from speculant.bench.matched_specs import at_budget, shape
from speculant.bench.cost import drafter_params_per_forward, mbsu, params_per_forward
from speculant.data.prompts import builtin_prompts
from speculant.bench.speed import MethodRun, machine_info, run_side_by_side, summarise
from speculant.drafters.registry import build_drafter
from speculant.models.loading import tokenizers_match


def _late(b: int) -> str:
    """A chain with two siblings at its last level: b - 2 single children, then 2 (b nodes, depth b - 1)."""
    return f"rsd-c:branching={'/'.join(['1'] * (b - 2) + ['2'])}"


# label -> family (speculant.bench.matched_specs sizes it to each budget) or a function of the budget. The
# two-level RSD-C shapes (4/1, 2/3, 4/3) and the width-4 trees at budget 8 (depth 2) were measured before: far behind.
FAMILIES = {
    "chain": "chain",
    "specinfer W=2": "specinfer:width=2",
    "specinfer W=4": lambda b: at_budget("specinfer:width=4", b) if b >= 16 else None,
    "spectr W=2": "spectr:width=2",
    "spectr W=4": lambda b: at_budget("spectr:width=4", b) if b >= 16 else None,
    "rsd-c 2/1/…/1": "rsd-c:branching=2",
    "rsd-c 4/1/…/1": "rsd-c:branching=4",
    "rsd-c 1/…/1/2": _late,
    "rsd-s W=2": "rsd-s:width=2",
    "rsd-s W=4": lambda b: at_budget("rsd-s:width=4", b) if b >= 16 else None,
}


def _sized(family, b: int) -> str | None:
    return family(b) if callable(family) else at_budget(family, b)


def _run(target, draft, match, specs, prompts, args, temperature, seed):
    """Side-by-side run of ``ar`` + ``specs``; summaries with cost figures (c, γ, MBSU) and shapes."""
    made = {}

    def maker(spec):
        def make():
            made[spec] = build_drafter(spec, draft, tokenizers_match=match)
            return made[spec]
        return make

    methods = [MethodRun("ar", lambda: None)] + [MethodRun(s, maker(s)) for s in specs]
    rows = run_side_by_side(target, methods, prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                            warmup=args.warmup, rotate=True, temperature=temperature, seed=seed,
                            eos_token_id=[], progress=not args.quiet)
    summary = summarise(rows, check_identical=temperature == 0)
    target_ppf = params_per_forward(target)
    for spec in specs:
        s = summary[spec]
        c = drafter_params_per_forward(made[spec], target) / target_ppf
        gamma = s["draft_calls"] / s["target_calls"]
        nodes, depth = shape(spec)
        s.update(nodes=nodes, depth=depth, draft_cost_ratio=c, draft_calls_per_step=gamma,
                 mbsu=mbsu(s["acceptance_length"], c, gamma))
    return summary, rows


def _plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    temps = list(result["sampling"])
    fig = Figure(figsize=(5.2 * len(temps) + 1.6, 7.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(temps), squeeze=False)
    budgets = result["settings"]["budgets"]
    for col, temp in enumerate(temps):
        summary = result["sampling"][temp]["summary"]
        for i, (family, specs) in enumerate(result["settings"]["families"].items()):
            pts = [(b, summary[s]) for b, s in zip(budgets, specs) if s is not None]
            style = {"marker": "osD^v<>ph*"[i % 10], "color": f"C{i % 10}", "linestyle": "-" if i < 10 else "--",
                     "label": family, "fillstyle": "none" if i % 2 else "full"}  # overlapping points stay visible
            for row, key in enumerate(("acceptance_length", "mbsu")):
                axes[row][col].plot([b for b, _ in pts], [s[key] for _, s in pts], **style)
        for row, label in enumerate(("τ (tokens per target call)", "MBSU")):
            ax = axes[row][col]
            ax.set_xticks(budgets)
            ax.set_xlabel("tree tokens per target call (budget)")
            ax.set_ylabel(label)
            ax.set_title(f"temperature {temp}")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside right center")
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="8,16", help="tree tokens per target call, comma-separated")
    ap.add_argument("--temperatures", default="1.0,0.6")
    ap.add_argument("--greedy", default="chain:k=4,tree:budget=8:topk=2:depth=5,tree:budget=12:topk=2:depth=8,"
                    "tree:budget=12:topk=2:depth=8:calibrate=0,tree:budget=16:topk=4:depth=5",
                    help="methods compared at temperature 0 (empty: skip)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tree_budget.json"))
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from an existing --out JSON, run nothing")
    args = ap.parse_args()
    if args.plot_only:
        if not args.out.exists():
            ap.error(f"--plot-only: {args.out} does not exist")
        _plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')}")
        return
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    greedy = [s for s in args.greedy.split(",") if s]

    target, tok = speculant.load_pretrained(args.target)
    draft, draft_tok = speculant.load_pretrained(args.draft)
    match = tokenizers_match(tok, draft_tok)
    records = builtin_prompts("code", args.prompts)
    prompts = [tok(r["prompt"])["input_ids"] for r in records]
    families = {name: [_sized(f, b) for b in budgets] for name, f in FAMILIES.items()}
    specs = [s for b_specs in zip(*families.values()) for s in b_specs if s is not None]
    for name, fam in families.items():
        for b, s in zip(budgets, fam):
            assert s is None or shape(s)[0] == b, (name, b, s)

    result = {
        "benchmark": "tree_budget",
        "machine": machine_info(),
        "settings": {"target": args.target, "draft": args.draft, "target_dtype": str(target.dtype),
                     "draft_dtype": str(draft.dtype), "tokenizers_match": match, "prompts": "builtin:code",
                     "prompt_ids": [r["id"] for r in records], "max_new_tokens": args.max_new_tokens,
                     "budgets": budgets, "temperatures": temperatures, "families": families, "greedy": greedy,
                     "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed, "threads": args.threads,
                     "eos_token_id": [], "target_params_per_forward": params_per_forward(target)},
        "sampling": {},
    }
    for temp in temperatures:
        summary, rows = _run(target, draft, match, specs, prompts, args, temp, args.seed)
        result["sampling"][str(temp)] = {"summary": summary, "runs": rows}
        print(f"temperature {temp}")
        _print(summary)
    if greedy:
        summary, rows = _run(target, draft, match, greedy, prompts, args, 0.0, None)
        result["greedy"] = {"summary": summary, "runs": rows}
        print("temperature 0 (greedy)")
        _print(summary)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    png = args.out.with_suffix(".png")
    _plot(result, png)
    print(f"wrote {args.out} and {png}")


def _print(summary: dict) -> None:
    for name, s in summary.items():
        extra = "" if name == "ar" else (f" nodes={s['nodes']:<3} depth={s['depth']:<2} "
                                         f"γ={s['draft_calls_per_step']:.2f} c={s['draft_cost_ratio']:.3f} "
                                         f"MBSU={s['mbsu']:.2f}")
        same = "" if "identical_to_ar" not in s else f" identical={s['identical_to_ar']:.0%}"
        print(f"  {name:<36} τ={s['acceptance_length']:.2f} tok/s={s['tokens_per_second']:.1f} "
              f"speedup={s.get('speedup_vs_ar', 1):.2f}x{extra}{same}")


if __name__ == "__main__":
    main()
