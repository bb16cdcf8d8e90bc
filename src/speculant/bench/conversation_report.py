"""Tables and Markdown of a conversation or FIM replay (:mod:`speculant.bench.conversations`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["comparison_table", "render_markdown", "turn_table", "write_results"]


def _ms(v) -> str:
    return "–" if v is None else f"{1000 * v:.0f}"


def _num(v) -> str:
    return "–" if v is None else f"{v:.0f}"


def _row(name: str, g: dict) -> str:
    cached = "–" if not g["cached_reported"] else _num(g["cached_tokens"])
    match = "" if g.get("first_line_match") is None else f" {100 * g['first_line_match']:.0f}% |"
    return (f"| {name} | {g['ok']}/{g['requests']} | {_ms(g['ttft_s'])} | {_ms(g['e2e_s'])} | "
            f"{_num(g['prompt_tokens'])} | {cached} | {_num(g['completion_tokens'])} |{match}")


def turn_table(results: dict, label: str) -> str:
    """One server's medians: per turn index, then turn 1 and turns 2+ (conversations), or over every cursor
    position (FIM)."""
    s = results["summary"][label]
    fim = results["mode"] == "fim"
    head = "| " + ("positions" if fim else "turn") + " | ok | TTFT ms | total ms | prompt tokens | cached tokens | " \
        "output tokens |" + (" first line right |" if fim else "")
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if fim else "")]
    if fim:
        rows.append(_row("all", s["all"]))
    else:
        rows += [_row(i, g) for i, g in s["by_turn"].items()]
        rows += [_row("**1**", s["first"]), _row("**2+**", s["later"])]
    return "\n".join(rows)


_COMPARED = (("TTFT ms, turn 1", "first", "ttft_s"), ("TTFT ms, turns 2+", "later", "ttft_s"),
             ("total ms, turn 1", "first", "e2e_s"), ("total ms, turns 2+", "later", "e2e_s"))


def comparison_table(results: dict) -> str:
    """Servers side by side (medians, ms; in brackets the ratio to the first server): TTFT and total of turn 1
    and of turns 2+, cached prompt tokens, and a conversation's wall time; FIM: over every position."""
    labels = [s["label"] for s in results["servers"]]
    summary = results["summary"]
    fim = results["mode"] == "fim"
    compared = ((("TTFT ms", "all", "ttft_s"), ("total ms", "all", "e2e_s")) if fim else _COMPARED)
    rows = ["| median | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]

    def line(name: str, values: list) -> str:
        base = values[0]
        cells = []
        for k, v in enumerate(values):
            ratio = f" ({v / base:.2f}×)" if k and v is not None and base else ""
            cells.append(_ms(v) + ratio)
        return f"| {name} | " + " | ".join(cells) + " |"

    for name, group, key in compared:
        rows.append(line(name, [summary[lb][group][key] for lb in labels]))
    rows.append(line("whole file ms" if fim else "whole conversation ms",
                     [summary[lb]["conversation_wall_s"]["median"] for lb in labels]))
    group = "all" if fim else "later"
    rows.append(f"| cached prompt tokens{'' if fim else ', turns 2+'} | " + " | ".join(
        _num(summary[lb][group]["cached_tokens"]) if summary[lb][group]["cached_reported"] else "–"
        for lb in labels) + " |")
    return "\n".join(rows)


def _settings_line(results: dict) -> str:
    s = results["settings"]
    what = (f"FIM replay of {s['source']} ({results['num_requests']} cursor positions, to /infill)"
            if results["mode"] == "fim" else
            f"{results['num_conversations']} conversations of {s['source']} ({s['concurrency']} at a time)")
    servers = "; ".join(f"{x['label']}: `{x['model']}` at {x['url']}" for x in results["servers"])
    return (f"{what}, greedy, {s['max_tokens']} new tokens at most per answer, {s['warmup']} warm-up request(s) "
            f"per server; {servers}; client {results['client']['platform']}, {results['client'].get('cpu') or 'CPU'} "
            f"({results['client']['cpus']} CPUs)")


def render_markdown(results: dict) -> str:
    """results.md: the comparison (several servers), each server's table, the settings and the failures."""
    title = "FIM replay" if results["mode"] == "fim" else "conversations"
    lines = [f"# speculant bench serve: {title}", ""]
    if len(results["servers"]) > 1:
        lines += [comparison_table(results), ""]
    for server in results["servers"]:
        wall = results["summary"][server["label"]]["conversation_wall_s"]
        lines += [f"## {server['label']}", "", turn_table(results, server["label"]), "",
                  f"{'File' if results['mode'] == 'fim' else 'Conversation'} wall time: median "
                  f"{_ms(wall['median'])} ms, total {wall['total']:.1f} s over {wall['n']}.", ""]
    lines += [_settings_line(results) + ".", "",
              "TTFT: request sent to the first text; total: to the end of the answer; token counts are the "
              "server's (cached: prompt tokens it did not compute again; – where it reports none). Medians over "
              "answered requests."]
    if results.get("live_conversations"):
        lines += ["", f"{len(results['live_conversations'])} conversation(s) had no recorded replies: the first "
                  "server answered them live and its replies were sent to the others."]
    for label, s in results["summary"].items():
        if s["failed"]:
            lines += ["", f"{label}: {s['failed']} failed request(s), e.g. {s['errors'][0]}"]
    return "\n".join(lines) + "\n"


def write_results(results: dict, out: str | Path) -> list[Path]:
    """Write results.json and results.md into ``out`` (created); return the paths written."""
    from .report import write_files

    return write_files(results, out, render_markdown, lambda results, out: [])
