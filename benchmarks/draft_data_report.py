"""What a ``speculant train draft`` run directory holds: answers, tokens, sources, temperatures, time, and (for
feature drafters) the recorded states; with ``--drafter`` also the trained drafter's validation history.

    python benchmarks/draft_data_report.py runs/qwen2.5-coder-1.5b-draft \
        --drafter runs/qwen2.5-coder-1.5b-draft/eagle3-fkl --out benchmarks/results/qwen-eagle3

Writes ``OUT/data.json`` and copies the drafter's ``MODEL_CARD.md``, ``attached.json``, ``history.json`` and
``run_config.json`` (never its weights). Answer time: the runs' own records (``answers/RUNS.json``) when present,
else the span between the prompts file and the last shard written (an upper bound: it includes any pause).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
from pathlib import Path

import numpy as np


def report(run: Path) -> dict:
    from speculant.train.drafter.answers import shard_paths

    prompts = [json.loads(line) for line in (run / "prompts.jsonl").read_text().splitlines() if line.strip()]
    paths = shard_paths(run / "answers")
    answers = answer_tokens = prompt_tokens = 0
    sources: collections.Counter = collections.Counter()
    temperatures: collections.Counter = collections.Counter()
    lengths = []
    for path in paths:
        with np.load(path) as z:
            a = np.diff(z["answer_offsets"])
            answers += len(a)
            answer_tokens += int(a.sum())
            prompt_tokens += int(z["prompt_offsets"][-1])
            lengths += a.tolist()
            for row, t in zip(z["prompt_index"], z["temperature"]):
                sources[prompts[int(row)].get("category", "instructions")] += 1
                temperatures[float(t)] += 1
    runs_file = run / "answers" / "RUNS.json"
    if runs_file.exists():
        runs = json.loads(runs_file.read_text())
        seconds = sum(r["seconds"] for r in runs)
        timing = {"source": "answers/RUNS.json", "runs": runs}
    else:
        seconds = max(os.path.getmtime(p) for p in paths) - os.path.getmtime(run / "prompts.jsonl")
        timing = {"source": "file times: prompts.jsonl to the last shard (an upper bound)"}
    states = sorted(run.glob("features*/shard-*.npy"))
    return {
        "run": str(run), "prompts": len(prompts), "shards": len(paths), "answers": answers,
        "answer_tokens": answer_tokens, "prompt_tokens": prompt_tokens,
        "answer_tokens_median": float(np.median(lengths)) if lengths else 0.0,
        "answers_by_category": dict(sources), "answers_by_temperature": {str(k): v for k, v in temperatures.items()},
        "seconds": round(seconds, 1), "answer_tokens_per_s": round(answer_tokens / max(seconds, 1e-9), 2),
        "timing": timing, "state_files": len(states), "state_bytes": sum(p.stat().st_size for p in states),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--drafter", type=Path, default=None, help="a trained drafter's folder (RUN/KIND-LOSS)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = report(args.run)
    (args.out / "data.json").write_text(json.dumps(data, indent=1))
    if args.drafter is not None:
        for name in ("history.json", "run_config.json", "draft/MODEL_CARD.md", "draft/attached.json"):
            if (args.drafter / name).exists():
                shutil.copy(args.drafter / name, args.out / Path(name).name)
    print(json.dumps({k: v for k, v in data.items() if k != "timing"}, indent=1))


if __name__ == "__main__":
    main()
