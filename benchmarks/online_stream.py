"""Online speculative decoding on a stream of requests from a domain the drafter was not trained on.

Two sessions of the same target and shipped drafter decode the same stream of requests, request by request
interleaved, greedy: one as shipped, one adapting its drafter online (:class:`speculant.online.OnlineAdapter`:
an update every ``--online-every`` requests, run between requests and timed apart from them). Per request: τ (new
tokens per target forward), tokens/s, latency; per window of ``--window`` requests: medians and τ's mean, for both.
Every output of the adapting session is checked equal to the shipped one's (greedy: both equal plain decoding).

The default stream: ``builtin:code-chat-train`` (Python code requests made from the standard library's training
modules) for ``smollm2-135m-instruct``, whose shipped drafter was distilled on general English instructions only.

    python benchmarks/online_stream.py [--requests 200] [--window 50] [--online-every 16]
        [--target smollm2-135m-instruct] [--prompts builtin:code-chat-train] [--topic REGEX] [--max-new-tokens 128]
        [--out benchmarks/results/online-stream]

Writes ``online_stream.json`` (settings, machine, per request, per window, the update history), ``README.md`` and
``tau.png`` (τ over the stream, both sessions) into ``--out``. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from pathlib import Path

import torch

import speculant
from speculant.bench.speed import machine_info
from speculant.data.prompts import builtin_prompts, prompt_ids
from speculant.online.traffic import SCORINGS
from speculant.online import OnlineAdapter, OnlineConfig


def _p90(values) -> float:
    """The 90th percentile (nearest rank below)."""
    v = sorted(values)
    return v[int(0.9 * (len(v) - 1))]


def window_tau(rows: list[dict], size: int) -> list[dict]:
    """Per whole window of ``size`` requests: its ``requests`` range, ``tau`` (new tokens over target calls) and,
    where the rows count them, ``draft_tokens_per_step`` (the merged trees' sizes: the rows verification reads)."""
    out = []
    for w in range(0, len(rows) - size + 1, size):
        part = rows[w : w + size]
        calls = sum(r["target_calls"] for r in part)
        window = {"requests": [w, w + size], "tau": sum(r["tokens"] for r in part) / calls}
        if all("draft_tokens" in r for r in part):
            window["draft_tokens_per_step"] = sum(r["draft_tokens"] for r in part) / calls
        out.append(window)
    return out


def _window(rows: list[dict], size: int) -> list[dict]:
    """:func:`window_tau` with each window's median tokens/s and its latencies (median, p90)."""
    out = window_tau(rows, size)
    for window in out:
        part = rows[window["requests"][0] : window["requests"][1]]
        window.update({"tok_s_median": statistics.median(r["tok_s"] for r in part),
                       "latency_p90": _p90(r["latency_s"] for r in part),
                       "latency_median": statistics.median(r["latency_s"] for r in part)})
    return out


def stream_title(args: argparse.Namespace, n: int, what: str = "Online adaptation") -> str:
    """The results README's heading: ``what`` on the held-out stream of ``args``' prompts (and topic), ``n``
    requests."""
    topic = f", topic /{args.topic}/" if args.topic else ""
    return f"# {what} on a held-out stream ({args.prompts}{topic}, {n} requests)"


def stream_prompts(prompts: str, topic: str | None, seed: int, max_prompt_tokens: int, requests: int,
                   tokenizer) -> tuple[list[list[int]], int]:
    """The stream's prompts as token ids, in order (the records of ``prompts`` matching ``topic``, shuffled with
    ``seed``, those longer than ``max_prompt_tokens`` skipped, the first ``requests``) and how many were skipped."""
    records = builtin_prompts(prompts.removeprefix("builtin:"))
    if topic:
        pattern = re.compile(topic, re.IGNORECASE)
        records = [r for r in records if pattern.search(r["messages"][-1]["content"] if "messages" in r else
                                                        r["prompt"])]
    random.Random(seed).shuffle(records)
    kept = [ids for r in records if len(ids := prompt_ids(r, tokenizer)) <= max_prompt_tokens]
    return kept[:requests], len(records) - len(kept)


def stream_arguments(ap: argparse.ArgumentParser) -> None:
    """The stream's and the online adapter's options (this script's and ``online_replay.py``'s)."""
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--method", default=None, help="default: the target's packaged default")
    ap.add_argument("--prompts", default="builtin:code-chat-train")
    ap.add_argument("--topic", default=None, metavar="REGEX",
                    help="keep the requests whose last user message matches REGEX (case-insensitive): one topic")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024,
                    help="skip requests whose prompt is longer (ShareGPT holds prompts of 30k tokens)")
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--online-every", type=int, default=16)
    ap.add_argument("--steps", type=int, default=OnlineConfig.steps)
    ap.add_argument("--lr", type=float, default=OnlineConfig.lr)
    ap.add_argument("--loss", default=OnlineConfig.loss)
    ap.add_argument("--positions", default=OnlineConfig.positions)
    ap.add_argument("--prompt-weight", type=float, default=OnlineConfig.prompt_weight,
                    help="also train on each request's prompt text (next-token loss) with this weight; 0: off")
    ap.add_argument("--min-held", type=int, default=OnlineConfig.min_held,
                    help="held-back requests (one in 5) before an update is checked on them")
    ap.add_argument("--min-z", type=float, default=OnlineConfig.min_z,
                    help="McNemar's z an update's held-back agreement gain must reach (0: did not drop)")
    ap.add_argument("--traffic", type=int, default=OnlineConfig.traffic, metavar="N",
                    help="also draft up to N tokens per step from the traffic memory (earlier requests' tokens, "
                         "speculant.online.traffic); 0: none")
    ap.add_argument("--traffic-min-ngram", type=int, default=OnlineConfig.traffic_min_ngram, metavar="N",
                    help="the memory's shortest context n-gram (1-3): 2 no longer drafts from a one-token match")
    ap.add_argument("--traffic-scoring", choices=SCORINGS, default=OnlineConfig.traffic_scoring,
                    help="recent: copy what followed the context's latest occurrence; frequent: what most often did")
    ap.add_argument("--traffic-min-score", type=float, default=OnlineConfig.traffic_min_score,
                    help="frequent scoring: end the memory's chain where its estimated chance falls below this")
    ap.add_argument("--traffic-tree", type=int, default=OnlineConfig.traffic_tree, metavar="N",
                    help="frequent scoring: draft the memory's tree of up to N nodes instead of one chain; 0: chain")
    ap.add_argument("--no-distill", action="store_true",
                    help="the traffic memory only (--traffic N): no draft model trained, any --method")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)


