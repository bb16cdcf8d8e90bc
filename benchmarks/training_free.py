"""Training-free drafting on the bundled target alone: prompt lookup vs ESP mask probing at matched cost.

For each prompt set (builtin:code, builtin:grounded) one `speculant bench` run (greedy, methods interleaved per
prompt after a warm-up, outputs checked identical to plain decoding) of prompt lookup and mask-probe
configurations whose target forwards carry about 10, 30 and 60 tokens per call (block complexity: lookup
k + 1; mask-probe (masks + 1) x (1 + tree nodes)). Writes benchmarks/results/training_free/{set}/ (the bench
report), summary.json, and tau_vs_tokens_per_call.png (τ and speed-up against tokens per call).

    python benchmarks/training_free.py [--num-prompts 12] [--max-new-tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from speculant.bench import run_bench

# (spec, tokens per target call)
METHODS = [
    ("lookup:ngram=3:k=9", 10), ("lookup:ngram=3:k=29", 30), ("lookup:ngram=3:k=59", 60),
    ("mask-probe:masks=1:tree=4", 10), ("mask-probe:masks=1:tree=14", 30), ("mask-probe:masks=1:tree=29", 60),
    ("mask-probe:masks=2:tree=2", 9), ("mask-probe:masks=2:tree=3/2", 30), ("mask-probe:masks=2:budget=11", 60),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/training_free"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    summary: dict[str, dict] = {}
    for name in ("code", "grounded"):
        res = run_bench(prompts=f"builtin:{name}", methods=[m for m, _ in METHODS], baselines=[],
                        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, eos_token_id=[],
                        out=args.out / name)
        summary[name] = {
            spec: {"tokens_per_call": bc, "acceptance_length": res["methods"][spec]["acceptance_length"],
                   "speedup_vs_ar": res["methods"][spec]["speedup_vs_ar"],
                   "identical_to_ar": res["methods"][spec]["identical_to_ar"]}
            for spec, bc in METHODS
        }
        best = {fam: max((v["acceptance_length"], s) for s, v in summary[name].items() if s.startswith(fam))
                for fam in ("lookup", "mask-probe")}
        summary[name]["best_tau_ratio_mask_probe_over_lookup"] = best["mask-probe"][0] / best["lookup"][0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                       "machine": res["machine"], "results": summary}, indent=1))
    _plot(summary, args.out / "tau_vs_tokens_per_call.png")
    for name, rows in summary.items():
        print(f"[{name}] mask-probe/lookup best τ ratio: {rows['best_tau_ratio_mask_probe_over_lookup']:.2f}")
        for spec, v in rows.items():
            if isinstance(v, dict):
                print(f"  {spec:<34} BC {v['tokens_per_call']:>2}  τ {v['acceptance_length']:.2f}  "
                      f"speed-up {v['speedup_vs_ar']:.2f}x  identical {v['identical_to_ar']:.0%}")


def _plot(summary: dict, path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    for col, name in enumerate(summary):
        for row, key, label in ((0, "acceptance_length", "τ"), (1, "speedup_vs_ar", "speed-up vs ar")):
            ax = fig.add_subplot(1, 4, 2 * col + row + 1)
            for family in ("lookup", "mask-probe:masks=1", "mask-probe:masks=2"):
                pts = sorted((v["tokens_per_call"], v[key]) for s, v in summary[name].items()
                             if isinstance(v, dict) and s.startswith(family))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=family)
            ax.set_xlabel("tokens per target call")
            ax.set_title(f"builtin:{name}: {label}", fontsize=9)
            if key == "speedup_vs_ar":
                ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    fig.axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
