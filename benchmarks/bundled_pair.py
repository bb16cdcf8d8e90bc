"""Bundled default pair on held-out stdlib prompts: τ and wall-clock speed-up of the chain over plain decoding.

Greedy, chain k=4, 128 new tokens, CPU with 2 threads by default; `ar` and `chain` interleaved per prompt
after a warm-up; the greedy outputs are checked identical. Writes benchmarks/results/bundled_pair.json and
prints a table.

    python benchmarks/bundled_pair.py [--threads 2] [--k 4] [--prompts 24] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import speculant
from speculant.bench.prompts import code_prompts
from speculant.bench.speed import MethodRun, machine_info, run_side_by_side, summarise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--dtype", default=None, help="load dtype (default: speculant.load_pretrained's)")
    ap.add_argument("--draft-dtype", default=None, help="draft load dtype (default: --dtype)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bundled_pair.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = speculant.load_pretrained(args.target, dtype=args.dtype)
    draft, _ = speculant.load_pretrained(args.draft, dtype=args.draft_dtype or args.dtype)
    prompts = code_prompts(n=args.prompts)
    ids = [tok(p["prompt"]).input_ids for p in prompts]
    methods = [MethodRun("ar", lambda: None),
               MethodRun(f"chain:k={args.k}", lambda: speculant.DraftModelDrafter(draft, k=args.k))]
    rows = run_side_by_side(target, methods, ids, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                            eos_token_id=[])
    summary = summarise(rows)
    result = {"benchmark": "bundled_pair", "machine": machine_info(),
              "settings": {**{k: str(v) for k, v in vars(args).items()}, "temperature": 0.0,
                           "target_dtype": str(target.dtype), "draft_dtype": str(draft.dtype)},
              "prompts": [p["id"] for p in prompts], "summary": summary, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, s in summary.items():
        print(f"{name:<10} tau={s['acceptance_length']:.2f} tok/s={s['tokens_per_second']:.1f} "
              f"speedup={s.get('speedup_vs_ar', 1):.2f}x identical={s.get('identical_to_ar', 1):.0%} "
              f"overhead={100 * s['overhead_share']:.1f}%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