def online_config(args: argparse.Namespace) -> OnlineConfig:
    """The adapter's settings from :func:`stream_arguments`' options."""
    return OnlineConfig(update_every=args.online_every, steps=args.steps, lr=args.lr, loss=args.loss,
                        positions=args.positions, prompt_weight=args.prompt_weight, min_held=args.min_held,
                        min_z=args.min_z,
                        traffic=args.traffic, traffic_min_ngram=args.traffic_min_ngram,
                        traffic_scoring=args.traffic_scoring, traffic_min_score=args.traffic_min_score,
                        traffic_tree=getattr(args, "traffic_tree", 0), distill=not args.no_distill, seed=args.seed)


def online_settings(args: argparse.Namespace) -> str:
    """The adapter's settings in words (the results' README)."""
    prompt = f", prompt text at weight {args.prompt_weight}" if getattr(args, "prompt_weight", 0) else ""
    return (("no distillation" if args.no_distill else
             f"an update every {args.online_every} requests ({args.steps} steps, lr {args.lr}, {args.loss} at "
             f"{args.positions} positions{prompt}), run between requests")
            + (f"; traffic memory: up to {args.traffic} tokens per step from earlier requests (context n-grams >= "
               f"{args.traffic_min_ngram}, {_scoring(args)})" if args.traffic else ""))


def _scoring(args: argparse.Namespace) -> str:
    """The memory's scoring in words (a results file that records no scoring ran "recent", the memory's first scoring)."""
    scoring = getattr(args, "traffic_scoring", "recent")
    bound = getattr(args, "traffic_min_score", 0.0)
    if scoring != "frequent":
        return f"{scoring} scoring"
    tree = getattr(args, "traffic_tree", 0)
    shape = f"a tree of up to {tree} nodes" if tree else "chains"
    return f"frequent scoring, {shape} " + (f"down to an estimated chance of {bound}" if bound else "with no bound")


def run_update(adapter: OnlineAdapter, updates: list[dict]) -> None:
    """Run the adapter's due update (between requests), keep its history entry in ``updates`` and print it."""
    u = adapter.update()
    updates.append(u)
    print(f"  update {'accepted' if u['accepted'] else 'rolled back'}: agreement {u['agreement_before']:.3f}"
          f" -> {u['agreement_after']:.3f} on {u['held_requests']} held-back requests, gained {u['gained']}"
          f" lost {u['lost']} (z {u['z']:.2f})", flush=True)


