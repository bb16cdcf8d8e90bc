"""Continuous batching in the engine, without a server: ``--batch`` sequences decoded together, each finished one
replaced by the next request at once (as ``speculant serve --max-batch N`` does under a closed-loop load), speculation
``off`` against ``auto`` (and any other mode), the modes run in turn per repetition after a warm-up. Every mode's
tokens must equal ``off``'s (greedy). Reports output tokens/s over the whole run (prefills included), steps, and for
drafting modes how many requests drafted at all.

    python benchmarks/continuous_batch.py --out benchmarks/results/continuous_batch.json
        [--target qwen2.5-coder-1.5b-instruct] [--method SPEC] [--draft NAME] [--prompts builtin:mt-bench] [--requests 32]
        [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import speculant
from speculant.core.batch import Batch
from speculant.data.prompts import load_prompts


def run(session, prompts, mode: str, batch_size: int, tokens: int, stop) -> dict:
    batch = Batch(session.target, speculation=mode)
    queue, indices, produced = list(prompts), [], 0
    start = time.perf_counter()
    while queue or len(batch):
        while queue and len(batch) < batch_size:
            drafter = session.drafter() if mode != "off" else None
            indices.append(batch.add(queue.pop(0), drafter, tokens, eos_token_id=stop))
        produced += sum(len(e.tokens) for e in batch.step())
    seconds = time.perf_counter() - start
    results = [batch.result(i) for i in indices]
    return {"tokens_per_s": produced / seconds, "seconds": seconds, "tokens": produced, "steps": batch.steps,
            "requests_drafting": sum(r.stats.draft_tokens > 0 for r in results),
            "outputs": [r.token_ids for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--method", default=None, help="the drafting method (default: the target's packaged default)")
    ap.add_argument("--draft", default=None, help="the method's draft model (default: the target's packaged draft)")
    ap.add_argument("--prompts", default="builtin:mt-bench")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="off,auto")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    session = speculant.load(args.target, args.draft, method=args.method, threads=args.threads)
    records = load_prompts(args.prompts)
    prompts = [session.encode(r["messages"][-1]["content"] if "messages" in r else r["prompt"])[0] for r in records]
    stop = session.encode("x")[1]
    modes = args.modes.split(",")
    run(session, prompts[-2:], "auto", 2, 16, stop)  # warm-up
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        chosen = [prompts[(rep * args.requests + i) % len(prompts)] for i in range(args.requests)]
        reference = None
        for mode in modes:
            r = run(session, chosen, mode, args.batch, args.max_new_tokens, stop)
            reference = reference or r["outputs"]
            if r["outputs"] != reference:
                raise SystemExit(f"speculation {mode}: outputs differ from {modes[0]}'s")
            del r["outputs"]
            runs[mode].append(r)
            print(rep, mode, f"{r['tokens_per_s']:.1f} tokens/s, {r['steps']} steps, {r['requests_drafting']} of "
                  f"{args.requests} requests drafted", flush=True)
    median = {m: statistics.median(r["tokens_per_s"] for r in v) for m, v in runs.items()}
    result = {"settings": vars(args), "method": session.method.spec,
              "machine": platform.processor() or platform.machine(), "runs": runs,
              "median_tokens_per_s": median, "over_first_mode": {m: v / median[modes[0]] for m, v in median.items()},
              "outputs_identical": True}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["median_tokens_per_s"]), json.dumps(result["over_first_mode"]))


if __name__ == "__main__":
    main()
