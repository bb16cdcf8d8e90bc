"""What ConFu's contemplate tokens cost in a verification forward on this machine.

ConFu (:mod:`speculant.drafters.confu`) adds rows to every verification forward: ``contemplate=root`` one contemplate
token (and 16 soft-prompt entries per layer that only it sees), ``contemplate=all`` one per tree node plus the
root's, as the paper does. On a GPU extra rows are nearly free; on a CPU a forward's cost grows with its rows
(``benchmarks/results/forward_cost_*.json``), so this is what decides where contemplation can pay.

One :class:`speculant.core.sequence.Sequence` per (tree shape, mode) decodes with a fixed draft tree after the same
prompt; each step's verification (plan: tree mask, soft entries; the target forward; absorb: verify, keep the
accepted slots) is timed, the sequences interleaved step by step, after warm-up; medians. The tree's tokens are
arbitrary (mostly rejected: the context grows one token per step). The contemplation parameters are untrained
(their values do not change the cost).

    python benchmarks/contemplate_cost.py --target qwen2.5-coder-1.5b-instruct \
        --out benchmarks/results/contemplate_cost_qwen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from speculant.bench.speed import machine_info
from speculant.core.drafting import Drafter
from speculant.core.sequence import Sequence
from speculant.core.target_forward import TargetForward
from speculant.core.types import DraftTree, Probes, SamplingParams
from speculant.models.contemplate import Contemplation, kv_shape
from speculant.models.loading import default_quantization_for, load_pretrained

SHAPES = {  # name -> parents of the tree's nodes (-1: the root)
    "chain2": [-1, 0],
    "chain3": [-1, 0, 1],
    "tree6": [-1, -1, 0, 0, 1, 2],
    "tree10": [-1, -1, -1, 0, 0, 1, 2, 3, 5, 6],
}
MODES = ("none", "root", "all")


class FixedTree(Drafter):
    """Proposes the same tree shape every step, with contemplate tokens as ``mode`` says."""

    uses_target_hidden = True  # as a ConFu drafter: the engine hands over the target's states (and the probes')

    def __init__(self, parents: list[int], mode: str, contemplation: Contemplation) -> None:
        self.parents, self.mode, self.c = parents, mode, contemplation

    def propose(self, state) -> DraftTree:
        n = len(self.parents)
        tree = DraftTree(tokens=[1000 + 7 * i for i in range(n)], parents=list(self.parents))
        if self.mode != "none":
            anchors = 1 if self.mode == "root" else n + 1
            embeds = self.c.token_embeds(None, anchors)
            tree.probes = Probes(anchors=list(range(anchors)), length=1, embeds=embeds,
                                 soft_keys=self.c.soft_keys, soft_values=self.c.soft_values, logits=False)
        return tree

    def commit(self, state, accepted) -> None:
        state.target_hidden.clear()
        state.probe_hidden = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantization", default=None, help="weights (default: the packaged target's own)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per sequence (after 2 warm-up steps)")
    ap.add_argument("--soft", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default="benchmarks/results/contemplate_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quantization = args.quantization or default_quantization_for(args.target)
    model = load_pretrained(args.target, dtype="float32", quantization=quantization)[0]
    cfg = model.config
    contemplation = Contemplation(*kv_shape(cfg), cfg.hidden_size, soft=args.soft).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, cfg.vocab_size, (args.context,), generator=gen).tolist()
    forward = TargetForward(model)
    runs = {}
    for shape in args.shapes.split(","):
        for mode in MODES:
            seq = Sequence(0, model, forward, prompt, FixedTree(SHAPES[shape], mode, contemplation),
                           max_new_tokens=args.steps + 8, params=SamplingParams(temperature=0.0), stops=set())
            runs[(shape, mode)] = (seq, [])
    with torch.inference_mode():
        for seq, _ in runs.values():
            seq.prefill()
        for step in range(args.steps + 2):  # two warm-up steps
            for (shape, mode), (seq, times) in runs.items():
                start = time.perf_counter()
                segment = seq.plan()
                hidden: list = []
                logits = forward(segment.cache, segment.input_ids, segment.inputs_embeds, segment.positions,
                                 segment.mask, hidden_out=hidden, head_rows=segment.head_rows)
                seq.hidden = hidden
                seq.absorb(logits[0], 0.0)
                if step >= 2:
                    times.append(time.perf_counter() - start)
    ms = {f"{shape}:{mode}": 1000 * statistics.median(t) for (shape, mode), (_, t) in runs.items()}
    rows = {f"{shape}:{mode}": len(SHAPES[shape]) + 1 + (0 if mode == "none" else 1 if mode == "root"
                                                          else len(SHAPES[shape]) + 1)
            for shape in args.shapes.split(",") for mode in MODES}
    ratio = {k: ms[k] / ms[k.split(":")[0] + ":none"] for k in ms}
    result = {"settings": {**vars(args), "quantization": quantization}, "machine": machine_info(),
              "rows": rows, "ms": ms, "ratio_to_none": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for k in ms:
        print(f"{k:14s} rows {rows[k]:3d}  {ms[k]:7.1f} ms  x{ratio[k]:.2f}")
    print("written", args.out)


if __name__ == "__main__":
    main()
