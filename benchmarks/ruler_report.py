"""Tables from ``speculant kv-eval --task ruler --out DIR`` (DIR/ruler_results.jsonl, one row per finished case).

Writes ``DIR/ruler_table.md``: for each (budget, block, length), the score of every policy on every task as a share
of the full cache's (RULER's score, mean over the samples), the mean share over the tasks every policy finished,
and per policy the peak KV bytes (largest over tasks and samples) and the mean prefill and decode seconds per
sample (– where the rows hold none: times taken beside other work are left out); then the full cache's own
scores. A run still going (or stopped) gives a partial table: a task appears once
its full-cache row exists, a cell once its case is done.

    python benchmarks/ruler_report.py runs/ruler-qwen1.5b-4k
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def _rows(folder: Path) -> list[dict]:
    path = folder / "ruler_results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _seconds(rows: list[dict]) -> str:
    """The mean prefill and decode seconds per sample of ``rows`` as two table cells; "–" where a row's times were
    left out (recorded as null: not taken on a quiet machine)."""
    cells = []
    for name, digits in (("prefill_seconds", 1), ("decode_seconds", 2)):
        values = [r[name] for r in rows]
        cells.append("–" if any(v is None for v in values) else f"{statistics.fmean(values):.{digits}f}")
    return " | ".join(cells)


def tables(rows: list[dict]) -> str:
    full = {(r["task"], r["length"]): r for r in rows if r["policy"] == "full"}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["policy"] != "full":
            groups[(r["budget_spec"], r["block"], r["length"], r["query_aware"])].append(r)
    out = []
    for (spec, block, length, aware), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        tasks = [t for (t, n) in full if n == length]
        policies = list(dict.fromkeys(r["policy"] for r in group))
        cell = {(r["policy"], r["task"]): r for r in group}
        common = [t for t in tasks if all((p, t) in cell for p in policies)]
        mode = "query-aware" if aware else "query-agnostic"
        out.append(f"### {length} tokens, budget {spec} of the prefill, blocks of {block}, {mode}\n")
        out.append("Score as a share of the full cache's on each task; the mean is over the tasks every policy "
                   f"finished ({len(common)} of {len(tasks)}).\n")
        out.append("| policy | " + " | ".join(f"`{t}`" for t in tasks) + " | mean | peak KV MB | prefill s | decode s |")
        out.append("|---|" + "---:|" * (len(tasks) + 4))
        for p in policies:
            shares = []
            cells = []
            for t in tasks:
                r = cell.get((p, t))
                if r is None or r["share_of_full"] is None:
                    cells.append("–" if r is None else f"{r['score']:.0f}/0")
                    continue
                cells.append(f"{r['share_of_full']:.2f}")
                if t in common:
                    shares.append(r["share_of_full"])
            mine = [r for r in group if r["policy"] == p]
            mean = f"{statistics.fmean(shares):.2f}" if shares else "–"
            peak = max(r["peak_kv_bytes"] for r in mine) / 1e6
            out.append(f"| `{p}` | " + " | ".join(cells) + f" | {mean} | {peak:.1f} | {_seconds(mine)} |")
        fr = [full[(t, length)] for t in tasks]
        out.append("| full cache (score, 0-100) | " + " | ".join(f"{r['score']:.0f}" for r in fr)
                   + f" | – | {max(r['peak_kv_bytes'] for r in fr) / 1e6:.1f} | {_seconds(fr)} |")
        samples = sorted({r["samples"] for r in group})
        out.append(f"\nSamples per task: {', '.join(map(str, samples))}; budgets (mean tokens per layer): "
                   + ", ".join(f"`{t}` {statistics.fmean(r['budget'] for r in group if r['task'] == t):.0f}"
                               for t in tasks if any(r["task"] == t for r in group)) + ".\n")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the --out folder of a kv-eval --task ruler run")
    args = parser.parse_args()
    text = tables(_rows(args.folder))
    (args.folder / "ruler_table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
