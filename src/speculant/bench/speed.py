"""Side-by-side speed runs: every method on every prompt, interleaved per prompt, after a warm-up.

Reported per method: τ (total tokens / total target calls, and the per-prompt median), median tokens/s, the
wall-clock speed-up against ``ar`` as the median of per-prompt time ratios measured in the same run, and the
time split. Everything raw is kept so reports can be regenerated from the JSON.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..drafters.base import Drafter
from ..engine import generate

__all__ = ["MethodRun", "machine_info", "run_side_by_side", "summarise"]


@dataclass
class MethodRun:
    """A method to compare: ``make()`` returns a fresh drafter (or None for plain decoding)."""

    name: str
    make: Callable[[], Drafter | None]


def machine_info() -> dict:
    import transformers

    from .. import __version__

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "speculant": __version__,
    }


def run_side_by_side(
    target: torch.nn.Module,
    methods: Sequence[MethodRun],
    prompts: Sequence[list[int]],
    max_new_tokens: int = 128,
    repeats: int = 1,
    warmup: int = 1,
    progress: bool = True,
    **sampling,
) -> dict[str, list[dict]]:
    """Run each method on each prompt ``repeats`` times, methods interleaved per prompt; return raw stats rows."""
    for _ in range(warmup):
        for m in methods:
            generate(target, prompts[0], drafter=m.make(), max_new_tokens=min(32, max_new_tokens), **sampling)
    rows: dict[str, list[dict]] = {m.name: [] for m in methods}
    bar = tqdm(total=repeats * len(prompts) * len(methods), disable=not progress, desc="bench", unit="run",
               file=sys.stderr)
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            for m in methods:
                gen = generate(target, ids, drafter=m.make(), max_new_tokens=max_new_tokens, **sampling)
                rows[m.name].append({"prompt": i, "repeat": r, "token_ids": gen.token_ids, **gen.stats.as_dict()})
                bar.update(1)
    bar.close()
    return rows


def summarise(rows: dict[str, list[dict]], baseline: str = "ar") -> dict[str, dict]:
    """Per-method medians and ratios (speed-up = median over prompts of baseline time / method time)."""
    out: dict[str, dict] = {}
    base = {(r["prompt"], r["repeat"]): r for r in rows.get(baseline, [])}
    for name, rs in rows.items():
        tokens = sum(r["new_tokens"] for r in rs)
        calls = sum(r["target_calls"] for r in rs)
        decode = sum(r["wall_s"] - r["prefill_s"] for r in rs)
        s = {
            "acceptance_length": tokens / calls if calls else 0.0,
            "acceptance_length_median": statistics.median(r["acceptance_length"] for r in rs),
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rs),
            "overhead_share": sum(r["overhead_s"] for r in rs) / decode if decode else 0.0,
            "target_forward_share": sum(r["target_forward_s"] for r in rs) / decode if decode else 0.0,
            "draft_forward_share": sum(r["draft_forward_s"] for r in rs) / decode if decode else 0.0,
            "runs": len(rs),
        }
        if base:
            ratios = [base[(r["prompt"], r["repeat"])]["wall_s"] / r["wall_s"] for r in rs]
            s["speedup_vs_ar"] = statistics.median(ratios)
            s["speedup_min"], s["speedup_max"] = min(ratios), max(ratios)
            s["identical_to_ar"] = sum(
                r["token_ids"] == base[(r["prompt"], r["repeat"])]["token_ids"] for r in rs
            ) / len(rs)
        out[name] = s
    return out
