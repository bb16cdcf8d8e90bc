"""Reports from a ``run_bench`` results dict: results.json, results.md (tables), PNG plots, the README table.

Every figure is read from the results; nothing is typed by hand. Plots need matplotlib (the ``plots`` / ``dev``
extra); without it they are skipped with a one-line notice. The figures are drawn with the Agg canvas directly,
so the process-wide matplotlib backend is left alone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .structured import structured_table

__all__ = ["budget_tables", "category_table", "main_table", "readme_section", "render_markdown",
           "structured_table", "write_plots", "write_results"]

log = logging.getLogger(__name__)

STRUCTURED_NOTE = ("Prompts with a response_format or tools, every method decoding under the constraint. valid: "
                   "the answer parses and matches the schema, or calls an offered tool with arguments that match "
                   "its parameters (in parentheses: runs checked); exact: equal to the reference answer or "
                   "expected call; mask: time building the constraint's token masks, per step and as a share of "
                   "decoding; forced tokens: tokens the constraint allowed alone, as a share of new tokens.")


def _speedup(s: dict) -> str:
    if "speedup_vs_ar" not in s:
        return "–"
    return f"{s['speedup_vs_ar']:.2f}× ({s['speedup_min']:.2f}–{s['speedup_max']:.2f})"


def _identical(s: dict) -> str:
    if "identical_to_ar" not in s:
        return "not checked (sampling)"
    runs = s["runs"]
    same = runs - len(s["mismatches"])
    return f"{same}/{runs}" + ("" if same == runs else " ✗")


def main_table(results: dict) -> str:
    """The Markdown table: method, τ, tokens/s, speed-up vs ar (median, min–max), MBSU, overhead, identical."""
    assisted = any("speedup_vs_hf_assisted" in s for s in results["methods"].values())
    extra_head, extra_rule = (" vs hf-assisted |", "---:|") if assisted else ("", "")
    lines = [
        "| method | τ | tokens/s | speed-up vs ar | MBSU | overhead | identical to ar |" + extra_head,
        "|---|---:|---:|---:|---:|---:|---:|" + extra_rule,
    ]
    for name, s in results["methods"].items():
        extra = ""
        if assisted:
            extra = f" {s['speedup_vs_hf_assisted']:.2f}× |" if "speedup_vs_hf_assisted" in s else " – |"
        lines.append(
            f"| `{name}` | {s['acceptance_length']:.2f} | {s['tokens_per_second']:.1f} | {_speedup(s)} | "
            f"{s['mbsu']:.2f} | {100 * s['overhead_share']:.1f}% | {_identical(s)} |" + extra
        )
    return "\n".join(lines)


def _fmt_list(values: list[float], fmt: str) -> str:
    return "[" + ", ".join(format(v, fmt) for v in values) + "]" if values else "–"


def _details_table(results: dict) -> str:
    lines = [
        "| method | runs on | target calls | γ (draft calls/step) | c | accepted-length histogram "
        + "| per-position acceptance | target / draft / overhead | peak memory (MiB) |",
        "|---|---|---:|---:|---:|---|---|---|---:|",
    ]
    for name, s in results["methods"].items():
        split = (f"{100 * s['target_forward_share']:.0f}% / {100 * s['draft_forward_share']:.0f}% / "
                 f"{100 * s['overhead_share']:.0f}%")
        lines.append(
            f"| `{name}` | {s.get('kind', '')} | {s['target_calls']} | {s.get('draft_calls_per_step', 0):.2f} | "
            f"{s.get('draft_cost_ratio', 0):.3f} | {_fmt_list(s['accepted_hist'], 'd')} | "
            f"{_fmt_list(s.get('position_acceptance', []), '.2f')} | {split} | "
            f"{s.get('peak_memory_bytes', 0) / 2**20:.1f} |"
        )
    return "\n".join(lines)


_AXES = (("budgets", "tree tokens per target call"), ("depths", "draft depth (levels per step)"))


def budget_tables(results: dict) -> str:
    """With ``budget_matched``: per axis (budget, depth), a table of family × size with τ, MBSU and tokens/s."""
    matched = results.get("budget_matched")
    if not matched:
        return ""
    methods, parts = results["methods"], []
    for axis, label in _AXES:
        sizes = list(matched[axis])
        if not sizes:
            continue
        note = "τ / MBSU / tokens/s of each family at each size (– : no configuration of that size)."
        parts += [f"### At equal {label}", "", note, "",
                  "| family | " + " | ".join(sizes) + " |", "|---|" + "---:|" * len(sizes)]
        for family in matched["families"]:
            cells = []
            for size in sizes:
                spec = matched[axis][size].get(family)
                s = methods.get(spec) if spec else None
                cells.append("–" if s is None else
                             f"{s['acceptance_length']:.2f} / {s['mbsu']:.2f} / {s['tokens_per_second']:.1f}")
            parts.append(f"| `{family}` | " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


SPEEDUP_NOTE = (
    "Speed-up vs ar: the median over runs (prompts × repeats) of the per-run ratio of tokens/s (the method's over "
    "`ar`'s on the same prompt and repeat), with the smallest and largest ratio in parentheses."
)
CATEGORY_NOTE = (
    "Each cell: τ (new tokens per target call, pooled over the category's runs) / speed-up over `ar` (the median "
    "over the category's runs of the per-run tokens/s ratio: the statistic of the main table's speed-up column). "
    "The overall row is the main table's."
)


def _cell(s: dict | None) -> str:
    if s is None:
        return "–"
    speedup = f"{s['speedup_vs_ar']:.2f}×" if "speedup_vs_ar" in s else "–"
    return f"{s['acceptance_length']:.2f} / {speedup}"


def category_table(results: dict) -> str:
    """With ``categories`` (prompts that carry one, e.g. MT-Bench): one table in Spec-Bench's layout, a row per
    category and an overall row, a column per method other than the reference, cells τ / speed-up vs ar."""
    categories = results.get("categories")
    if not categories:
        return ""
    reference = results.get("settings", {}).get("reference", "ar")
    names = [n for n in results["methods"] if n != reference]
    if not names:
        return ""
    lines = ["| category | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---:|" * len(names)]
    for category, per_method in categories.items():
        runs = max((s.get("runs", 0) for s in per_method.values()), default=0)
        lines.append(f"| {category} ({runs}) | " + " | ".join(_cell(per_method.get(n)) for n in names) + " |")
    lines.append("| **overall** | " + " | ".join(_cell(results["methods"][n]) for n in names) + " |")
    return "\n".join(lines)


def _mismatch_lines(results: dict) -> list[str]:
    ids = [p.get("id", str(i)) for i, p in enumerate(results.get("prompts", []))]
    out = []
    for name, s in results["methods"].items():
        mism = s.get("mismatches") or []
        if not mism:
            continue
        where = "; ".join(
            f"prompt {m['prompt']} ({ids[m['prompt']] if m['prompt'] < len(ids) else '?'}, repeat {m['repeat']}) "
            f"first differs at token {m['first_diff']}"
            for m in mism
        )
        out.append(f"- `{name}`: {len(mism)} of {s['runs']} runs differ from `ar`: {where}")
    return out


def _settings_line(results: dict) -> str:
    st, mach = results["settings"], results["machine"]
    sampling = "greedy" if st["temperature"] == 0 else (
        f"temperature {st['temperature']}, top-k {st['top_k']}, top-p {st['top_p']}, seed {st['seed']}")
    chats = st.get("chat_prompts") or 0
    chat = f" ({chats} chats, in the target's chat template)" if chats else ""
    return (
        f"{st['num_prompts']} prompts ({st['prompts']}){chat}, {st['max_new_tokens']} new tokens at most, "
        f"{sampling}, "
        f"{st['repeats']} repeat(s) after {st['warmup']} warm-up round(s); target {st['target_dtype']}, "
        f"draft {st['draft_dtype']}; {mach['torch_threads']} torch threads on {mach['machine']} "
        f"({mach['cpu_count']} CPUs), torch {mach['torch']}, transformers {mach['transformers']}, "
        f"speculant {mach['speculant']}"
    )


def profile_table(profile: dict) -> str:
    """``--profile``: one row per target forward (ms per one-token step and its split), then the floor."""
    lines = ["| forward | step ms | matmul | attention | rest | 5-token verify (× step) | × bare matmuls | × floor |",
             "|---|---|---|---|---|---|---|---|"]
    for name, f in profile["forwards"].items():
        lines.append(f"| {name} | {f['step_ms']:.1f} | {f['matmul_ms']:.1f} | {f['attention_ms']:.1f} | "
                     f"{f['other_ms']:.1f} | {f['verify5_ms']:.1f} ({f['verify5_ratio']:.2f}×) | "
                     f"{f['vs_bare_matmul']:.2f} | {f['vs_floor']:.2f} |")
    bare = profile["bare_matmul_ms"]
    kernel = ("packed once for oneDNN, as the lean forward multiplies them" if profile.get("packed")
              else "as `F.linear`")
    lines += ["", f"Bare matmuls (every weight matrix once, {kernel}): {bare['1']:.1f} ms for 1 token, "
              f"{bare['5']:.1f} ms for 5. Weights read per forward: {profile['weight_bytes'] / 1e6:.0f} MB "
              f"({profile['dtype']}); measured read bandwidth {profile['read_bandwidth_gb_s']:.1f} GB/s, so the "
              f"floor is {profile['bandwidth_floor_ms']:.1f} ms per forward ({profile['threads']} threads). The "
              "split is the torch profiler's self-time shares applied to the unprofiled step time."]
    return "\n".join(lines)


def render_markdown(results: dict) -> str:
    """results.md: settings, the main table, a details table, the per-category and budget-matched tables when
    the run has them, every mismatch, and the metric definitions."""
    parts = [
        "# speculant bench",
        "",
        _settings_line(results) + ".",
        "",
        main_table(results),
        "",
        SPEEDUP_NOTE,
        "",
        "## Details",
        "",
        _details_table(results),
        "",
    ]
    categories = category_table(results)
    if categories:
        parts += ["## Per category", "", CATEGORY_NOTE + " In parentheses: runs per method.", "", categories, ""]
    structured = structured_table(results)
    if structured:
        parts += ["## Structured output", "", STRUCTURED_NOTE, "", structured, ""]
    budget = budget_tables(results)
    if budget:
        parts += ["## Budget-matched comparison", "", budget]
    if "profile" in results:
        parts += ["## Profile of the target forward", "", profile_table(results["profile"]), ""]
    mism = _mismatch_lines(results)
    if mism:
        parts += ["## Outputs that differ from `ar`", "", *mism, ""]
    parts += ["## Definitions", ""]
    parts += [f"- **{k}**: {v}" for k, v in results.get("definitions", {}).items()]
    return "\n".join(parts) + "\n"


def readme_section(results: dict, source: str = "") -> str:
    """The README's benchmark block: the main table and one line of settings (and where they come from), then
    the forward profile when the run has one (``--profile``)."""
    origin = f" Source: `{source}`." if source else ""
    profile = f"\n{profile_table(results['profile'])}\n" if "profile" in results else ""
    return f"{main_table(results)}\n\n{_settings_line(results)}.{origin}\n{profile}"


def write_plots(results: dict, out: str | Path) -> list[Path]:
    """speedup.png (per-prompt speed-ups per method, median marked) and accepted_lengths.png (normalised
    accepted-length histograms of the methods that draft), and with a budget-matched run budget.png (τ and MBSU
    of each family against the budget and/or the depth). Returns the files written; [] without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("matplotlib is not installed: plots skipped (pip install 'speculant[plots]')")
        return []
    out = Path(out)
    written = []
    methods = results["methods"]
    names = [n for n, s in methods.items() if "speedup_per_run" in s]
    if names:
        fig = Figure(figsize=(max(4.0, 1.3 * len(names) + 1), 3.6), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for x, name in enumerate(names):
            ratios = methods[name]["speedup_per_run"]
            n = len(ratios)
            xs = [x + 0.25 * ((i + 0.5) / n - 0.5) for i in range(n)]
            colour = {"transformers": "C1", "llama.cpp": "C2"}.get(methods[name].get("kind"), "C0")
            ax.scatter(xs, ratios, s=12, alpha=0.6, color=colour)
            ax.hlines(methods[name]["speedup_vs_ar"], x - 0.3, x + 0.3, color="black", linewidth=2)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel("speed-up vs ar (tokens/s ratio)")
        ax.set_title("per-prompt speed-up (dots), median (bar)")
        path = out / "speedup.png"
        fig.savefig(path, dpi=120)
        written.append(path)
    drafting = [n for n, s in methods.items() if len(s["accepted_hist"]) > 1]
    if drafting:
        fig = Figure(figsize=(6.4, 3.6), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        width = 0.8 / len(drafting)
        for j, name in enumerate(drafting):
            hist = methods[name]["accepted_hist"]
            total = sum(hist) or 1
            ax.bar([m - 0.4 + width * (j + 0.5) for m in range(len(hist))], [h / total for h in hist], width,
                   label=name)
        ax.set_xlabel("draft tokens accepted in a step")
        ax.set_ylabel("fraction of steps")
        ax.set_title("accepted-length histograms")
        ax.legend(fontsize="small")
        path = out / "accepted_lengths.png"
        fig.savefig(path, dpi=120)
        written.append(path)
    matched = results.get("budget_matched")
    axes = [(axis, label) for axis, label in _AXES if matched and matched[axis]]
    if axes:
        fig = Figure(figsize=(5.2 * len(axes), 6.4), layout="constrained")
        FigureCanvasAgg(fig)
        grid = fig.subplots(2, len(axes), squeeze=False)
        for col, (axis, label) in enumerate(axes):
            for i, family in enumerate(matched["families"]):
                pts = [(int(size), methods[spec]) for size, row in matched[axis].items()
                       if (spec := row.get(family)) and spec in methods]
                for row_i, key in enumerate(("acceptance_length", "mbsu")):
                    grid[row_i][col].plot([x for x, _ in pts], [s[key] for _, s in pts], marker="o",
                                          color=f"C{i % 10}", linestyle="-" if i < 10 else "--", label=family)
            for row_i, ylabel in enumerate(("τ (tokens per target call)", "MBSU")):
                ax = grid[row_i][col]
                ax.set_xticks([int(x) for x in matched[axis]])
                ax.set_xlabel(label)
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
        grid[0][-1].legend(fontsize="small")
        path = out / "budget.png"
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


def write_files(results: dict, out: str | Path, render=None, plots=None) -> list[Path]:
    """Write results.json, results.md (``render(results)``) and the plots (``plots(results, out)`` -> paths) into
    ``out`` (created); return the paths written. Every bench writes its report this way."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "results.md"]
    files += (plots or write_plots)(results, out)
    body = {**results, "files": [str(p) for p in files]}
    files[0].write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    files[1].write_text((render or render_markdown)(results), encoding="utf-8")
    return files


def write_results(results: dict, out: str | Path) -> list[Path]:
    """Write results.json, results.md and the plots of ``speculant bench`` into ``out``."""
    return write_files(results, out)
