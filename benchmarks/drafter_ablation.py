"""The Direct Alignment ablation: τ of the SmolLM2 drafter trained with each loss (and untrained), on MT-Bench.

Each drafter of a ``speculant train draft`` run (``RUN/<loss>/draft``; ``none`` is the untrained initialisation
made of the target's layers) drafts a chain of ``--k`` tokens for the same target on the same MT-Bench questions
(stratified over the 8 categories), greedy and at T=1. τ is tokens per target call over all prompts (total new
tokens / total target calls); the validation figures of each training run are copied beside it.

    python benchmarks/drafter_ablation.py --run runs/smollm2-draft --out benchmarks/results/drafter_ablation.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from speculant.data.mtbench import mtbench_questions
from speculant.bench.speed import machine_info
from speculant.models.chat import chat_ids, stop_ids
from speculant.drafters.registry import build_drafter
from speculant.core.engine import generate
from speculant.models.loading import load_draft, load_pretrained


def stratified(rows: list[dict], n: int) -> list[dict]:
    """``n`` rows taken round-robin over categories, in file order within each."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["category"], []).append(r)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by.values()):
        for v in by.values():
            if i < len(v) and len(out) < n:
                out.append(v[i])
        i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/smollm2-draft")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--losses", default="none,fkl,tvd,tvd++")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/drafter_ablation.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = load_pretrained(args.target, dtype=args.dtype)
    stops = stop_ids(tok, target)
    questions = stratified(mtbench_questions(), args.prompts)
    prompts = [chat_ids(tok, q["messages"]) for q in questions]
    losses = args.losses.split(",")
    drafts = {}
    for loss in losses:
        folder = Path(args.run) / loss.replace("+", "p")
        if (folder / "draft" / "model.safetensors").exists():
            drafts[loss] = (load_draft(folder / "draft", target), json.loads((folder / "history.json").read_text()))
    result = {"settings": vars(args), "machine": machine_info(), "drafters": {}}
    for loss, (draft, history) in drafts.items():
        row = {"validation": history[-1], "tau": {}}
        for temperature in (float(t) for t in args.temperatures.split(",")):
            drafter = build_drafter(f"chain:k={args.k}", draft)
            tokens = calls = 0
            for i, ids in enumerate(tqdm(prompts, desc=f"{loss} T={temperature}")):
                stats = generate(target, ids, drafter=drafter, max_new_tokens=args.max_new_tokens,
                                 temperature=temperature, seed=i, eos_token_id=stops).stats
                tokens += stats.new_tokens
                calls += stats.target_calls
            row["tau"][str(temperature)] = tokens / calls
        result["drafters"][loss] = row
        print(loss, {t: round(v, 3) for t, v in row["tau"].items()}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("written", args.out)


if __name__ == "__main__":
    main()
