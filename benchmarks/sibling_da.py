"""The 1.5B target's 0.5B sibling fine-tuned the Direct-Alignment way (``speculant train draft --kind model``):
untrained vs FKL vs TVD vs TVD++, as τ at temperatures 0 and 1.

Every exported drafter of ``--run`` (``RUN/model-<loss>/draft``: the untrained one went through the same bfloat16
export, so the rows differ by training alone) drafts ``chain:k=K`` for the packaged target on the same prompts in one
``speculant bench`` run per temperature (the packaged sibling, read from its GGUF file, as a reference row); then
``table.md`` / ``table.json`` list τ, the per-position acceptance and each drafter's held-out figures from its
training history, and the drafters' model cards and histories are copied beside them.

    python benchmarks/sibling_da.py --run runs/qwen-sibling-da --out benchmarks/results/qwen-sibling-da
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

LOSSES = ("none", "fkl", "tvd", "tvd++")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the train draft --kind model run directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", default="builtin:mt-bench")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per chain")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    args = ap.parse_args()
    run, out = Path(args.run), Path(args.out)
    exports = {loss: run / f"model-{loss.replace('+', 'p')}" / "draft" for loss in LOSSES}
    exports = {loss: d for loss, d in exports.items() if (d / "draft_model.json").exists()}
    if not exports:
        raise SystemExit(f"{run} holds no exported model drafter (RUN/model-<loss>/draft)")
    methods = {"packaged": f"chain:k={args.k}", **{loss: f"chain:k={args.k}:draft={d}" for loss, d in exports.items()}}
    out.mkdir(parents=True, exist_ok=True)
    table: dict = {"settings": vars(args), "drafters": {}, "tau": {}, "position_acceptance": {}}
    for t in args.temperatures.split(","):
        bench_out = out / f"bench-t{t}"
        cmd = [sys.executable, "-m", "speculant", "bench", "--target", args.target, "--prompts", args.prompts,
               "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens), "--threads", "2",
               "--temperature", t, "--methods", ",".join(["ar", *methods.values()]), "--out", str(bench_out)]
        if float(t) > 0:
            cmd += ["--seed", str(args.seed)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        results = json.loads((bench_out / "results.json").read_text())["methods"]
        for name, spec in methods.items():
            table["tau"].setdefault(name, {})[t] = results[spec]["acceptance_length"]
            table["position_acceptance"].setdefault(name, {})[t] = results[spec]["position_acceptance"]
    for loss, d in exports.items():
        meta = json.loads((d / "draft_model.json").read_text())
        table["drafters"][loss] = {k: meta.get(k) for k in ("loss", "steps", "train_last", "train_seconds",
                                                            "validation")}
        folder = out / f"model-{loss.replace('+', 'p')}"
        folder.mkdir(exist_ok=True)
        for name in ("MODEL_CARD.md", "draft_model.json", "vocab_trim.json"):
            shutil.copy(d / name, folder / name)
        shutil.copy(d.parent / "history.json", folder / "history.json")
    (out / "table.json").write_text(json.dumps(table, indent=1))
    temps = args.temperatures.split(",")
    lines = ["| drafter | steps | held-out greedy agreement | held-out α (T=1) | "
             + " | ".join(f"τ T={t} | per position T={t}" for t in temps) + " |",
             "|---" * (4 + 2 * len(temps)) + "|"]
    for name in methods:
        info = table["drafters"].get(name, {})
        val = info.get("validation") or {}
        cells = [f"`{name}`" if name != "packaged" else "packaged (GGUF)", str(info.get("steps", "–")),
                 f"{val['greedy_agreement']:.3f}" if val else "–", f"{val['alpha_t1']:.3f}" if val else "–"]
        for t in temps:
            cells += [f"{table['tau'][name][t]:.3f}",
                      "[" + ", ".join(f"{a:.2f}" for a in table["position_acceptance"][name][t]) + "]"]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
