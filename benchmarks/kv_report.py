"""Tables and plots from a `speculant kv-eval` results file (nothing typed by hand).

Writes, next to the results file: kv_table.md (every policy x budget: top-1 agreement, KL, NLL ratio, retrieval),
fidelity_vs_budget.png (top-1 agreement and KL against the budget, one line per policy) and
memory_vs_prompt.png (peak KV bytes of the full and the budgeted cache against the prompt length).

    python benchmarks/kv_report.py [benchmarks/results/kv/kv_results.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/kv/kv_results.json")
    res = json.loads(path.read_text())
    rows = res["results"]
    lines = ["| policy | budget | top-1 agreement | KL | NLL ratio | retrieval accuracy |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["budget"], r["policy"])):
        lines.append(f"| `{r['policy']}` | {r['budget']} | {r['top1_agreement']:.3f} | {r['kl']:.4f} | "
                     f"{r['nll_ratio']:.3f} | {r['retrieval_accuracy']:.2f} |")
    s = res["settings"]
    lines += ["", f"{rows[0]['sequence_tokens']}-token held-out sequence, {rows[0]['positions']} scored positions "
              f"(teacher-forced, block {s['block']}); target {s['target']}. Source: `{path.as_posix()}`."]
    (path.parent / "kv_table.md").write_text("\n".join(lines) + "\n")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    policies = sorted({r["policy"] for r in rows})
    for col, (key, label) in enumerate((("top1_agreement", "top-1 agreement with the full cache"),
                                        ("kl", "mean next-token KL to the full cache"))):
        ax = fig.add_subplot(1, 2, col + 1)
        for i, pol in enumerate(policies):
            pts = sorted((r["budget"], r[key]) for r in rows if r["policy"] == pol)
            style = "--" if pol.startswith(("caote", "fastcaote")) else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=pol, color=f"C{i % 10}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per layer)")
        ax.set_title(label, fontsize=9)
    fig.axes[0].legend(fontsize=6, ncol=2)
    fig.savefig(path.parent / "fidelity_vs_budget.png", dpi=110)

    mem = sorted(res["memory"], key=lambda m: m["prompt_tokens"])
    fig = Figure(figsize=(5, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = [m["prompt_tokens"] for m in mem]
    ax.plot(xs, [m["full_peak_kv_bytes"] / 2**20 for m in mem], marker="o", label="full cache")
    ax.plot(xs, [m["budget_peak_kv_bytes"] / 2**20 for m in mem], marker="o",
            label=f"{mem[0]['policy']}, budget {mem[0]['budget']} + block {mem[0]['block']}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak KV cache (MiB)")
    ax.legend(fontsize=8)
    fig.savefig(path.parent / "memory_vs_prompt.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
