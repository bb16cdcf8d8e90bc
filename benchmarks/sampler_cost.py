"""What drawing a token costs: ``speculant.core.sampling.sample`` against ``torch.multinomial``, alone and in
sampled speculative decoding of a real pair.

Every sampled step draws several tokens (the draft's proposals, the correction or the bonus), each from a
distribution over the whole vocabulary. ``torch.multinomial`` draws V exponentials per token on a CPU; ``sample``
inverts the float64 cumulative distribution in two levels (block sums, then inside one block). This script times
both on the same distributions (interleaved rounds, medians), then decodes code-chat prompts at temperature 0.7
with the target's default method and plain decoding, once with each sampler (the engine's draws monkeypatched to
``torch.multinomial`` for the comparison), after a warm-up. The two samplers draw different tokens from the same
seeds, so τ and the answers' lengths differ between them: the time spent inside the sampler per token
(``draw_ms_per_token``, timed around every draw) is the direct comparison, tokens/s the end result (every answer
runs to ``--max-new-tokens``: the end-of-turn token does not stop it, so both samplers decode as many tokens).

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
from speculant.core.sampling import sample
from speculant.data.prompts import load_prompts

_USERS = (speculant.core.verification, speculant.drafters.model, speculant.drafters.trees)  # modules that draw


def _multinomial(probs: torch.Tensor, generator: torch.Generator) -> int:
    """The sampler ``sample`` replaced (up to session 28)."""
    return int(torch.multinomial(probs, 1, generator=generator))


SAMPLERS = {"sample": sample, "multinomial": _multinomial}


@contextmanager
def drawing_with(name: str, counter: list[float]):
    """The engine and the drafters draw with ``SAMPLERS[name]``; ``counter`` gets the draws and their seconds."""
    fn = SAMPLERS[name]

    def counted(probs, generator):
        start = time.perf_counter()
        token = fn(probs, generator)
        counter[0] += 1
        counter[1] += time.perf_counter() - start
        return token

    saved = [m.sample for m in _USERS]
    for m in _USERS:
        m.sample = counted
    try:
        yield
    finally:
        for m, s in zip(_USERS, saved):
            m.sample = s


def micro(vocab: int, draws: int, rounds: int) -> dict[str, float]:
    """Median microseconds per draw of each sampler from one softmax over ``vocab`` tokens."""
    probs = (torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 3).softmax(-1)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in SAMPLERS}
    for fn in SAMPLERS.values():
        fn(probs, gen)
    for _ in range(rounds):
        for name, fn in SAMPLERS.items():
            t = time.perf_counter()
            for _ in range(draws):
                fn(probs, gen)
            times[name].append(1e6 * (time.perf_counter() - t) / draws)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", type=int, default=2, help="builtin:code-chat prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                    "torch": torch.__version__,
                    "micro_us_per_draw": {str(v): micro(v, 200, 5) for v in (49_152, 151_936)}}
    print(json.dumps(result["micro_us_per_draw"]), flush=True)
    session = speculant.load(args.target, threads=args.threads)
    rows = load_prompts("builtin:code-chat", args.prompts)
    methods = ["ar", session.method.spec]
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos_token_id=[])  # fixed length
    session.generate(rows[0]["messages"][-1]["content"], max_new_tokens=8, temperature=args.temperature)  # warm-up
    runs: dict[str, dict[str, list]] = {}
    for r in range(args.repeats):
        for method in methods:
            for name in SAMPLERS:
                counter = [0, 0.0]
                tokens = seconds = steps = 0
                with drawing_with(name, counter):
                    for i, row in enumerate(rows):
                        g = session.generate(row["messages"][-1]["content"], method=method, seed=1000 * r + i,
                                             **options)
                        tokens += len(g.token_ids)
                        seconds += g.stats.wall_s - g.stats.prefill_s  # decoding, after the prompt
                        steps += g.stats.target_calls
                key = f"{method}|{name}"
                run = runs.setdefault(key, {"tokens_per_s": [], "tau": [], "draws_per_token": [],
                                            "draw_ms_per_token": [], "ms_per_token": []})
                run["tokens_per_s"].append(round(tokens / seconds, 2))
                run["tau"].append(round(tokens / steps, 2))
                run["draws_per_token"].append(round(counter[0] / tokens, 2))
                run["draw_ms_per_token"].append(round(1e3 * counter[1] / tokens, 2))
                run["ms_per_token"].append(round(1e3 * seconds / tokens, 2))
                print(key, run["tokens_per_s"][-1], "tokens/s, tau", run["tau"][-1], "drawing",
                      run["draw_ms_per_token"][-1], "of", run["ms_per_token"][-1], "ms per token", flush=True)
    result.update(target=args.target, methods=methods, temperature=args.temperature, prompts=args.prompts,
                  new_tokens=args.max_new_tokens, runs=runs,
                  median_tokens_per_s={k: statistics.median(v["tokens_per_s"]) for k, v in runs.items()})
    result["median_draw_ms_per_token"] = {k: statistics.median(v["draw_ms_per_token"]) for k, v in runs.items()}
    result["median_ms_per_token"] = {k: statistics.median(v["ms_per_token"]) for k, v in runs.items()}
    result["speedup"] = {m: round(result["median_tokens_per_s"][f"{m}|sample"]
                                  / result["median_tokens_per_s"][f"{m}|multinomial"], 3) for m in methods}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["median_tokens_per_s"]), json.dumps(result["median_draw_ms_per_token"]),
          json.dumps(result["speedup"]))


if __name__ == "__main__":
    main()
