"""Tables, Markdown and plots of a ``speculant bench serve`` run (:mod:`speculant.bench.serve_load`)."""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["level_table", "render_markdown", "structured_table", "write_plot", "write_results"]

log = logging.getLogger(__name__)


def _ms(d: dict, key: str) -> str:
    v = d.get(key)
    return "–" if v is None else f"{1000 * v:.0f}"


def _latency(d: dict) -> str:
    """``median (p90 / p99)`` in milliseconds."""
    return f"{_ms(d, 'median')} ({_ms(d, 'p90')} / {_ms(d, 'p99')})"


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def level_table(results: dict) -> str:
    """One Markdown row per concurrency level (and speculation mode, when the run compared them): throughput,
    latencies (ms, median (p90 / p99)), acceptance."""
    modes = any(lv.get("speculation") for lv in results["levels"])
    rows = ["| " + ("speculation | " if modes else "") + "concurrency | requests ok | req/s | output tok/s | TTFT ms | TPOT ms | E2E ms | τ | acceptance rate "
            "| accepted/draft |",
            "|" + ("---|" if modes else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in results["levels"]:
        spec = lv.get("spec") or {}
        rows.append(
            ("| " + str(lv.get("speculation")) + " " if modes else "") + f"| {lv['concurrency']} | {lv['completed']}/{lv['requests']} | {lv['request_throughput']:.2f} | "
            f"{lv['output_tokens_per_s']:.1f} | {_latency(lv['ttft_s'])} | {_latency(lv['tpot_s'])} | "
            f"{_latency(lv['e2e_s'])} | {_fmt(spec.get('tau'), '.2f')} | {_fmt(spec.get('acceptance_rate'), '.3f')} "
            f"| {_fmt(spec.get('accepted_tokens'), '.0f')}/{_fmt(spec.get('draft_tokens'), '.0f')} |")
    return "\n".join(rows)


def structured_table(results: dict) -> str:
    """One Markdown row per level that sent structured requests (``response_format`` or ``tools``): how many
    answers were checked, the share valid and exact, and the end-to-end latency; "" when none did."""
    levels = [lv for lv in results["levels"] if lv.get("structured")]
    if not levels:
        return ""
    modes = any(lv.get("speculation") for lv in levels)
    rows = ["| " + ("speculation | " if modes else "") + "concurrency | checked | valid | exact | E2E ms |",
            "|" + ("---|" if modes else "") + "---:|---:|---:|---:|---:|"]
    for lv in levels:
        st = lv["structured"]
        rows.append(("| " + str(lv.get("speculation")) + " " if modes else "") + f"| {lv['concurrency']} | "
                    f"{st['checked']} | {st['valid_share']:.1%} | {_fmt(st['exact_share'], '.1%')} | "
                    f"{_latency(lv['e2e_s'])} |")
    return "\n".join(rows)


def _settings_line(results: dict) -> str:
    s = results["settings"]
    greedy = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    return (f"{s['requests']} requests per level ({s['prompts']}, {results['num_prompts']} prompts cycled), "
            f"{s['max_tokens']} new tokens at most{' (ignore_eos)' if s['ignore_eos'] else ''}, {greedy}, "
            f"{s['warmup']} warm-up request(s); model `{results['model']}` at {s['url']}; client "
            f"{results['client']['platform']}")


def render_markdown(results: dict) -> str:
    lines = ["# speculant bench serve", "", level_table(results), "", _settings_line(results) + ".", "",
             "TTFT: request sent to the first chunk with text; TPOT: (end - first text) / (tokens - 1) per request; "
             "latencies are median (p90 / p99). τ = generated tokens / target calls and the acceptance rate "
             "(accepted / draft tokens) are the differences of the server's /metrics counters around each level."]
    structured = structured_table(results)
    if structured:
        lines += ["", "## Structured answers", "", structured, "",
                  "valid: the answer parses and matches the request's JSON Schema, or makes at least one tool call "
                  "and every call names an offered tool with arguments that match its parameters; exact: equal to "
                  "the record's reference answer or expected call (of those that have one)."]
    failed = [lv for lv in results["levels"] if lv["failed"]]
    for lv in failed:
        lines += ["", f"concurrency {lv['concurrency']}: {lv['failed']} failed request(s), e.g. {lv['errors'][0]}"]
    return "\n".join(lines) + "\n"


def write_plot(results: dict, out: Path) -> list[Path]:
    """serve.png: throughput and latency against concurrency; [] without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("matplotlib is not installed: plot skipped (pip install 'speculant[plots]')")
        return []
    modes = list(dict.fromkeys(lv.get("speculation") for lv in results["levels"]))
    xs = sorted({lv["concurrency"] for lv in results["levels"]})
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tp, ax_lat = fig.subplots(1, 2)
    styles = ("-", ":", "-.", "--")
    for m, mode in enumerate(modes):  # one set of lines per speculation mode compared (one: the server's)
        levels = [lv for lv in results["levels"] if lv.get("speculation") == mode]
        cs = [lv["concurrency"] for lv in levels]
        tag = "" if mode is None else f" ({mode})"
        ax_tp.plot(cs, [lv["output_tokens_per_s"] for lv in levels], marker="o", linestyle=styles[m % 4],
                   label=f"output tokens/s{tag}")
        for i, (key, label) in enumerate((("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end"))):
            med = [1000 * (lv[key]["median"] or 0) for lv in levels]
            ax_lat.plot(cs, med, marker="o", color=f"C{i}", linestyle=styles[m % 4], label=f"{label} median{tag}")
            if len(modes) == 1:
                p90 = [1000 * (lv[key]["p90"] or 0) for lv in levels]
                ax_lat.plot(cs, p90, linestyle="--", color=f"C{i}", label=f"{label} p90")
    ax_tp.set_xlabel("concurrency")
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_title("throughput")
    ax_tp.legend(fontsize="small")
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("concurrency")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("latency")
    ax_lat.legend(fontsize="small")
    for ax in (ax_tp, ax_lat):
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    path = out / "serve.png"
    fig.savefig(path, dpi=120)
    return [path]


def write_results(results: dict, out: str | Path) -> list[Path]:
    """Write results.json, results.md and serve.png into ``out`` (created); return the paths written."""
    from .report import write_files

    return write_files(results, out, render_markdown, write_plot)
