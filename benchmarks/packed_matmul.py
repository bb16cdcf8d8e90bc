"""What the weight matrices of one decoding step cost as bare matmuls, by kernel and weight format, on this machine.

A decoding step multiplies 1 to ~16 rows by every weight matrix of the model once; with a real model these
matrices are far larger than the CPU's caches, so the step reads them from memory. This script builds one
model's worth of matrices with the shapes of ``--target`` (each layer's fused q/k/v, o, fused gate/up and down, and
the LM head; random values, distinct tensors so nothing stays in cache), and times one sweep over all of them
for each row count (median of ``--repeats``) with:

* ``dense``: ``F.linear`` on the plain matrix (what transformers and an unpacked lean forward do);
* ``packed``: the matrix reordered once for oneDNN (:class:`speculant.core.packed.PackedMatrix`), in the same dtype;
* for bfloat16 also torch's weight-only quantized CPU kernels: ``int8`` (``_weight_int8pack_mm``, a scale per
  row) and ``int4`` (``_weight_int4pack_mm_for_cpu``, groups of 32 with a scale and an offset, the layout of
  GGUF's Q4_1), through :class:`speculant.core.quant.QuantMatrix`. These change the model's numbers (a quantized
  model is another model, see :mod:`speculant.core.quant`).

    python benchmarks/packed_matmul.py [--target smollm2-135m-instruct] [--out benchmarks/results/packed_matmul.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from speculant.bench.speed import machine_info
from speculant.models.loading import resolve_model
from speculant.core.packed import PackedMatrix, linear, packable
from speculant.core.quant import QuantMatrix


def _shapes(target: str) -> list[tuple[int, int]]:
    """``[(out, in), ...]``: every matrix one forward multiplies by, fused as the lean forward fuses them."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_model(target))
    h, i = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    layer = [(qkv, h), (h, cfg.num_attention_heads * d), (2 * i, h), (h, i)]
    return layer * cfg.num_hidden_layers + [(cfg.vocab_size, h)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,5,16")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/packed_matmul.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = _shapes(args.target)
    gen = torch.Generator().manual_seed(0)
    result = {"settings": vars(args), "machine": machine_info(), "matrices": len(shapes), "ms": {}, "weight_mb": {}}
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            weights = [torch.randn(o, i, generator=gen).to(dtype) for o, i in shapes]
            result["weight_mb"][name] = sum(w.numel() * w.element_size() for w in weights) / 1e6
            kernels = {"dense": [lambda x, w=w: F.linear(x, w) for w in weights]}
            if packable(weights[0]):
                packed = [PackedMatrix(w) for w in weights]
                kernels["packed"] = [lambda x, p=p: linear(x, p) for p in packed]
            if dtype == torch.bfloat16:
                for kind in ("int8", "int4"):  # speculant.core.quant; benchmarks/quant_matmul.py compares them
                    kernels[kind] = [lambda x, q=QuantMatrix.quantize(w, kind): linear(x, q) for w in weights]
            times = {k: {r: [] for r in rows} for k in kernels}
            inputs = {r: {i: torch.randn(1, r, i, generator=gen).to(dtype) for i in {s[1] for s in shapes}}
                      for r in rows}
            for rep in range(args.repeats + 1):  # the first round is warm-up; kernels and row counts interleaved
                for r in rows:
                    for k, fns in kernels.items():
                        start = time.perf_counter()
                        for (_, i), fn in zip(shapes, fns):
                            fn(inputs[r][i])
                        if rep:
                            times[k][r].append(1000 * (time.perf_counter() - start))
            result["ms"][name] = {k: {r: statistics.median(v) for r, v in t.items()} for k, t in times.items()}
            for k, t in result["ms"][name].items():
                print(name, k, " ".join(f"{r} rows: {ms:.1f} ms" for r, ms in t.items()), flush=True)
            del weights, kernels
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("written", args.out)


if __name__ == "__main__":
    main()
