"""First and later load times of the packaged Qwen2.5-Coder models (docs/results/bundled-pair.md).

Each load runs in a fresh Python process (imports included in neither figure: they are timed apart), 2 threads:
"first" in an empty SPECULANT_CACHE (assembling the parts, checking the SHA-256, deriving config and tokenizer),
in the model's packaged quantization (file for the 1.5B, q4 for the 0.5B: what ``speculant`` loads by default; the
quantized matrices are then cached, :mod:`speculant.models.matrix_cache`), "later" against the filled cache, in that
quantization and unquantized in float32 and bfloat16. Writes JSON with machine info:

    python benchmarks/qwen_load.py --out benchmarks/results/qwen-load.json --readme docs/results/bundled-pair.md

``--readme`` rewrites the page's block between ``<!-- qwen-load:start -->`` and ``<!-- qwen-load:end -->``;
``--render`` only re-renders it from an existing ``--out`` file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, resource, sys, time
import torch
torch.set_num_threads(2)
from speculant.models.loading import load_pretrained, resolve_model
name, dtype, quantization = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter(); resolve_model(name); t1 = time.perf_counter()
model, tok = load_pretrained(name, dtype=dtype, quantization=quantization); t2 = time.perf_counter()
print(json.dumps({"resolve_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def run(name: str, dtype: str, quantization: str, cache: str) -> dict:
    env = dict(os.environ, SPECULANT_CACHE=cache)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD, name, dtype, quantization], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(result: dict, source: str) -> str:
    """The README block: one row per model and load, from ``result`` (this script's JSON)."""
    lines = ["| model | load | dtype | weights | seconds | peak RSS (GB) |", "|---|---|---|---|---:|---:|"]
    disk = {r["model"]: r["cache_bytes"] for r in result["rows"] if "cache_bytes" in r}
    for r in result["rows"]:
        if "phase" in r:
            lines.append(f"| {r['model']} | {r['phase']} | {r['dtype']} | {r.get('quantization', 'none')} | "
                         f"{r['total_s']:.1f} | {r['peak_rss_gb']:.1f} |")
    cache = ", ".join(f"{m} {b / 1e9:.2f} GB" for m, b in disk.items())
    cpu = result["machine"].get("cpu")
    return "\n".join(lines) + (f"\n\nCache on disk after loading: {cache}. " if cache else "\n\n") + (
        f"{cpu + ', ' if cpu else ''}load average {result['machine']['load_average'][0]:.1f} on "
        f"{result['machine']['cpus']} cores at the end (upper bounds where others ran); `{source}`, {result['date']}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--out", required=True)
    parser.add_argument("--readme", help="rewrite this page's qwen-load block from the results")
    parser.add_argument("--render", action="store_true", help="do not measure: render --out into --readme")
    args = parser.parse_args()
    if not args.render:
        measure(args)
    if args.readme:
        from readme_table import rewrite  # benchmarks/readme_table.py, next to this script

        with open(args.out) as f:
            block = table(json.load(f), args.out)
        with open(args.readme) as f:
            text = f.read()
        with open(args.readme, "w") as f:
            f.write(rewrite(text, block, "qwen-load"))


def measure(args: argparse.Namespace) -> None:
    rows = []
    from speculant.core.kernels import cpu_info
    from speculant.models.sources import PACKAGED

    for name in args.models.split(","):
        own = PACKAGED[name].default_quantization or "none"
        with tempfile.TemporaryDirectory(prefix="speculant-cache-") as cache:
            for phase, dtype, kind in (("first", "float32", own), ("later", "float32", own),
                                       ("later", "float32", "none"), ("later", "bfloat16", "none")):
                row = {"model": name, "phase": phase, "dtype": dtype, "quantization": kind,
                       **run(name, dtype, kind, cache)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs)
            rows.append({"model": name, "cache_bytes": disk})
    result = {"rows": rows, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu_info()[0],
                                       "python": platform.python_version(),
                                       "load_average": os.getloadavg()},
              "note": "2 threads; the machine was shared (load average above), so times are upper bounds",
              "date": time.strftime("%Y-%m-%d %H:%M")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
