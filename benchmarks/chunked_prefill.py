"""Chunked prefill in the batch: how long the running streams wait while a long prompt joins them.

``--streams`` sequences decode (greedy, the session's drafter); after ``--warmup`` steps a ``--prompt-tokens`` prompt
joins (Python source's tokens, cut to length) and decodes ``--join-tokens`` tokens. Each ``--chunks`` setting: 0,
the whole prompt prefilled as it joins (as before chunked prefill); N, N prompt tokens per step folded into the
step's forward; Ns, the same in a forward of their own before the step's (``Batch.fold_chunks = False``). Reported
per setting: the running streams' seconds per step from the first warm-up step until the joining sequence's first
token (median, p99, max; the stall is the time from the step before the join to the next one, so a whole prefill
counts as one step), the median step before the join and p99 over it (how much slower the streams got), the joining
sequence's time to first token and prefill seconds; every setting's greedy outputs must be equal. A shared 2-core
machine is noisy: compare the settings of one run (interleaved over ``--repeats``).

    python benchmarks/chunked_prefill.py --out benchmarks/results/chunked-prefill/default_pair.json
        [--target default-target] [--draft default-draft] [--streams 3] [--prompt-tokens 2000]
        [--chunks 0,16,32,64,32s] [--repeats 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time

import speculant
from speculant.core.batch import Batch


def run(session, streams: list[list[int]], long: list[int], setting: str, warmup: int, tokens: int,
        join_tokens: int) -> dict:
    chunk = int(setting.rstrip("s"))
    batch = Batch(session.target, speculation="on", prefill_chunk=chunk)
    batch.fold_chunks = not setting.endswith("s")
    running = [batch.add(p, session.drafter(), tokens, eos_token_id=[]) for p in streams]
    times, joined, first, step_s = [], None, None, []
    last = time.perf_counter()
    while len(batch):
        if len(times) == warmup and joined is None:
            join_start = time.perf_counter()
            joined = batch.add(long, session.drafter(), join_tokens, eos_token_id=[])
        events = batch.step()
        now = time.perf_counter()
        if first is None:
            step_s.append(now - last)  # the streams' step, a whole prefill joining before it included
        last = now
        times.append(now)
        if joined is not None and first is None and any(e.sequence == joined for e in events):
            first = now - join_start
    before = statistics.median(step_s[1:warmup])  # the streams' steps before the join (the first: a cold start)
    step_s.sort()
    median = statistics.median(step_s)
    p99 = step_s[min(len(step_s) - 1, round(0.99 * (len(step_s) - 1)))]
    stats = batch.result(joined).stats
    return {"prefill_chunk": chunk, "folded": batch.fold_chunks, "setting": setting, "steps_measured": len(step_s),
            "step_s_before_join": before, "step_s_median": median, "step_s_p99": p99,
            "step_s_max": step_s[-1], "p99_over_median": p99 / median,
            "p99_over_before_join": p99 / before, "join_ttft_s": first,
            "join_prefill_s": stats.prefill_s,
            "outputs": [batch.result(i).token_ids for i in running] + [batch.result(joined).token_ids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=400, help="new tokens per running stream")
    ap.add_argument("--join-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8, help="steps before the long prompt joins")
    ap.add_argument("--chunks", default="0,16,32,64,32s")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the settings, interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    session = speculant.load(args.target, args.draft, threads=args.threads)
    source = inspect.getsource(json.encoder) + inspect.getsource(argparse)
    ids = session.encode(source)[0]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"the source text has {len(ids)} tokens, fewer than --prompt-tokens")
    long = ids[: args.prompt_tokens]
    streams = [session.encode(text)[0] for text in ("def fibonacci(n):", "class Stack:\n    def push(self, x):",
                                                    "import os\n\ndef walk(path):")][: args.streams]
    run(session, streams[:1], long[:200], "32", 2, 8, 2)  # warm-up
    runs, reference = [], None
    for rep in range(args.repeats):
        for setting in args.chunks.split(","):
            r = run(session, streams, long, setting, args.warmup, args.tokens, args.join_tokens)
            outputs = r.pop("outputs")
            reference = reference or outputs
            r["outputs_equal_to_first"] = outputs == reference
            r["repeat"] = rep
            runs.append(r)
            print(json.dumps(r), flush=True)
    summary = {}
    for r in runs:  # per setting, the median over repeats of each figure
        summary.setdefault(r["setting"], []).append(r)
    keys = ("step_s_before_join", "step_s_median", "step_s_p99", "step_s_max", "p99_over_median",
            "p99_over_before_join", "join_ttft_s", "join_prefill_s")
    summary = {c: {k: statistics.median(x[k] for x in rs) for k in keys} for c, rs in summary.items()}
    for c, v in summary.items():
        print(f"prefill_chunk {c}: step before the join {v['step_s_before_join'] * 1e3:.0f} ms, median "
              f"{v['step_s_median'] * 1e3:.0f} ms, p99 {v['step_s_p99'] * 1e3:.0f} ms ({v['p99_over_median']:.1f}x "
              f"the median, {v['p99_over_before_join']:.1f}x before), join TTFT {v['join_ttft_s']:.2f} s", flush=True)
    result = {"settings": vars(args), "method": session.method.spec,
              "machine": platform.processor() or platform.machine(), "runs": runs, "median_over_repeats": summary,
              "outputs_identical": all(r["outputs_equal_to_first"] for r in runs)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
