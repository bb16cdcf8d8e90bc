"""Side-by-side speed runs: every method on every prompt, interleaved per prompt, after a warm-up.

Reported per method: τ (total tokens / total target calls, and the per-prompt median), the accepted-length
histogram and per-position acceptance (pooled over runs), median tokens/s, the wall-clock speed-up against the
reference (``ar``) as the median over prompts of per-prompt ratios measured in the same run, the time split, and
at temperature 0 whether each output is token-identical to the reference's (with the first differing position of
every mismatch). Everything raw is kept so reports can be regenerated from the JSON.

A per-prompt speed-up is the ratio of tokens/s (method over reference): the ratio of wall times when both
produced the same number of tokens (always at temperature 0 for a lossless method), and still a per-token
comparison when they did not (sampling, or an output that stopped early).
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
from ..core.engine import generate

__all__ = ["MethodRun", "first_difference", "machine_info", "run_side_by_side", "summarise", "summarise_by"]


@dataclass
class MethodRun:
    """A method to compare. Either ``make()`` returns a fresh drafter (None: plain decoding) for
    :func:`speculant.generate`, or ``run(ids, max_new_tokens, **sampling)`` performs one generation itself and
    returns a row: ``token_ids`` plus the :meth:`GenerationStats.as_dict` fields (e.g. a transformers baseline)."""

    name: str
    make: Callable[[], Drafter | None] | None = None
    run: Callable[..., dict] | None = None

    def __call__(self, target: torch.nn.Module, ids: list[int], max_new_tokens: int, **sampling) -> dict:
        if self.run is not None:
            return self.run(ids, max_new_tokens, **sampling)
        drafter = self.make() if self.make is not None else None
        gen = generate(target, ids, drafter=drafter, max_new_tokens=max_new_tokens, **sampling)
        return {"token_ids": gen.token_ids, **gen.stats.as_dict(), "depth_reached": list(gen.stats.depth_reached),
                "depth_accepted": list(gen.stats.depth_accepted)}


_ISA_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
"""CPU features that decide which kernels run (q4 dot products, bf16, AMX tiles): recorded with every result."""


def _cpu() -> dict:
    """The CPU's model name and which of :data:`_ISA_FLAGS` it has (Linux; elsewhere empty)."""
    from ..core.kernels import cpu_info

    name, flags = cpu_info()
    return {"cpu": name, "cpu_flags": [f for f in _ISA_FLAGS if f in flags]} if name or flags else {}


def machine_info() -> dict:
    """Where a result was measured: platform, CPU (model and kernel-relevant features), threads and versions."""
    import transformers

    from .. import __version__

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        **_cpu(),
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
    rotate: bool = False,
    **sampling,
) -> dict[str, list[dict]]:
    """Run each method on each prompt ``repeats`` times, methods interleaved per prompt; return raw stats rows.

    Warm-up: ``warmup`` rounds of every method on the first prompt (at most 32 new tokens), not recorded.
    ``rotate`` starts prompt i's round at method ``i % len(methods)`` so no method always runs first or last.
    Each row holds ``prompt``, ``repeat``, ``order`` (its place in the prompt's round) and what the method returned.
    """
    for _ in range(warmup):
        for m in methods:
            m(target, list(prompts[0]), min(32, max_new_tokens), **sampling)
    rows: dict[str, list[dict]] = {m.name: [] for m in methods}
    bar = tqdm(total=repeats * len(prompts) * len(methods), disable=not progress, desc="bench", unit="run",
               file=sys.stderr)
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            shift = (i + r) % len(methods) if rotate else 0
            for order, m in enumerate([*methods[shift:], *methods[:shift]]):
                row = m(target, list(ids), max_new_tokens, **sampling)
                rows[m.name].append({"prompt": i, "repeat": r, "order": order, **row})
                bar.update(1)
    bar.close()
    return rows


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _pooled(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for values in lists:
        out.extend([0] * (len(values) - len(out)))
        for i, v in enumerate(values):
            out[i] += v
    return out


def summarise(rows: dict[str, list[dict]], baseline: str = "ar", check_identical: bool = True) -> dict[str, dict]:
    """Per-method pooled counts, medians and ratios against ``baseline`` (see the module doc).

    With ``check_identical`` (temperature 0) each method's outputs are compared with the baseline's:
    ``identical_to_ar`` is the fraction of identical runs and ``mismatches`` lists ``{prompt, repeat,
    first_diff}`` for every other run.
    """
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
            "new_tokens": tokens,
            "target_calls": calls,
            "draft_calls": sum(r.get("draft_calls", 0) for r in rs),
            "accepted_hist": _pooled([r.get("accepted_hist", []) for r in rs]),
            "overhead_share": sum(r["overhead_s"] for r in rs) / decode if decode else 0.0,
            "target_forward_share": sum(r["target_forward_s"] for r in rs) / decode if decode else 0.0,
            "draft_forward_share": sum(r["draft_forward_s"] for r in rs) / decode if decode else 0.0,
            "runs": len(rs),
        }
        if all("depth_reached" in r for r in rs):
            reached = _pooled([r["depth_reached"] for r in rs])
            accepted = _pooled([r["depth_accepted"] for r in rs])
            s["position_acceptance"] = [a / n if n else 0.0 for a, n in zip(accepted, reached)]
        if base:
            pairs = [(r, base[(r["prompt"], r["repeat"])]) for r in rs]
            ratios = [
                r["tokens_per_second"] / b["tokens_per_second"] if b["tokens_per_second"] > 0 else 0.0
                for r, b in pairs
            ]
            s["speedup_vs_ar"] = statistics.median(ratios)
            s["speedup_min"], s["speedup_max"] = min(ratios), max(ratios)
            s["speedup_per_run"] = ratios
            if check_identical:
                mismatches = []
                for r, b in pairs:
                    diff = first_difference(r["token_ids"], b["token_ids"])
                    if diff is not None:
                        mismatches.append({"prompt": r["prompt"], "repeat": r["repeat"], "first_diff": diff})
                s["identical_to_ar"] = 1 - len(mismatches) / len(rs)
                s["mismatches"] = mismatches
        out[name] = s
    return out


def summarise_by(rows: dict[str, list[dict]], groups: Sequence[str], baseline: str = "ar") -> dict[str, dict]:
    """Per group (e.g. an MT-Bench category; ``groups[i]`` is prompt i's), per method: ``acceptance_length`` (τ
    pooled over the group's runs), ``speedup_vs_ar`` (median over the group's runs of per-prompt tokens/s ratios
    against ``baseline``: :func:`summarise` on the group's rows), ``tokens_per_second`` (median) and ``runs``.
    Groups in order of first appearance."""
    out: dict[str, dict] = {}
    for group in dict.fromkeys(groups):
        mine = {name: [r for r in rs if groups[r["prompt"]] == group] for name, rs in rows.items()}
        summary = summarise(mine, baseline=baseline, check_identical=False)
        keep = ("acceptance_length", "speedup_vs_ar", "tokens_per_second", "runs")
        out[group] = {name: {k: s[k] for k in keep if k in s} for name, s in summary.items()}
    return out
