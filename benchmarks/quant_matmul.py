"""cost(T) / cost(1) of one forward's matrices over T new tokens, by weight format: what verification can afford.

Speculative decoding pays off when a forward over T = 2..16 tokens costs about what a forward over one costs (the
weights are read from memory once either way). This script builds one model's worth of matrices with the shapes of
Qwen2.5-1.5B by default (28 layers of fused q/k/v 1536->2048, o 1536->1536, fused gate/up 1536->17920, down
8960->1536, and the LM head 1536->151936; random values, distinct tensors so nothing stays in cache), and times one
sweep over all of them for each row count T (median of ``--repeats``, formats and row counts interleaved, one
warm-up round) with:

* ``bf16-packed``: bfloat16 reordered once for oneDNN (:class:`speculant.core.packed.PackedMatrix`, today's lean
  forward);
* ``int8``, ``int4``: :class:`speculant.core.quant.QuantMatrix` on torch's weight-only kernels (activations bf16);
* ``q4``: :class:`~speculant.core.quant.QuantMatrix` on speculant's own kernel (int4 weights, int8 activations;
  :mod:`speculant.core.kernels`; the JSON records its code path), and ``q8`` (the same with 8-bit codes). Where the
  CPU has AMX tiles, 10..16 rows run on them; ``q4:vnni`` / ``q8:vnni`` time the same kernel with the tiles turned
  off (AVX-512 VNNI), in the same run.

It writes the milliseconds, cost(T)/cost(1) per format and each format's time relative to bf16-packed, with machine
info and settings, as JSON. Run it on a quiet machine (timings taken on a shared one are noise):

    python benchmarks/quant_matmul.py [--rows 1,2,4,8,16] [--repeats 5] [--threads 2]
        [--target NAME]  # another model's shapes (read from its config, see packed_matmul.py)
        [--out benchmarks/results/quant_matmul.json]

About 3 GB of bf16 weights plus 1.5 GB (int8), 1.5 GB (int4 with its codes) and 1.7 GB (q4 with its codes) are
held at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from speculant.bench.speed import machine_info
from speculant.core.kernels import q4_amx, q4_isa
from speculant.core.packed import PackedMatrix, linear, packable
from speculant.core.quant import QuantMatrix

QWEN25_15B_LAYER = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
"""``[(out, in), ...]``: one Qwen2.5-1.5B layer's matrices as the lean forward multiplies by them (fused)."""
QWEN25_15B_HEAD = (151936, 1536)


def _formats(shapes: list[tuple[int, int]], names: list[str], gen: torch.Generator) -> dict[str, list]:
    """Each format's matrices, built one source matrix at a time (the bf16 source is dropped after use)."""
    out: dict[str, list] = {n: [] for n in names}
    for o, i in shapes:
        w = torch.randn(o, i, generator=gen).to(torch.bfloat16)
        for n in names:
            if n == "bf16-packed":
                out[n].append(PackedMatrix(w) if packable(w) else w)
            elif n == "bf16-dense":
                out[n].append(w)
            else:
                out[n].append(QuantMatrix.quantize(w, n.split(":")[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="take the shapes of this model (default: Qwen2.5-1.5B's)")
    ap.add_argument("--layers", type=int, default=28, help="layers of the default shapes (fewer: a smoke run)")
    ap.add_argument("--formats", default="bf16-packed,int8,int4,q4", help="bf16-packed, bf16-dense, int8, int4, q4, q8, q4:vnni, q8:vnni")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/quant_matmul.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    names = args.formats.split(",")
    if args.target is None:
        shapes = QWEN25_15B_LAYER * args.layers + [QWEN25_15B_HEAD]
    else:
        from packed_matmul import _shapes  # this folder is on sys.path when the script runs

        shapes = _shapes(args.target)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        mats = _formats(shapes, names, gen)
        inputs = {r: {i: torch.randn(r, i, generator=gen).to(torch.bfloat16) for i in {s[1] for s in shapes}}
                  for r in rows}
        times = {n: {r: [] for r in rows} for n in names}
        for rep in range(args.repeats + 1):  # round 0 warms up
            for r in rows:
                for n in names:
                    q4_amx(not n.endswith(":vnni"))
                    start = time.perf_counter()
                    for (_, i), m in zip(shapes, mats[n]):
                        linear(inputs[r][i], m)
                    if rep:
                        times[n][r].append(1000 * (time.perf_counter() - start))
    ms = {n: {r: statistics.median(v) for r, v in t.items()} for n, t in times.items()}
    base = names[0]
    result = {
        "settings": vars(args), "machine": machine_info(), "matrices": len(shapes),
        "q4_kernel": q4_isa() if any(n.startswith(("q4", "q8")) for n in names) else None,
        "q4_amx": q4_amx(True),
        "weights_mb": {n: sum(m.nbytes for m in mats[n]) / 1e6 for n in names},
        "ms": ms,
        "cost_vs_one_row": {n: {r: t[r] / t[rows[0]] for r in rows} for n, t in ms.items()},
        f"vs_{base}": {n: {r: t[r] / ms[base][r] for r in rows} for n, t in ms.items()},
    }
    for n, t in ms.items():
        print(f"{n:12s}", "  ".join(f"T={r}: {v:7.1f} ms ({v / t[rows[0]]:.2f}x)" for r, v in t.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("written", args.out)


if __name__ == "__main__":
    main()
