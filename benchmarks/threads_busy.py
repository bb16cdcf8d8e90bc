"""Threads on a busy machine: plain decoding (``ar``) for each thread setting and OpenMP wait policy, on a quiet
machine and beside one busy neighbour process (:mod:`speculant.core.threads`).

Settings: ``--threads`` in {1, 2, auto} x wait policy in {active, passive, unset (the runtime's own: spin a while,
then sleep), spin20k (GNU OpenMP's spin cut to 20,000 rounds)} x {quiet, busy: one ``python -c 'while True: pass'``
child started before the run and killed after}.
Each run is a fresh subprocess (the wait policy is read once, when torch is imported; ``auto`` samples the CPU
load when the model loads, so it sees the neighbour), without ``OMP_NUM_THREADS`` (which ``auto`` would keep).
A run loads the target, warms up with one short generation, then times ``--max-new-tokens`` greedy tokens (no
early stop). Settings are interleaved, their order rotated each repeat; medians of ``--repeats`` runs.

Writes ``results.json`` (every run, medians, machine info: CPU model, cores, torch's parallel info) and
``results.md`` (a table per target: tokens/s quiet and busy, busy/quiet, passive/active) to ``--out``.

    python benchmarks/threads_busy.py                                   # default-target, 5 repeats
    python benchmarks/threads_busy.py --target default-target --target smollm2-135m-instruct
    python benchmarks/threads_busy.py --repeats 1 --max-new-tokens 8 --threads 1,auto --waits passive \\
        --out /tmp/threads-smoke                                          # a smoke run

Run it on an otherwise quiet machine: the "quiet" column assumes nothing else runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path("benchmarks/results/threads-busy-spin")
PROMPT = "def fibonacci(n):\n    "
WAITS = {"active": {"OMP_WAIT_POLICY": "ACTIVE"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "unset": {},
         "spin20k": {"GOMP_SPINCOUNT": "20000"}}  # spin20k: GNU OpenMP spins 20,000 rounds, then sleeps
NEIGHBOURS = ("quiet", "busy")
BUSY = "while True: pass"


# ---------------------------------------------------------------------------------------------- child


def child(target: str, threads: str, max_new_tokens: int) -> None:
    """One run, in its own process: load, warm up, time; one JSON line on stdout."""
    import logging

    import torch

    import speculant
    from speculant.core.threads import auto_threads

    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    session = speculant.load(target, method="ar", device="cpu", threads=threads if threads == "auto" else int(threads))
    load_s = time.perf_counter() - t0
    session.generate(PROMPT, max_new_tokens=8, temperature=0, eos_token_id=[])  # warm-up
    gen = session.generate(PROMPT, max_new_tokens=max_new_tokens, temperature=0, eos_token_id=[])
    print(json.dumps({
        "torch_threads": torch.get_num_threads(),
        "auto": auto_threads().message if threads == "auto" else None,
        "tokens_per_second": gen.stats.tokens_per_second,
        "new_tokens": gen.stats.new_tokens,
        "wall_s": gen.stats.wall_s,
        "load_s": load_s,
    }))


def machine_child() -> None:
    """Torch's view of the machine, in a fresh process with the runtime's own settings."""
    import torch
    import transformers

    import speculant
    from speculant.core.threads import available_cores

    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "speculant": speculant.__version__, "torch_default_threads": torch.get_num_threads(),
                      "available_cores": available_cores(), "parallel_info": torch.__config__.parallel_info()}))


# ---------------------------------------------------------------------------------------------- parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def child_env(wait: dict[str, str]) -> dict[str, str]:
    """The environment of a run: this one without OMP_NUM_THREADS (``auto`` would keep it) and without any wait
    setting, plus ``wait`` (a :data:`WAITS` entry)."""
    drop = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **wait}


def run_one(target: str, threads: str, wait: str, neighbour: str, max_new_tokens: int, timeout: float) -> dict:
    """One setting in a fresh subprocess, beside a busy neighbour when ``neighbour == "busy"``."""
    busy = None
    if neighbour == "busy":
        busy = subprocess.Popen([sys.executable, "-c", BUSY])
        time.sleep(0.5)  # running before the run starts, so that auto's sample sees it
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--target", target, "--threads", threads,
             "--max-new-tokens", str(max_new_tokens)],
            env=child_env(WAITS[wait]), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(runs: list[dict]) -> list[dict]:
    """Medians per (target, threads, wait, neighbour)."""
    rows = []
    key = lambda r: (r["target"], r["threads"], r["wait"], r["neighbour"])  # noqa: E731
    for k, group in itertools.groupby(sorted(runs, key=key), key=key):
        group = [r for r in group if "tokens_per_second" in r]
        rows.append({"target": k[0], "threads": k[1], "wait": k[2], "neighbour": k[3], "runs": len(group),
                     "tokens_per_second": median([r["tokens_per_second"] for r in group]),
                     "torch_threads": sorted({r["torch_threads"] for r in group}),
                     "auto": sorted({r["auto"] for r in group if r.get("auto")})})
    return rows


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    out = ["# Threads on a busy machine", "",
           f"Plain decoding (ar), {s['max_new_tokens']} greedy tokens after a one-generation warm-up, each run a "
           f"fresh process; median of {s['repeats']} run(s). Busy: one `python -c '{BUSY}'` process beside the "
           f"run. {m['cpu_model']}, {m['cpu_count']} CPUs ({m['available_cores']} usable), torch {m['torch']}, "
           f"speculant {m['speculant']}. Source: `results.json` (torch's parallel info there).", ""]
    rows = {(r["target"], r["threads"], r["wait"], r["neighbour"]): r for r in result["medians"]}
    for target in s["targets"]:
        out += [f"## {target}", "",
                "| threads | wait | quiet tok/s | busy tok/s | busy / quiet | threads used (quiet / busy) |",
                "|---|---|---:|---:|---:|---|"]
        for threads in s["threads"]:
            for wait in s["waits"]:
                q, b = rows.get((target, threads, wait, "quiet")), rows.get((target, threads, wait, "busy"))
                tq, tb = (r["tokens_per_second"] if r else None for r in (q, b))
                used = " / ".join(",".join(map(str, r["torch_threads"])) if r else "-" for r in (q, b))
                out.append(f"| {threads} | {wait} | {fmt(tq)} | {fmt(tb)} | "
                           f"{fmt(tb / tq if tq and tb else None, '.2f')} | {used} |")
        if "active" in s["waits"] and "passive" in s["waits"]:
            out += ["", "Passive / active wait (tokens/s ratio): " + "; ".join(
                f"threads {t} {n} " + fmt(
                    (rows[(target, t, "passive", n)]["tokens_per_second"] or 0)
                    / rows[(target, t, "active", n)]["tokens_per_second"], ".2f")
                for t in s["threads"] for n in NEIGHBOURS
                if rows.get((target, t, "active", n), {}).get("tokens_per_second")
                and (target, t, "passive", n) in rows)]
        autos = sorted({a for r in result["medians"] if r["target"] == target for a in r["auto"]})
        if autos:
            out += ["", "auto chose: " + "; ".join(autos)]
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", default=None,
                    help="target model (repeatable); default: default-target")
    ap.add_argument("--threads", default="1,2,auto", help="thread settings, comma-separated (default: %(default)s)")
    ap.add_argument("--waits", default="active,passive,unset",
                    help="wait policies, comma-separated, of active, passive, unset, spin20k (default: %(default)s)")
    ap.add_argument("--neighbours", default="quiet,busy", help="quiet, busy or both (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per setting (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="timed tokens per run (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--machine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    targets = args.target or ["default-target"]
    if args.machine:
        return machine_child()
    if args.child:
        return child(targets[0], args.threads, args.max_new_tokens)

    threads = [t.strip() for t in args.threads.split(",") if t.strip()]
    waits = [w.strip() for w in args.waits.split(",") if w.strip()]
    neighbours = [n.strip() for n in args.neighbours.split(",") if n.strip()]
    for name, values, known in (("--waits", waits, WAITS), ("--neighbours", neighbours, NEIGHBOURS)):
        if not values or any(v not in known for v in values):
            sys.exit(f"threads_busy: error: {name} takes {', '.join(known)}, got {','.join(values)!r}")
    if not threads or any(t != "auto" and not (t.isdigit() and int(t) >= 1) for t in threads):
        sys.exit(f"threads_busy: error: --threads takes auto or integers >= 1, got {args.threads!r}")

    info = subprocess.run([sys.executable, __file__, "--machine"], env=child_env({}), capture_output=True,
                          text=True, check=True)
    machine = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "python": sys.version.split()[0], "load_average_at_start": os.getloadavg(),
               **json.loads(info.stdout.strip().splitlines()[-1])}
    settings = list(itertools.product(targets, threads, waits, neighbours))
    runs = []
    t0 = time.perf_counter()
    for r in range(args.repeats):
        shift = r % len(settings)
        for target, t, wait, neighbour in settings[shift:] + settings[:shift]:  # rotated: no setting always first
            row = run_one(target, t, wait, neighbour, args.max_new_tokens, args.timeout)
            runs.append({"target": target, "threads": t, "wait": wait, "neighbour": neighbour, "repeat": r, **row})
            tps = row.get("tokens_per_second")
            print(f"[{time.perf_counter() - t0:6.0f} s] {target} threads={t} wait={wait} {neighbour}: "
                  + (f"{tps:.1f} tok/s ({row['torch_threads']} threads)" if tps else row.get("error", "?")),
                  file=sys.stderr, flush=True)
    result = {"settings": {"targets": targets, "threads": threads, "waits": waits, "neighbours": neighbours,
                           "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "prompt": PROMPT},
              "machine": machine, "medians": summarise(runs), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
