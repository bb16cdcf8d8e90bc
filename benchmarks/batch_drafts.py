"""Draft forwards shared by a batch (speculant.core.draft_batch) against each sequence drafting alone.

Four (``--sequences``) ``builtin:code-chat`` requests decoded together in one :class:`speculant.core.batch.Batch`
on the packaged 1.5B pair (its default weights and method: ``chain:k=3`` when benchmarks/results/batch_drafts.json
was written, ``chain:k=3:stop=0.7`` since), 64 new tokens each, greedy, decoding only (timed from the first step:
every prompt is prefilled when it joins), interleaved per repetition after a warm-up:
speculation off (plain decoding of the four), on with each sequence's draft forwards alone, on with them shared, and
auto with them shared and alone. Every mode's tokens must equal plain decoding's. Also the draft model's forward for
one row, for the sequences' rows in one forward, and for as many forwards of one row. Writes JSON to ``--out``.

    python benchmarks/batch_drafts.py --out benchmarks/results/batch_drafts.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import speculant
from speculant.core.batch import Batch
from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers
from speculant.core.llama_forward import Segment
from speculant.core.target_forward import llama_forward_for
from speculant.data.prompts import load_prompts

MODES = (("off", False), ("on", False), ("on", True), ("auto", True), ("auto", False))


def decode(session, prompts, mode: str, shared: bool, tokens: int) -> tuple[float, list, Batch]:
    batch = Batch(session.target, speculation=mode)
    batch.batch_drafts = shared
    indices = [batch.add(p, session.drafter() if mode != "off" else None, tokens, eos_token_id=[]) for p in prompts]
    start, n = time.perf_counter(), 0
    while len(batch):
        n += sum(len(e.tokens) for e in batch.step())
    return n / (time.perf_counter() - start), [batch.result(i).token_ids for i in indices], batch


def draft_forward_ms(draft, sequences: int, repeats: int = 10) -> dict[str, float]:
    lean = llama_forward_for(draft)
    g = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(sequences):
        cache = SpecCache(num_layers(draft), capacity=512)
        lean.hidden(torch.randint(0, 1000, (1, 200), generator=g), cache)
        caches.append(cache)
    token = torch.tensor([[5]])

    def one():
        lean.hidden(token, caches[0])
        caches[0].crop(200)

    def alone():
        for c in caches:
            lean.hidden(token, c)
            c.crop(200)

    def together():
        lean.hidden_batch([Segment(c, token) for c in caches])
        for c in caches:
            c.crop(200)

    out = {}
    for name, f in (("one_row", one), (f"{sequences}_forwards_of_one_row", alone), (f"{sequences}_rows_shared", together)):
        f()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        out[name] = round(1000 * statistics.median(times), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    session = speculant.load(args.target, threads=args.threads)
    rows = load_prompts("builtin:code-chat", args.sequences)
    prompts = [session.encode(r["messages"][-1]["content"])[0] for r in rows]
    with torch.inference_mode():
        forwards = draft_forward_ms(session.draft, args.sequences)
    decode(session, prompts[:2], "on", True, 16)  # warm-up
    runs: dict[str, list[float]] = {}
    reference = None
    for _ in range(args.repeats):
        for mode, shared in MODES:
            rate, tokens, batch = decode(session, prompts, mode, shared, args.tokens)
            if reference is None:
                reference = tokens
            assert tokens == reference, (mode, shared)  # every mode decodes the same tokens
            key = f"{mode}{'-shared' if shared else ''}"
            runs.setdefault(key, []).append(round(rate, 2))
            print(key, f"{rate:.1f} tokens/s", f"shared forwards {batch.draft_forwards} for {batch.draft_segments}",
                  flush=True)
    result = {"target": args.target, "method": session.method.spec, "sequences": args.sequences,
              "new_tokens": args.tokens, "threads": args.threads, "machine": platform.processor() or platform.machine(),
              "draft_forward_ms": forwards, "tokens_per_s": runs,
              "median_tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
              "identical": True}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["median_tokens_per_s"]), json.dumps(forwards))


if __name__ == "__main__":
    main()
