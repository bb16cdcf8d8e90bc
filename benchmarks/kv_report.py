"""Tables and plots from a `speculant kv-eval` results file (nothing typed by hand).

Writes, next to the results file: kv_table.md (every policy x budget: top-1 agreement, KL, NLL ratio, retrieval,
the mean over the texts with standard errors over the scored positions; per-text top-1 agreement and KL
at the budget nearest 25% of the sequence; the comparisons at that budget, with the number of texts on
which each holds), fidelity_vs_budget.png (top-1 agreement and KL against the budget, one line per policy) and
memory_vs_prompt.png (peak KV bytes of the full and the budgeted cache against the prompt length).

    python benchmarks/kv_report.py [benchmarks/results/kv/kv_results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The questions: does KeyDiff beat these, and does CAOTE improve the attention-based policy it wraps?
KEYDIFF_RIVALS = ("streaming", "h2o", "tova")
ATTENTION_BASES = ("h2o", "h2o-acc", "tova", "snapkv", "snapkv:passes=2")


def _short(name: str) -> str:
    """A text's name as shown: the file name of a path (runs before file names were recorded kept the path)."""
    return Path(name).name


def _compare(a: dict, b: dict, key: str, higher_is_better: bool) -> str:
    """``a`` vs ``b`` on ``key``: the difference of the means and on how many texts ``a`` is better."""
    sign = 1 if higher_is_better else -1
    files_b = {f["name"]: f[key] for f in b["per_file"]}
    wins = sum(sign * (f[key] - files_b[f["name"]]) > 0 for f in a["per_file"])
    return f"{a[key] - b[key]:+.3f} ({wins}/{len(a['per_file'])} texts better)"


def comparison_lines(rows: list[dict], budget: int) -> list[str]:
    at = {r["policy"]: r for r in rows if r["budget"] == budget}
    out = [f"### Comparisons at budget {budget}", "",
           ("Differences of the means (top-1 agreement: higher is better; KL: lower is better, so a negative "
            "difference is an improvement) and the number of texts on which the first policy is strictly better."), "",
           "| comparison | Δ top-1 agreement | Δ KL | Δ retrieval accuracy |", "|---|---|---|---|"]
    pairs = [("keydiff", rival) for rival in KEYDIFF_RIVALS]
    pairs += [(f"{w}:{base}", base) for base in ATTENTION_BASES for w in ("caote", "fastcaote")]
    for a, b in pairs:
        if a in at and b in at:
            ra, rb = at[a], at[b]
            d_ret = ra["retrieval_accuracy"] - rb["retrieval_accuracy"]
            out.append(f"| `{a}` vs `{b}` | {_compare(ra, rb, 'top1_agreement', True)} | "
                       f"{_compare(ra, rb, 'kl', False)} | {d_ret:+.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default="benchmarks/results/kv/kv_results.json",
                    help="a kv-eval results file (kv_results.json); the tables and plots go beside it")
    path = Path(ap.parse_args().results)
    res = json.loads(path.read_text())
    rows = res["results"]
    s = res["settings"]
    r0 = rows[0]
    lines = ["| policy | budget | top-1 agreement | ± se | KL | ± se | NLL ratio | retrieval accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["budget"], r["policy"])):
        lines.append(f"| `{r['policy']}` | {r['budget']} | {r['top1_agreement']:.3f} | {r['top1_agreement_se']:.3f} | "
                     f"{r['kl']:.4f} | {r['kl_se']:.4f} | {r['nll_ratio']:.3f} | {r['retrieval_accuracy']:.2f} |")
    names = ", ".join(f"`{_short(f['name'])}`" for f in r0["per_file"])
    lines += ["", (f"Mean over {r0['files']} texts ({names}), each cut to its first {r0['sequence_tokens']} "
                   f"tokens, the last {s['tail']} of each scored ({r0['positions']} positions in all; teacher-forced, "
                   f"block-wise prefill with block {s['block']}, then token-by-token decoding with eviction); "
                   "standard errors over the scored positions, taken as independent. "
                   f"Retrieval: {s['retrieval_examples']} `{s['retrieval_format']}` prompts of "
                   f"{r0['retrieval_prompt_tokens']} tokens ({s['retrieval_pairs']} dict entries) under budgets "
                   f"{sorted({r['retrieval_budget'] for r in rows})}; full-cache retrieval accuracy "
                   f"{r0['full_retrieval_accuracy']:.2f} (answer NLL {r0['full_retrieval_answer_nll']:.2f}). "
                   f"Target {s['target']}. Source: `{path.as_posix()}`.")]

    budgets = sorted({r["budget"] for r in rows})
    quarter = min(budgets, key=lambda b: abs(b - 0.25 * r0["sequence_tokens"]))
    at = sorted((r for r in rows if r["budget"] == quarter), key=lambda r: r["policy"])
    lines += ["", f"### Per text at budget {quarter} (top-1 agreement / KL)", "",
              "| policy | " + " | ".join(f"`{_short(f['name'])}`" for f in r0["per_file"]) + " |",
              "|---|" + "---:|" * len(r0["per_file"])]
    for r in at:
        lines.append(f"| `{r['policy']}` | " + " | ".join(f"{f['top1_agreement']:.3f} / {f['kl']:.3f}"
                                                       for f in r["per_file"]) + " |")
    lines += ["", *comparison_lines(rows, quarter)]
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
        ax.set_title(f"{label}, mean over {r0['files']} texts", fontsize=9)
    fig.axes[1].set_yscale("log")
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
