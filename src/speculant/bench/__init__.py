"""Benchmarks: prompt sets, side-by-side speed runs, transformers baselines, reports.

>>> results = speculant.bench.run_bench("builtin:code", methods=["chain:k=4"], baselines=["hf-ar", "hf-assisted"],
...                                     num_prompts=4, max_new_tokens=64, out="bench-results")
>>> results["methods"]["chain:k=4"]["speedup_vs_ar"]
"""

from .harness import DEFINITIONS, REFERENCE, run_bench
from .hf import BASELINES, describe_baselines, parse_baseline
from ..data.prompts import BUILTIN_SETS, builtin_prompts, load_prompts, prompt_ids
from .report import category_table, render_markdown, write_results
from .speed import MethodRun, machine_info, run_side_by_side, summarise, summarise_by

__all__ = [
    "BASELINES",
    "BUILTIN_SETS",
    "DEFINITIONS",
    "REFERENCE",
    "MethodRun",
    "builtin_prompts",
    "category_table",
    "describe_baselines",
    "load_prompts",
    "machine_info",
    "parse_baseline",
    "prompt_ids",
    "render_markdown",
    "run_bench",
    "run_side_by_side",
    "summarise",
    "summarise_by",
    "write_results",
]
