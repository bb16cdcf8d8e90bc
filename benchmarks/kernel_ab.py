"""The target's forward with the compiled kernels of an earlier revision and of the working tree, interleaved.

For kernel work (``src/speculant/core/csrc``): both builds run the same lean forward of ``--target`` over the same
cache (a random prompt of ``--context`` tokens), a forward of T new tokens for each T in ``--tokens``, alternating
build by build within every repeat (the first two repeats are warm-up); the medians are reported with their ratio,
and the logits of the two builds are compared bit for bit (a kernel change that is meant to be faster only must
give the same bits). The builds come from ``git show REV:src/speculant/core/csrc/...`` (``--base``, default HEAD) and
from the working tree (with ``--base HEAD`` on a clean tree both are the same library: an A/A run, the noise).

    python benchmarks/kernel_ab.py --base HEAD --target qwen2.5-coder-1.5b-instruct --out benchmarks/results/kernel_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from speculant.bench.speed import machine_info
from speculant.core import kernels
from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers
from speculant.core.target_forward import TargetForward
from speculant.models.loading import load_pretrained

CSRC = "src/speculant/core/csrc"


def sources_at(revision: str, folder: Path) -> Path:
    """The kernel sources of ``revision`` written into ``folder``."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    for source in kernels.SOURCES:
        text = subprocess.run(["git", "show", f"{revision}:{CSRC}/{source.name}"], cwd=root, capture_output=True,
                              text=True, check=True).stdout
        (folder / source.name).write_text(text)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels are the baseline (default: HEAD)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantization", default="file")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/kernel_ab.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": kernels.build_of(sources_at(args.base, Path(tmp))), "new": kernels.library()}
    if builds["new"] is None:
        raise SystemExit("the working tree's kernels could not be built")
    model = load_pretrained(args.target, dtype=args.dtype, quantization=args.quantization)[0]
    forward = TargetForward(model, "lean")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab, (1, args.context), generator=gen)
    new_ids = torch.randint(100, vocab, (1, max(counts)), generator=gen)
    cache = SpecCache(num_layers(model), capacity=args.context + max(counts))
    times = {b: {t: [] for t in counts} for b in builds}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    with torch.inference_mode():
        with kernels.using(builds["base"]):
            forward.prefill(cache, prompt)
        for rep in range(args.repeats + 2):
            for t in counts:
                for name, lib in builds.items():
                    with kernels.using(lib):
                        start = time.perf_counter()
                        out = forward(cache, input_ids=new_ids[:, :t])
                        elapsed = time.perf_counter() - start
                    cache.crop(args.context)
                    logits[(name, t)] = out
                    if rep >= 2:
                        times[name][t].append(elapsed)
    ms = {b: {t: 1000 * statistics.median(v) for t, v in per.items()} for b, per in times.items()}
    result = {
        "settings": vars(args),
        "machine": machine_info(),
        "isa": kernels.q4_isa(),
        "ms": ms,
        "new_over_base": {t: ms["new"][t] / ms["base"][t] for t in counts},
        "cost_to_one_token": {b: {t: ms[b][t] / ms[b][counts[0]] for t in counts} for b in builds},
        "identical_logits": {t: bool(torch.equal(logits[("base", t)], logits[("new", t)])) for t in counts},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for b in builds:
        print(b, " ".join(f"T={t}: {ms[b][t]:.1f} ms" for t in counts))
    print("new / base", " ".join(f"T={t}: {r:.3f}" for t, r in result["new_over_base"].items()),
          "identical logits:", all(result["identical_logits"].values()))
    print("written", args.out)


if __name__ == "__main__":
    main()
