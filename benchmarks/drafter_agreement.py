"""How often drafters agree with the target on the target's own answers to a benchmark's prompts (teacher-forced).

A drafter's held-out validation (its model card) is measured on answers to prompts like the ones it was trained
on; a benchmark asks other things. This script reads the plain-decoding (``ar``) answers of a greedy
``speculant bench`` run, runs the target and each drafter once over prompt + answer, and reports at every answer
position whether the drafter's top token is the target's (greedy agreement, the first draft token's acceptance
probability under greedy verification), overall and per category, with the drafter's full LM head and with each
VocabTrim size of ``--trims`` (the drafter's top token among its calibration's N most frequent tokens, as a
chain drafts; ``trim_coverage``: how many of the answer tokens lie in that set at all). Nothing is timed; the
CPU may be shared.

    python benchmarks/drafter_agreement.py --results benchmarks/results/mtbench-80-bf16/results.json \
        --drafts smollm2-135m-instruct-draft,runs/smollm2-draft-self/fkl/draft --out benchmarks/results/X.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from speculant.data.prompts import prompt_ids
from speculant.drafters.vocab_trim import load_calibration
from speculant.models.loading import load_draft, load_pretrained, resolve_model


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results/mtbench-80-bf16/results.json")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafts", required=True, help="drafter names or directories, separated by ','")
    ap.add_argument("--trims", default="4096,8192", help="VocabTrim sizes to score too, separated by ','")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = json.loads(Path(args.results).read_text())
    target, tok = load_pretrained(args.target, dtype=args.dtype)
    names = args.drafts.split(",")
    drafts = {name: load_draft(name, target) for name in names}
    vocab = target.get_input_embeddings().weight.shape[0]
    sizes = [int(t) for t in args.trims.split(",") if t]
    keeps: dict[str, dict[str, torch.Tensor | None]] = {}  # drafter -> row name -> [V] bool kept set (None: full head)
    for name in names:
        ranked = load_calibration(resolve_model(name))["token_ids"]
        keeps[name] = {name: None}
        for size in sizes:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[torch.tensor(ranked[:size])] = True
            keeps[name][f"{name}:trim={size}"] = keep
    rows = list(names) + [row for name in names for row in list(keeps[name])[1:]]
    prompts = results["prompts"]
    hits: dict[str, dict[str, list[int]]] = {r: defaultdict(lambda: [0, 0]) for r in rows}
    covered: dict[str, list[int]] = {r: [0, 0] for r in rows}
    for run in results["runs"]["ar"]:
        if run["repeat"]:
            continue
        record = prompts[run["prompt"]]
        ids = prompt_ids(record, tok)
        full = torch.tensor([ids + run["token_ids"]])
        answer = slice(len(ids) - 1, full.shape[1] - 1)  # positions that predict the answer tokens
        want = target(full).logits[0, answer].argmax(-1)  # [A]
        for name, draft in drafts.items():
            logits = draft(full).logits[0, answer].float()  # [A, V]
            for row, keep in keeps[name].items():
                scores = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
                same = scores.argmax(-1) == want
                for key in ["all"] + ([record["category"]] if record.get("category") else []):
                    hits[row][key][0] += int(same.sum())
                    hits[row][key][1] += same.numel()
                if keep is not None:
                    covered[row][0] += int(keep[want].sum())
                    covered[row][1] += want.numel()
    table = {r: {k: {"agreement": round(a / t, 4), "positions": t} for k, (a, t) in sorted(h.items())}
             for r, h in hits.items()}
    coverage = {r: round(a / t, 4) for r, (a, t) in covered.items() if t}
    out = {"results": args.results, "target": args.target, "dtype": args.dtype, "agreement": table,
           "trim_coverage": coverage}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for r, cells in table.items():
        print(r, " ".join(f"{k} {v['agreement']:.3f}" for k, v in cells.items()), f"coverage {coverage.get(r, 1):.3f}")


if __name__ == "__main__":
    main()
