"""What one target forward over T new tokens costs, in float32 and bfloat16, on this machine.

This ratio decides which methods pay off: a verification forward over a chain of k draft tokens or a tree of n
nodes costs ``cost(n + 1) / cost(1)`` one-token forwards. The target forward the engine uses (``--forward lean``,
the default: :mod:`speculant.core.llama_forward`, packed where :mod:`speculant.core.packed` allows) or the model's own
(``--forward model``, transformers) is timed after a prompt of ``--context`` tokens is in its cache; each measured
forward is cropped away again, the dtypes and token counts are interleaved per repeat, and the median of
``--repeats`` is reported.

Weight formats: ``--quantizations`` (each variant is a dtype x a kind, loaded as the front-ends load it, a GGUF
file's codes kept where the kind holds them; ``KIND/values`` requantizes every matrix from its float values instead,
e.g. ``q4/values``: every matrix in 4 bits, where ``file`` keeps a Q4_K_M file's 6-bit tensors as q6; tags after the
kind change how a GGUF file's tensors are held: ``/8bit`` and ``/7bit``: its 6-bit tensors requantized to 8- or 7-bit
codes (q8, ``quantize_loaded(wide_bits=8)``, as ``file`` held them before q6). ``--seven both``
times each variant also with the kernel's 7-bit route off (``:8bit``: q8 codes below 128 multiplied as 8-bit ones,
the same bits), interleaved.

    python benchmarks/forward_cost.py --target smollm2-135m-instruct --out benchmarks/results/forward_cost.json
    python benchmarks/forward_cost.py --target qwen2.5-coder-1.5b-instruct --dtypes float32 \
        --quantizations q4,q4/values,q8 --tokens 1,4,8,16 --out benchmarks/results/forward_cost_qwen_q4.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from speculant.bench.speed import machine_info
from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers
from speculant.core.kernels import q4_amx, q4_seven
from speculant.core.target_forward import TargetForward
from speculant.models.loading import load_pretrained, quantize_loaded, resolve_model, wide_variant
from speculant.models.sources import gguf_backing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forward", choices=["lean", "model"], default="lean")
    ap.add_argument("--quantizations", default="none", help="weight kinds, ',' separated (none, int8, int4, q4, q8; "
                    "KIND/values: requantized from the float values, ignoring a GGUF file's codes; KIND/8bit, "
                    "KIND/7bit: a GGUF file's 6-bit tensors in 8- or 7-bit codes)")
    ap.add_argument("--amx", choices=["on", "off", "both"], default="on",
                    help="the q4/q8 kernel's AMX tiles for 10-16 rows (where the CPU has them); both: each variant "
                    "twice, ':vnni' with the tiles off, interleaved")
    ap.add_argument("--seven", choices=["on", "off", "both"], default="on",
                    help="the q4/q8 kernel's route for q8 codes below 128 (AVX2 without VNNI); both: each variant "
                    "twice, ':8bit' with the route off, interleaved")
    ap.add_argument("--out", default="benchmarks/results/forward_cost.json")
    ap.add_argument("--prefill", action="store_true",
                    help="time a prompt's prefill of T tokens (no LM head), not a forward with the logits of every row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(t) for t in args.tokens.split(",")]
    models = {}
    for dt in args.dtypes.split(","):
        for kind in args.quantizations.split(","):
            name = dt if kind == "none" else f"{dt}:{kind}"
            if kind.endswith("/values"):  # every matrix from its float values
                model = load_pretrained(args.target, dtype=dt)[0]
                quantize_loaded(model, kind.split("/")[0])
            elif "/" in kind:  # the file's codes where the kind holds them, its 6-bit tensors as the tag says
                try:
                    base, wide = wide_variant(kind)
                except ValueError as e:
                    raise SystemExit(str(e)) from None
                backing = gguf_backing(resolve_model(args.target))
                if backing is None:
                    raise SystemExit(f"{kind}: {args.target} is not read from a GGUF file (no 6-bit tensors)")
                model = load_pretrained(args.target, dtype=dt)[0]
                quantize_loaded(model, base, backing, wide_bits=wide)
            else:
                model = load_pretrained(args.target, dtype=dt, quantization=kind)[0]
            for amx in ("on", "off"):
                for seven in ("on", "off"):
                    if args.amx in (amx, "both") and args.seven in (seven, "both"):
                        models[name + (":vnni" if amx == "off" else "") + (":8bit" if seven == "off" else "")] = model
    dtypes = list(models)
    gen = torch.Generator().manual_seed(0)
    vocab = models[dtypes[0]].config.vocab_size
    prompt = torch.randint(100, vocab, (1, args.context), generator=gen)
    new = torch.randint(100, vocab, (1, max(counts)), generator=gen)
    caches, forwards = {}, {}
    with torch.inference_mode():
        for dt, m in models.items():
            forwards[dt] = TargetForward(m, args.forward)
            caches[dt] = SpecCache(num_layers(m), capacity=args.context + max(counts))
            forwards[dt].prefill(caches[dt], prompt)
        times: dict[str, dict[int, list[float]]] = {dt: {t: [] for t in counts} for dt in dtypes}
        for rep in range(args.repeats + 2):  # the first two rounds are warm-up
            for t in counts:
                for dt in models:
                    q4_amx(":vnni" not in dt)
                    q4_seven(":8bit" not in dt)
                    start = time.perf_counter()
                    if args.prefill:  # a prompt's prefill: no logits (the root's are computed by the first step)
                        forwards[dt].prefill(caches[dt], new[:, :t])
                    else:
                        forwards[dt](caches[dt], input_ids=new[:, :t])
                    elapsed = time.perf_counter() - start
                    caches[dt].crop(args.context)  # drop the t tokens just added
                    if rep >= 2:
                        times[dt][t].append(elapsed)
    result = {"settings": vars(args), "packed": {dt: bool(f.llama is not None and f.llama.packed)
                                                for dt, f in forwards.items()},
              "machine": machine_info(), "q4_amx": q4_amx(True), "q4_seven": q4_seven(True), "ms": {},
              "ratio_to_one_token": {}}
    for dt in dtypes:
        med = {t: 1000 * statistics.median(v) for t, v in times[dt].items()}
        result["ms"][dt] = med
        result["ratio_to_one_token"][dt] = {t: med[t] / med[1] for t in counts} if 1 in med else {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for dt in dtypes:
        print(dt, " ".join(f"T={t}: {result['ms'][dt][t]:.1f} ms" for t in counts))
    print("written", args.out)


if __name__ == "__main__":
    main()