def progress(i: int, n: int, rows: dict[str, list[dict]], version: int) -> None:
    """Print request ``i``'s τ in both sessions."""
    print(f"[{i + 1}/{n}] tau shipped {rows['shipped'][-1]['tau']:.2f} online {rows['online'][-1]['tau']:.2f} "
          f"(drafter version {version})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_arguments(ap)
    ap.add_argument("--out", default="benchmarks/results/online-stream")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shipped = speculant.load(args.target, method=args.method, threads=args.threads)
    adapting = speculant.load(args.target, method=args.method, threads=args.threads)
    prompts, skipped = stream_prompts(args.prompts, args.topic, args.seed, args.max_prompt_tokens, args.requests,
                                      shipped.tokenizer)
    adapter = OnlineAdapter(adapting, online_config(args))
    warm = prompt_ids(builtin_prompts("mt-bench", 1)[0], shipped.tokenizer)
    for s in (shipped, adapting):  # warm-up (not in the stream)
        s.generate(warm, max_new_tokens=16)
    rows: dict[str, list[dict]] = {"shipped": [], "online": []}
    updates = []
    for i, ids in enumerate(prompts):
        outputs = {}
        for name in ("shipped", "online") if i % 2 == 0 else ("online", "shipped"):  # interleaved, order alternating
            start = time.perf_counter()
            if name == "shipped":
                g = shipped.generate(ids, max_new_tokens=args.max_new_tokens)
            else:
                drafter = adapter.drafter()
                g = adapting.generate(ids, max_new_tokens=args.max_new_tokens, drafter=drafter)
            latency = time.perf_counter() - start
            outputs[name] = g.token_ids
            st = g.stats
            rows[name].append({"request": i, "tokens": st.new_tokens, "target_calls": st.target_calls,
                               "tau": st.new_tokens / max(1, st.target_calls), "latency_s": latency,
                               "tok_s": st.new_tokens / latency, "version": adapter.version if name == "online"
                               else 0})
            if name == "shipped":  # greedy: plain decoding's answer, for replays (benchmarks/traffic_replay.py)
                rows[name][-1]["token_ids"] = g.token_ids
            if name == "online":
                adapter.observe(drafter)
        if outputs["online"] != outputs["shipped"]:
            raise SystemExit(f"request {i}: the adapting session's output differs from the shipped one's")
        if adapter.due():  # between requests, outside their timings
            run_update(adapter, updates)
        progress(i, len(prompts), rows, adapter.version)
    windows = {name: _window(r, args.window) for name, r in rows.items()}
    first, last = windows["online"][0]["tau"], windows["online"][-1]["tau"]
    p90 = {name: _p90(r["latency_s"] for r in rs) for name, rs in rows.items()}
    result = {"settings": vars(args), "machine": machine_info(), "method": shipped.method.spec,
              "windows": windows, "online_last_over_first_tau": last / first,
              "shipped_last_over_first_tau": windows["shipped"][-1]["tau"] / windows["shipped"][0]["tau"],
              "online_last_over_shipped_last_tau": last / windows["shipped"][-1]["tau"],
              "latency_p90_s": p90, "latency_p90_online_over_shipped": p90["online"] / p90["shipped"],
              "update_seconds_total": sum(u["seconds"] for u in updates), "updates": updates,
              "requests": rows, "outputs_identical": True, "skipped_long_prompts": skipped}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "online_stream.json").write_text(json.dumps(result, indent=1))
    _plot(rows, windows, args.window, out / "tau.png")
    lines = [stream_title(args, len(prompts)), "",
             f"Target {args.target}, method `{shipped.method.spec}` with its shipped drafter, greedy, "
             f"{args.max_new_tokens} new tokens, {args.threads} threads; online: {online_settings(args)}. Every "
             "output identical between the two sessions.", "",
             "| window | τ shipped | τ online | tok/s shipped (median) | tok/s online (median) | p90 latency shipped | "
             "p90 latency online |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(windows["shipped"], windows["online"]):
        lines.append(f"| {a['requests'][0]}-{a['requests'][1] - 1} | {a['tau']:.2f} | {b['tau']:.2f} | "
                     f"{a['tok_s_median']:.1f} | {b['tok_s_median']:.1f} | {a['latency_p90']:.2f} s | "
                     f"{b['latency_p90']:.2f} s |")
    accepted = sum(u["accepted"] for u in updates)
    lines += ["", f"τ of the last window over the first (online): **{last / first:.2f}x** (shipped: "
              f"{result['shipped_last_over_first_tau']:.2f}x); last window online over shipped: "
              f"{result['online_last_over_shipped_last_tau']:.2f}x.",
              f"Latency p90 over the stream: online {p90['online']:.2f} s, shipped {p90['shipped']:.2f} s "
              f"({p90['online'] / p90['shipped']:.2f}x).",
              f"Updates: {len(updates)} ({accepted} accepted), {result['update_seconds_total']:.1f} s in all "
              f"(between requests).", "", "![tau](tau.png)", ""]
    (out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _plot(rows: dict, windows: dict, size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, colour in (("shipped", "tab:gray"), ("online", "tab:blue")):
        taus = [r["tau"] for r in rows[name]]
        k = 10
        rolling = [sum(taus[max(0, i - k + 1) : i + 1]) / len(taus[max(0, i - k + 1) : i + 1]) for i in range(len(taus))]
        ax.plot(range(len(taus)), rolling, color=colour, label=f"{name} (mean of the last {k})")
        for w in windows[name]:
            ax.hlines(w["tau"], w["requests"][0], w["requests"][1] - 1, colors=colour, linestyles="dashed")
    ax.set_xlabel("request")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title(f"Online adaptation: τ over the stream (dashed: windows of {size})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
