"""How often drafters agree with the target on the target's own answers to a benchmark's prompts (teacher-forced).

A drafter's held-out validation (its model card) is measured on answers to prompts like the ones it was trained
on; a benchmark asks other things. This script reads the plain-decoding (``ar``) answers of a greedy
``speculant bench`` run, runs the target and each drafter once over prompt + answer, and reports at every answer
position whether the drafter's top token is the target's (greedy agreement, the first draft token's acceptance
probability under greedy verification), overall and per category. Nothing is timed; the CPU may be shared.

    python benchmarks/drafter_agreement.py --results benchmarks/results/mtbench-80-bf16/results.json \
        --drafts smollm2-135m-instruct-draft,runs/smollm2-draft-self/fkl/draft --out benchmarks/results/X.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from speculant.bench.prompts import prompt_ids
from speculant.loading import load_draft, load_pretrained


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results/mtbench-80-bf16/results.json")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafts", required=True, help="drafter names or directories, separated by ','")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = json.loads(Path(args.results).read_text())
    target, tok = load_pretrained(args.target, dtype=args.dtype)
    names = args.drafts.split(",")
    drafts = {name: load_draft(name, target) for name in names}
    prompts = results["prompts"]
    hits: dict[str, dict[str, list[int]]] = {n: defaultdict(lambda: [0, 0]) for n in names}
    for run in results["runs"]["ar"]:
        if run["repeat"]:
            continue
        record = prompts[run["prompt"]]
        ids = prompt_ids(record, tok)
        full = torch.tensor([ids + run["token_ids"]])
        answer = slice(len(ids) - 1, full.shape[1] - 1)  # positions that predict the answer tokens
        want = target(full).logits[0, answer].argmax(-1)  # [A]
        for name, draft in drafts.items():
            same = draft(full).logits[0, answer].argmax(-1) == want
            for key in ["all"] + ([record["category"]] if record.get("category") else []):
                hits[name][key][0] += int(same.sum())
                hits[name][key][1] += same.numel()
    table = {n: {k: {"agreement": round(a / t, 4), "positions": t} for k, (a, t) in sorted(h.items())}
             for n, h in hits.items()}
    out = {"results": args.results, "target": args.target, "dtype": args.dtype, "agreement": table}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for n, rows in table.items():
        print(n, " ".join(f"{k} {v['agreement']:.3f}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
