"""``speculant kv-eval``: fidelity, retrieval accuracy and peak KV memory of eviction policies under a budget.

Output: a table on stdout, or with ``--json`` one JSON object on its LAST line:
``{"results": [{"policy", "budget", "top1_agreement", "kl", "nll_ratio", "retrieval_accuracy", "per_file", ...}],
"memory": [{"prompt_tokens", "full_peak_kv_bytes", "budget_peak_kv_bytes", ...}], "settings": {...}}``.
With ``--out DIR`` the same object is written to ``DIR/kv_results.json``. A progress bar over the policy x budget
grid goes to stderr. Bad input raises ValueError (reported as one line by ``speculant.cli.main``). Defaults come
from :class:`speculant.kv.evaluate.EvalConfig`. The one-line help of ``speculant --help`` is in
``speculant.cli.COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, fields
from pathlib import Path

from ..checks import context_length, resolve_device, warn_policy_nesting
from ..kv.evaluate import RETRIEVAL_FORMATS, EvalConfig, run_eval
from ..kv.registry import parse_policy, policy_names
from .common import add_device_argument, add_threads_argument, set_threads

__all__ = ["DESCRIPTION", "add_arguments", "run"]

log = logging.getLogger(__name__)

DESCRIPTION = (
    "For each policy and budget: teacher-forced fidelity to the full cache on held-out token sequences (mean "
    "next-token KL, top-1 agreement, NLL ratio, averaged over the sequences; block-wise prefill then token-by-token "
    "decoding with eviction), accuracy on a synthetic dict retrieval task, and peak KV bytes of a full vs a "
    "block-wise budgeted prefill. "
    f"Policies: {', '.join(policy_names())} (wrappers prefix a base policy, e.g. caote:h2o)."
)
_DEFAULTS = EvalConfig()
_HELPS = {
    "policies": "comma-separated policy specs",
    "budgets": "comma-separated token budgets per layer (default: --budget-fraction of each prompt)",
    "budget_fraction": "budget as a fraction of each prompt's length when --budgets is not given",
    "block": "block size B of the block-wise prefill",
    "files": "held-out stdlib modules (the longest) for the fidelity sequences when --text is not given",
    "seq_len": "tokens of each fidelity sequence (the start of each text)",
    "tail": "next-token predictions scored at the end of each fidelity sequence (decoded one by one)",
    "retrieval_format": f"retrieval query: {' or '.join(RETRIEVAL_FORMATS)} (see speculant.kv.evaluate)",
    "retrieval_pairs": "key/value pairs in each retrieval prompt",
    "retrieval_examples": "retrieval prompts",
    "memory_lengths": "comma-separated prompt lengths for the memory profile",
    "seed": "seed of the synthetic data",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``kv-eval``; defaults are :class:`EvalConfig`'s."""
    p.add_argument("--target", default="default-target", help="model directory or bundled name (%(default)s)")
    p.add_argument("--text", nargs="+", default=None,
                   help="text file(s) for the fidelity sequences (default: the --files longest held-out modules)")
    p.add_argument("--out", default=None, help="directory to write kv_results.json into")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    add_threads_argument(p)
    add_device_argument(p, "the target model")
    for f in fields(EvalConfig):
        default = getattr(_DEFAULTS, f.name)
        kind = type(default) if default is not None else str
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default,
                       help=f"{_HELPS[f.name]} ({default})")


def _config(args: argparse.Namespace) -> EvalConfig:
    cfg = EvalConfig(**{f.name: getattr(args, f.name) for f in fields(EvalConfig)})
    for spec in cfg.policies.split(","):
        warn_policy_nesting(parse_policy(spec))  # one-line ValueError for an unknown name
    for name in ("budgets", "memory_lengths"):
        value = getattr(cfg, name)
        if value and not all(v.strip().isdigit() and int(v) > 0 for v in value.split(",")):
            raise ValueError(f"--{name.replace('_', '-')} must be comma-separated positive integers, got {value!r}")
    if not 0 < cfg.budget_fraction <= 1:
        raise ValueError(f"--budget-fraction must be in (0, 1], got {cfg.budget_fraction}")
    if cfg.retrieval_format not in RETRIEVAL_FORMATS:
        known = ", ".join(RETRIEVAL_FORMATS)
        raise ValueError(f"--retrieval-format must be one of {known}, got {cfg.retrieval_format!r}")
    for name in ("block", "files", "seq_len", "tail", "retrieval_pairs", "retrieval_examples"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    return cfg


def _check_context(model, cfg: EvalConfig) -> None:
    """Sequences longer than the model's context are refused, as ``generate`` refuses long prompts."""
    ctx = context_length(model)
    if ctx is None:
        return
    if cfg.seq_len > ctx:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the target model's context of {ctx} tokens")
    lengths = [int(n) for n in cfg.memory_lengths.split(",") if n.strip()]
    if lengths and max(lengths) > ctx:
        raise ValueError(f"--memory-lengths: {max(lengths)} tokens exceed the target model's context of {ctx} tokens")


def _runs(cfg: EvalConfig) -> int:
    """Policy x budget evaluations :func:`run_eval` makes (one budget per policy without --budgets)."""
    policies = [p for p in cfg.policies.split(",") if p.strip()]
    budgets = [b for b in cfg.budgets.split(",") if b.strip()] if cfg.budgets else [None]
    return len(policies) * len(budgets)


def run(args: argparse.Namespace) -> int:
    """Run the evaluation; print a table (or the JSON line); return the exit code."""
    from tqdm.auto import tqdm

    from ..loading import load_model_dir, resolve_model

    cfg = _config(args)
    device = resolve_device(args.device)
    set_threads(args.threads)
    model, tokenizer = load_model_dir(resolve_model(args.target))
    _check_context(model, cfg)
    model.to(device)
    text = {str(f): Path(f).read_text() for f in args.text} if args.text else None

    with tqdm(total=_runs(cfg), desc="kv-eval", unit="run", file=sys.stderr) as bar:
        def progress(row: dict) -> None:
            log.info("kv-eval %s", row)
            bar.set_postfix_str(f"{row['policy']} budget={row['budget']}")
            bar.update()

        report = run_eval(model, tokenizer, cfg, text, progress=progress)
    report["settings"] = {**asdict(cfg), "target": str(args.target)}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kv_results.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{'policy':<22}{'budget':>8}{'top1':>8}{'± se':>7}{'KL':>10}{'± se':>8}{'NLL ratio':>11}{'retrieval':>11}")
    for r in report["results"]:
        print(f"{r['policy']:<22}{r['budget']:>8}{r['top1_agreement']:>8.3f}{r['top1_agreement_se']:>7.3f}"
              f"{r['kl']:>10.4f}{r['kl_se']:>8.4f}{r['nll_ratio']:>11.3f}{r['retrieval_accuracy']:>11.2f}")
    if report["results"]:
        r = report["results"][0]
        print(f"full cache: retrieval accuracy {r['full_retrieval_accuracy']:.2f}, answer NLL "
              f"{r['full_retrieval_answer_nll']:.3f} (budgeted answer NLL per row in --json)")
    for m in report["memory"]:
        print(f"prompt {m['prompt_tokens']:>6} tokens: full KV {m['full_peak_kv_bytes']:>12,} B, "
              f"budget {m['budget']} + block {m['block']}: {m['budget_peak_kv_bytes']:>12,} B")
    return 0
