"""Which draft set-up is fastest: the bundled draft in each load dtype and with each VocabTrim size.

Greedy, chain k=4, held-out stdlib prompts (signature + docstring), 128 new tokens, CPU with 2 threads; every
variant and plain decoding (`ar`) interleaved per prompt after a warm-up, outputs checked identical to `ar`.
The loader's default draft dtype and the draft's shipped VocabTrim size (``vocab_trim.json`` ``default_size``)
are chosen from this file. Writes benchmarks/results/draft_variants.json and prints a table.

    python benchmarks/draft_variants.py [--threads 2] [--prompts 24] [--trims 0/1024/2048/4096]
                                        [--draft-dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import speculant
from speculant.data.prompts import code_prompts
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
    ap.add_argument("--trims", default="0/1024/2048/4096", help="VocabTrim sizes, '/'-separated (0 = full head)")
    ap.add_argument("--draft-dtypes", default="float32,bfloat16")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_variants.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = speculant.load_pretrained(args.target)
    drafts = {name: speculant.load_pretrained(args.draft, dtype=name)[0] for name in args.draft_dtypes.split(",")}
    prompts = code_prompts(n=args.prompts)
    ids = [tok(p["prompt"]).input_ids for p in prompts]
    methods = [MethodRun("ar", lambda: None)]
    for name, draft in drafts.items():
        for trim in (int(t) for t in args.trims.split("/")):
            methods.append(MethodRun(f"chain:k={args.k}:trim={trim} draft={name}",
                                     lambda d=draft, t=trim: speculant.DraftModelDrafter(d, k=args.k, vocab_trim=t)))
    rows = run_side_by_side(target, methods, ids, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                            eos_token_id=[])
    summary = summarise(rows)
    result = {"benchmark": "draft_variants", "machine": machine_info(),
              "settings": {**{k: str(v) for k, v in vars(args).items()}, "temperature": 0.0,
                           "target_dtype": str(target.dtype)},
              "prompts": [p["id"] for p in prompts], "summary": summary, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, s in summary.items():
        print(f"{name:<36} tau={s['acceptance_length']:.2f} tok/s={s['tokens_per_second']:.1f} "
              f"speedup={s.get('speedup_vs_ar', 1):.2f}x identical={s.get('identical_to_ar', 1):.0%} "
              f"draft={100 * s['draft_forward_share']:.1f}% overhead={100 * s['overhead_share']:.1f}%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
