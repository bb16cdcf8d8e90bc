"""How many keys KeyDiff scores above 0 (``-cos(k, mean key) > 0``) on a real model: the regime where clamping its
score at 0, as CAOTE clamps an attention mass, would give almost every token the same weight.

Prefills the first ``--tokens`` tokens of the first RULER sample in ``--samples`` (a ``kv-eval --task ruler``
folder's ``ruler_samples.jsonl``) with the full cache and writes, per layer and KV head, the share of keys with a
positive KeyDiff score to ``--out``.

    python benchmarks/keydiff_sign.py --samples runs/ruler-qwen1.5b-4k/ruler_samples.jsonl \
        --out benchmarks/results/ruler-qwen-zen4/keydiff_sign.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers
from speculant.core.target_forward import TargetForward
from speculant.kv.policies import KeyDiff
from speculant.models.loading import load_pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--quantization", default="file")
    parser.add_argument("--samples", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model, tok = load_pretrained(args.target, quantization=args.quantization)
    context = json.loads(args.samples.read_text().splitlines()[0])["samples"][0]["context"]
    ids = torch.tensor([tok(context)["input_ids"][: args.tokens]])  # [1, T]
    cache = SpecCache(num_layers(model), capacity=ids.shape[1] + 64)
    with torch.inference_mode():
        TargetForward(model, max_length=ids.shape[1] + 64).prefill(cache, ids)
    shares = []
    for layer in cache.layers:
        s = KeyDiff().score(layer.keys, layer.values, None)  # [1, H_kv, T]
        shares.append([float((s[0, h] > 0).float().mean()) for h in range(s.shape[1])])
    flat = [x for row in shares for x in row]
    report = {"target": args.target, "quantization": args.quantization, "tokens": ids.shape[1],
              "positive_share_per_layer_head": shares, "max": max(flat), "mean": sum(flat) / len(flat)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "positive_share_per_layer_head"}))


if __name__ == "__main__":
    main()
