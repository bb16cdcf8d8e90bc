"""What sampling costs over a large vocabulary: drawing a token and top-p's cut, the present routines against the ones they replaced,
alone and in sampled speculative decoding of a real pair.

Every sampled step warps several rows (the target's verification rows, the draft's proposals) and draws several
tokens (the draft's proposals, the correction or the bonus), each over the whole vocabulary.

- Drawing: ``torch.multinomial`` (before) draws V exponentials per token on a CPU; ``speculant.core.sampling.sample``
  (now) inverts the float64 cumulative distribution in two levels (block sums, then inside one block); a tree's
  i.i.d. draws, one ``torch.multinomial`` over its rows before, are one ``sample`` per row now (``sample_rows``).
- Top-p: the full sort of every row (before) against :func:`speculant.core.sampling.nucleus` (now), which sorts
  only the head of the distribution (``torch.topk``, grown while it holds less than top_p).

The script times each piece on the same inputs (interleaved rounds, medians), then decodes code-chat prompts with
plain decoding and the target's default method at temperature 0.7, top-k 20 and top-p 0.8 (a common chat
setting), once with today's pieces and once with both replaced by the earlier ones (monkeypatched where the engine
and the drafters use them), after a warm-up. Every answer runs to ``--max-new-tokens`` (the end-of-turn token does
not stop it). The two variants draw different tokens from the same seeds, so τ differs between them: the time spent
inside the pieces per token (timed around every call) is the direct comparison, tokens/s the end result.

    python benchmarks/sampler_cost.py --target qwen2.5-coder-1.5b-instruct --out benchmarks/results/sampler-cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import contextmanager

import torch

import speculant
import speculant.core.verification
import speculant.drafters.model
import speculant.drafters.trees
from speculant.core import sampling
from speculant.core.types import SamplingParams
from speculant.data.prompts import load_prompts

_USERS = (speculant.core.verification, speculant.drafters.model, speculant.drafters.trees)  # modules that sample


def _multinomial(probs: torch.Tensor, generator: torch.Generator) -> int:
    """The draw ``sample`` replaced."""
    return int(torch.multinomial(probs, 1, generator=generator))


def _sorted_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``warp`` as it was: top-p from a full sort of every row."""
    if params.greedy or params.top_p is None or params.top_p >= 1.0:
        return sampling.warp(logits, params)  # (top-k alone now takes the fast path: not timed here)
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    before = sorted_probs.cumsum(-1) - sorted_probs
    drop_sorted = before >= params.top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf")).softmax(-1)


def _multinomial_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The rows' draws ``sample_rows`` replaced (a tree's i.i.d. draws): one ``torch.multinomial`` for all rows."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


VARIANTS = {"now": {"sample": sampling.sample, "sample_rows": sampling.sample_rows, "warp": sampling.warp},
            "before": {"sample": _multinomial, "sample_rows": _multinomial_rows, "warp": _sorted_warp}}


@contextmanager
def sampling_with(name: str, clock: dict[str, float]):
    """The engine and the drafters draw and warp with ``VARIANTS[name]``; ``clock`` sums calls and seconds (draws:
    ``sample`` and ``sample_rows`` together)."""

    def timed(fn, key):
        def call(*args):
            start = time.perf_counter()
            out = fn(*args)
            clock[key] += time.perf_counter() - start
            clock[key + "_calls"] += 1
            return out
        return call

    saved = []
    for module in _USERS:
        for attr, fn in VARIANTS[name].items():
            if hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, timed(fn, "warp" if attr == "warp" else "draw"))
    try:
        yield
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)


def _median_us(fns: dict, args: tuple, calls: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn(*args)
    for r in range(rounds):
        for name, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            times[name].append(1e6 * (time.perf_counter() - start) / calls)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def micro(rounds: int = 5) -> dict:
    """Median microseconds per call of each piece, now and before."""
    out: dict = {"draw_us": {}, "warp_us": {}}
    gen = torch.Generator().manual_seed(0)
    for vocab in (49_152, 151_936):
        probs = (torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 3).softmax(-1)
        out["draw_us"][str(vocab)] = _median_us({k: v["sample"] for k, v in VARIANTS.items()}, (probs, gen), 100,
                                                rounds)
    logits = torch.randn(4, 151_936, generator=torch.Generator().manual_seed(1)) * 3
    for name, params in (("top_p=0.8", SamplingParams(temperature=0.7, top_p=0.8)),
                         ("top_k=20,top_p=0.8", SamplingParams(temperature=0.7, top_k=20, top_p=0.8))):
        for rows in (1, 4):
            out["warp_us"][f"{name},rows={rows}"] = _median_us({k: v["warp"] for k, v in VARIANTS.items()},
                                                               (logits[:rows], params), 10, rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", type=int, default=2, help="builtin:code-chat prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                    "torch": torch.__version__, "micro": micro()}
    print(json.dumps(result["micro"]), flush=True)
    session = speculant.load(args.target, threads=args.threads)
    rows = load_prompts("builtin:code-chat", args.prompts)
    methods = ["ar", session.method.spec]
    options = dict(max_new_tokens=args.max_new_tokens, temperature=0.7, top_k=20, top_p=0.8, eos_token_id=[])
    session.generate(rows[0]["messages"][-1]["content"], **{**options, "max_new_tokens": 8})  # warm-up
    runs: dict[str, dict[str, list]] = {}
    for r in range(args.repeats):
        for method in methods:
            for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):  # alternating who goes first
                clock = {"draw": 0.0, "draw_calls": 0, "warp": 0.0, "warp_calls": 0}
                tokens = seconds = steps = 0
                with sampling_with(name, clock):
                    for i, row in enumerate(rows):
                        g = session.generate(row["messages"][-1]["content"], method=method, seed=1000 * r + i,
                                             **options)
                        tokens += len(g.token_ids)
                        seconds += g.stats.wall_s - g.stats.prefill_s  # decoding, after the prompt
                        steps += g.stats.target_calls
                run = runs.setdefault(f"{method}|{name}", {k: [] for k in (
                    "tokens_per_s", "tau", "ms_per_token", "draw_ms_per_token", "warp_ms_per_token",
                    "draws_per_token", "warps_per_token")})
                run["tokens_per_s"].append(round(tokens / seconds, 2))
                run["tau"].append(round(tokens / steps, 2))
                run["ms_per_token"].append(round(1e3 * seconds / tokens, 2))
                for piece in ("draw", "warp"):
                    run[f"{piece}_ms_per_token"].append(round(1e3 * clock[piece] / tokens, 2))
                    run[f"{piece}s_per_token"].append(round(clock[f"{piece}_calls"] / tokens, 2))
                print(f"{method}|{name}", {k: v[-1] for k, v in run.items()}, flush=True)
    medians = {k: {m: statistics.median(v[m]) for m in v} for k, v in runs.items()}
    result.update(target=args.target, methods=methods, sampling=options, prompts=args.prompts, runs=runs,
                  medians=medians,
                  speedup={m: round(medians[f"{m}|now"]["tokens_per_s"] / medians[f"{m}|before"]["tokens_per_s"], 3)
                           for m in methods})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["speedup"]))


if __name__ == "__main__":
    main()
