"""Explain every bf16 output that differs from plain bf16 decoding in a greedy ``speculant bench`` run.

In bfloat16 a verification forward over several tokens and a one-token forward use different matmul shapes, so
their logits round differently; where the target's two best tokens are nearly tied, the argmax can differ and the
outputs part ways from there. For each mismatch of a results.json (method, prompt, first differing position d),
this script takes the common prefix (the two outputs agree up to d), runs the target ONCE in float32 on
prompt + prefix, and reports the float32 logit gap between plain decoding's token and the method's token at d,
with the bf16 spacing at that logit's magnitude (``2**(floor(log2|logit|) - 7)``). A gap of the order of that
spacing is a near-tie that bf16 rounding decides; a large gap would be a bug.

    python benchmarks/bf16_ties.py --results benchmarks/results/mtbench-80-bf16/results.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from speculant.data.prompts import prompt_ids
from speculant.models.loading import load_pretrained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results/mtbench-80-bf16/results.json")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: bf16_ties.json beside the results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = json.loads(Path(args.results).read_text())
    target, tok = load_pretrained(args.target, dtype=torch.float32)
    plain = {(r["prompt"], r["repeat"]): r["token_ids"] for r in results["runs"]["ar"]}
    rows = []
    for method, runs in results["runs"].items():
        if method == "ar":
            continue
        for r in runs:
            a_ids, m_ids = plain[(r["prompt"], r["repeat"])], r["token_ids"]
            d = next((i for i, (x, y) in enumerate(zip(a_ids, m_ids)) if x != y), None)
            if d is None:
                continue
            record = results["prompts"][int(r["prompt"])]
            ids = prompt_ids(record, tok) + a_ids[:d]
            with torch.inference_mode():
                logits = target(input_ids=torch.tensor([ids])).logits[0, -1].float()  # [V]
            a, m = a_ids[d], m_ids[d]
            top2 = logits.topk(2)
            spacing = 2.0 ** (math.floor(math.log2(max(abs(float(logits[a])), 1e-6))) - 7)
            rows.append({"method": method, "prompt": record.get("id"), "first_diff": d, "plain_token": a,
                         "method_token": m, "fp32_gap": float(logits[a] - logits[m]),
                         "fp32_top2_gap": float(top2.values[0] - top2.values[1]),
                         "both_are_fp32_top2": {a, m} == set(top2.indices.tolist()), "bf16_spacing": spacing})
    gaps = [abs(r["fp32_gap"]) for r in rows]
    summary = {"mismatches": len(rows), "max_abs_fp32_gap": max(gaps, default=0.0),
               "all_between_fp32_top2": all(r["both_are_fp32_top2"] for r in rows),
               "max_gap_in_bf16_spacings": max((abs(r["fp32_gap"]) / r["bf16_spacing"] for r in rows), default=0)}
    out = Path(args.out) if args.out else Path(args.results).with_name("bf16_ties.json")
    out.write_text(json.dumps({"settings": vars(args), "summary": summary, "mismatches": rows}, indent=1))
    print(json.dumps(summary))
    print("written", out)


if __name__ == "__main__":
    main()
