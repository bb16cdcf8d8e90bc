"""Tables and a plot from ``speculant kv-eval --task niah --out DIR`` (DIR/kv_results.json).

Writes ``DIR/niah_table.md`` (retrieval accuracy per policy and context length, averaged over depths and
needles; the budget; peak KV bytes per context length for the full cache and under the budget) and
``DIR/niah.png`` (accuracy against context length, one line per policy; peak KV against context length).

    python benchmarks/niah_report.py benchmarks/results/niah/kv_results.json

Several runs with the same grid and settings (e.g. a policy added later) merge into the first one's folder:

    python benchmarks/niah_report.py benchmarks/results/niah/kv_results.json benchmarks/results/niah-x/kv_results.json

Their ``full`` (whole-cache) rows must agree (greedy decoding is deterministic); each policy is taken from the
first run that has it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def tables(report: dict) -> str:
    rows = report["results"]
    lengths = sorted({r["context_tokens"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    acc: dict[tuple[str, int], list[float]] = defaultdict(list)
    budget: dict[int, int | None] = {}
    for r in rows:
        acc[(r["policy"], r["context_tokens"])].append(r["retrieval_accuracy"])
        if r["budget"] is not None:
            budget[r["context_tokens"]] = r["budget"]
    head = "| policy | " + " | ".join(f"{n} tokens (budget {budget.get(n, '–')})" for n in lengths) + " | mean |"
    lines = [head, "|---|" + "---:|" * (len(lengths) + 1)]
    for p in policies:
        cells = [sum(acc[(p, n)]) / len(acc[(p, n)]) for n in lengths if acc[(p, n)]]
        mean = sum(cells) / len(cells) if cells else 0.0
        lines.append(f"| `{p}` | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {mean:.2f} |")
    depths = sorted({r["depth"] for r in rows})
    s = report.get("settings", {})
    lines += ["", f"Accuracy = share of answers containing the needle's answer, over {len(depths)} depths "
              f"({', '.join(f'{d:g}' for d in depths)}) × {len(s.get('needles', [])) or '?'} needles per cell; "
              f"budget = {s.get('budget_fraction', '?')} of the context, block {s.get('block', '?')}, "
              f"target {s.get('target', '?')} ({s.get('dtype', '?')}).", "",
              "| context tokens | full-cache peak KV | budgeted peak KV |", "|---:|---:|---:|"]
    for m in report.get("memory", []):
        lines.append(f"| {m['context_tokens']} | {m.get('full_peak_kv_bytes', 0) / 1e6:.1f} MB | "
                     f"{m.get('budget_peak_kv_bytes', 0) / 1e6:.1f} MB |")
    return "\n".join(lines) + "\n\n" + depth_table(rows, lengths, depths, policies)


def depth_table(rows: list[dict], lengths: list[int], depths: list[float], policies: list[str]) -> str:
    """Every cell: accuracy per policy, context length and needle depth (over the needles)."""
    cell: dict[tuple[str, int, float], list[float]] = defaultdict(list)
    for r in rows:
        cell[(r["policy"], r["context_tokens"], r["depth"])].append(r["retrieval_accuracy"])
    cols = [(n, d) for n in lengths for d in depths]
    lines = ["Every cell (accuracy over the needles, per context length and needle depth):", "",
             "| policy | " + " | ".join(f"{n} @ {d:g}" for n, d in cols) + " |", "|---|" + "---:|" * len(cols)]
    for p in policies:
        vals = [cell.get((p, n, d)) for n, d in cols]
        lines.append(f"| `{p}` | " + " | ".join(f"{sum(v) / len(v):.2f}" if v else "–" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = report["results"]
    lengths = sorted({r["context_tokens"] for r in rows})
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax, mem = fig.subplots(1, 2)
    for p in dict.fromkeys(r["policy"] for r in rows):
        ys = []
        for n in lengths:
            cell = [r["retrieval_accuracy"] for r in rows if r["policy"] == p and r["context_tokens"] == n]
            ys.append(sum(cell) / len(cell))
        ax.plot(lengths, ys, marker="o", label=p, linestyle="--" if p == "full" else "-")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("retrieval accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("needle in a haystack")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    memory = report.get("memory", [])
    mem.plot([m["context_tokens"] for m in memory], [m.get("full_peak_kv_bytes", 0) / 1e6 for m in memory],
             marker="o", label="full cache")
    mem.plot([m["context_tokens"] for m in memory], [m.get("budget_peak_kv_bytes", 0) / 1e6 for m in memory],
             marker="o", label="budget")
    mem.set_xlabel("context tokens")
    mem.set_ylabel("peak KV (MB)")
    mem.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    return True


def merge(reports: list[dict]) -> dict:
    """One report from runs of the same grid: the first run's settings and memory, every policy once."""
    first = reports[0]
    rows = list(first["results"])
    have = {r["policy"] for r in rows}
    full = {(r["context_tokens"], r["depth"]): r["answers"] for r in rows if r["policy"] == "full"}
    for other in reports[1:]:
        for key in ("target", "dtype", "lengths", "depths", "needles", "budgets", "budget_fraction", "block"):
            if first.get("settings", {}).get(key) != other.get("settings", {}).get(key):
                raise SystemExit(f"runs differ in their setting {key!r}: they cannot share a table")
        for r in other["results"]:
            if r["policy"] == "full":
                if full.get((r["context_tokens"], r["depth"]), r["answers"]) != r["answers"]:
                    raise SystemExit(f"runs differ: the full cache answered differently at {r['context_tokens']} "
                                     f"tokens, depth {r['depth']}")
            elif r["policy"] not in have:
                rows.append(r)
        have |= {r["policy"] for r in other["results"]}
    return {**first, "results": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="kv_results.json of one or more --task niah runs (same grid)")
    args = ap.parse_args()
    path = Path(args.results[0])
    report = merge([json.loads(Path(p).read_text()) for p in args.results])
    table = path.parent / "niah_table.md"
    table.write_text(tables(report))
    print(table.read_text())
    if plot(report, path.parent / "niah.png"):
        print("wrote", path.parent / "niah.png")


if __name__ == "__main__":
    main()
