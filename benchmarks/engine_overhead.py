"""Engine overhead benchmark: τ and the share of decoding time spent outside model forwards.

A tiny in-process Llama pair (no trained weights needed: the draft is the target with perturbed weights, so it
agrees partially and τ is between 1 and k + 1). Plain decoding (``ar``) and the chain drafter run interleaved on
the same prompts after a warm-up; medians are reported. Results go to a JSON file with machine info.

    python benchmarks/engine_overhead.py [--threads 2] [--k 4] [--max-new-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import speculant
from speculant.tiny_models import perturbed, tiny_model


def machine_info(threads: int) -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "speculant": speculant.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per prompt after warm-up")
    ap.add_argument("--hidden", type=int, default=256, help="target hidden size")
    ap.add_argument("--layers", type=int, default=6, help="target layers")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--noise", type=float, default=0.02, help="weight noise that makes the draft (sets τ)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_overhead.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = tiny_model("llama", seed=0, vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                        heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 128), context=2048,
                        init_std=0.05)
    draft = perturbed(target, scale=args.noise, seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, args.vocab, (64,), generator=gen).tolist() for _ in range(args.prompts)]
    methods = {
        "ar": lambda: None,
        f"chain:k={args.k}": lambda: speculant.DraftModelDrafter(draft, k=args.k),
    }

    def run(name: str, prompt: list[int]) -> speculant.GenerationStats:
        return speculant.generate(target, prompt, drafter=methods[name](), max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, seed=0, eos_token_id=[]).stats

    for name in methods:  # warm-up
        run(name, prompts[0])
    rows: dict[str, list[dict]] = {name: [] for name in methods}
    t0 = time.perf_counter()
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name in methods:  # interleaved per prompt
                s = run(name, prompt)
                rows[name].append({"prompt": i, "repeat": r, **s.as_dict()})
    elapsed = time.perf_counter() - t0

    def med(name: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[name])

    summary = {}
    for name in methods:
        summary[name] = {
            key: med(name, key)
            for key in ("acceptance_length", "tokens_per_second", "overhead_share", "wall_s", "target_forward_s",
                        "draft_forward_s", "overhead_s", "prefill_s")
        }
        ratios = [
            a["wall_s"] / b["wall_s"] for a, b in zip(rows["ar"], rows[name])
        ]
        summary[name]["speedup_vs_ar"] = statistics.median(ratios)
        steps = statistics.median(row["target_calls"] for row in rows[name])
        summary[name]["overhead_ms_per_step"] = 1000 * summary[name]["overhead_s"] / steps

    result = {
        "benchmark": "engine_overhead",
        "machine": machine_info(args.threads),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "elapsed_s": elapsed,
        "summary": summary,
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'method':<12} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'overhead':>9} {'ovh ms/step':>11}")
    for name, s in summary.items():
        print(f"{name:<12} {s['acceptance_length']:6.2f} {s['tokens_per_second']:8.1f} {s['speedup_vs_ar']:7.2f}x "
              f"{100 * s['overhead_share']:8.1f}% {s['overhead_ms_per_step']:11.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
