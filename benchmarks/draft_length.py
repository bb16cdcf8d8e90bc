"""How many tokens should a draft-model chain propose per step on this machine: fixed lengths against stopping on the
draft's confidence, and what a cheaper drafter of the same acceptance would give.

Greedy verification accepts a chain's tokens up to the first one that differs from the target's own choice, and as
long as they agree the draft's context is the target's output. So one teacher-forced pass of the draft over the
target's plain-decoding answers (the ``ar`` runs of a greedy ``speculant bench`` result) says, at every answer
position, whether the drafter's top token is the target's and how confident the drafter is (its top probability over
its VocabTrim'd head, the head a chain drafts with). Replaying the answers step by step then gives, for any policy
that decides the draft length from the draft's own probabilities, the exact number of accepted tokens per step (the
confidences of draft tokens after a rejected one are the teacher-forced ones: they only decide how many wasted
tokens are proposed). Time per step comes from costs measured here, interleaved, median of ``--repeats``: the target
forward over T = 1 .. K + 1 rows and the draft forward over 1 and 2 rows (with its trimmed head), both at the
answers' typical context. Stopping on the draft's confidence depends only on the draft, so every such policy is
exact (any draft length the draft chooses is verified by the same rule).

Policies (:data:`POLICIES`): ``fixed k=N``; ``stop k<=N t=X`` (draft until a token's probability is below X, that
token still proposed: ``chain:k=N:stop=X``); ``stop-cumulative`` (the same on the product of the drafted tokens'
probabilities); ``drop`` (as ``stop``, the token below X not proposed). Reported: predicted τ and decode-only
speed-up over plain decoding (prefill not counted), and where the results file has measured runs of ``chain:k=N``,
their τ beside the prediction. ``scaled_draft_cost``: every policy again with a draft forward costing a given
fraction of the target's one-token forward (``--draft-costs``; the measured draft's fraction first), the same
acceptance: what a drafter as good as this one but that much cheaper would gain. ``ceiling``: a drafter always right
and free, k + 1 tokens per forward over k + 1 rows (what the target forward's cost in T allows on this machine).

    python benchmarks/draft_length.py --target qwen2.5-coder-1.5b-instruct --repeats 25 \
        --results benchmarks/results/qwen-code-chat-zen3/results.json,benchmarks/results/qwen-mtbench-zen3/results.json \
        --out benchmarks/results/draft-length-zen3.json
    python benchmarks/draft_length.py ... --replay benchmarks/results/draft-length-zen3.json   # new policies, same data

Run it on a quiet machine (the costs are timed; ``--replay`` times nothing and loads no model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import speculant
from speculant.bench.speed import machine_info
from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers, vocab_size
from speculant.core.target_forward import TargetForward, llama_forward_for
from speculant.data.prompts import prompt_ids
from speculant.drafters.vocab_trim import trimmed_head


def draft_head(session):
    """The VocabTrim head a chain of ``session``'s method drafts with (None: the full head)."""
    drafter = session.drafter()
    while not hasattr(drafter, "vocab_trim") and hasattr(drafter, "inner"):  # under a wrapper (lookup=N)
        drafter = drafter.inner
    return trimmed_head(session.draft, drafter.vocab_trim, vocab_size(session.target))


def teacher_forced(session, results: dict) -> list[dict]:
    """Per ``ar`` answer: ``match[i]`` (the drafter's top token is answer token i) and ``conf[i]`` (its probability)."""
    runs = [run for run in results["runs"]["ar"] if not run["repeat"]]
    pairs = [(prompt_ids(results["prompts"][run["prompt"]], session.tokenizer), run["token_ids"]) for run in runs]
    return [{"prompt": run["prompt"], **m} for run, m in zip(runs, draft_matches(session, pairs))]


def draft_matches(session, pairs: list[tuple[list[int], list[int]]]) -> list[dict]:
    """Per (prompt ids, answer ids): the draft's teacher-forced ``match`` and ``conf`` over the answer (above) and
    ``prompt_tokens``."""
    draft = session.draft
    head = draft_head(session)
    lean = llama_forward_for(draft)
    out = []
    for ids, answer in pairs:
        full = torch.tensor([ids + answer])  # [1, P + A]
        cache = SpecCache(num_layers(draft), capacity=full.shape[1] + 8)
        hidden = lean.hidden(full, cache)[0, len(ids) - 1: len(ids) - 1 + len(answer)]  # [A, H]: predict the answer
        logits = (head.logits(hidden) if head is not None else lean.logits(hidden)).float()  # [A, M]
        conf, index = logits.softmax(-1).max(-1)  # [A]
        top = head.keep[index] if head is not None else index
        out.append({"prompt_tokens": len(ids), "match": (top == torch.tensor(answer)).tolist(),
                    "conf": [round(c, 5) for c in conf.tolist()]})
    return out


def measure_costs(session, context: int, rows: int, repeats: int) -> tuple[dict[int, float], dict[int, float]]:
    """Median ms of the target forward over 1..rows new tokens and of the draft forward (+ trimmed head) over 1 and
    2, after ``context`` tokens, interleaved (two warm-up rounds)."""
    target, draft = session.target, session.draft
    head = draft_head(session)
    fwd, lean = TargetForward(target, "auto"), llama_forward_for(draft)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (1, context), generator=gen)
    new = torch.randint(100, 20000, (1, rows), generator=gen)
    tcache = SpecCache(num_layers(target), capacity=context + rows)
    dcache = SpecCache(num_layers(draft), capacity=context + rows)
    fwd.prefill(tcache, prompt)
    lean.hidden(prompt, dcache)
    t_ms: dict[int, list[float]] = {t: [] for t in range(1, rows + 1)}
    d_ms: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(repeats + 2):
        for t in range(1, rows + 1):
            start = time.perf_counter()
            fwd(tcache, input_ids=new[:, :t])
            elapsed = time.perf_counter() - start
            tcache.crop(context)
            if rep >= 2:
                t_ms[t].append(1000 * elapsed)
            if t <= 2:
                start = time.perf_counter()
                h = lean.hidden(new[:, :t], dcache)[0, -1]
                head.logits(h) if head is not None else lean.logits(h)
                elapsed = time.perf_counter() - start
                dcache.crop(context)
                if rep >= 2:
                    d_ms[t].append(1000 * elapsed)
    return ({t: statistics.median(v) for t, v in t_ms.items()}, {t: statistics.median(v) for t, v in d_ms.items()})


POLICIES = ("fixed", "stop", "stop-cumulative", "drop")
"""``fixed``: k tokens; ``stop``: draft until a token's probability is below the threshold, that token still proposed
(transformers' assisted generation); ``stop-cumulative``: the same on the product of the drafted tokens'
probabilities (an estimate of the chance that all are accepted); ``drop``: as ``stop`` but the token below the
threshold is not proposed (its draft forward is spent all the same)."""


def replay(answers: list[dict], policy: tuple[str, int, float], target_ms: dict[int, float],
           draft_ms: dict[int, float]) -> tuple[float, float]:
    """(τ, decode ms per token) of ``policy`` = (kind, k_max, threshold) replayed over the answers (module doc).

    As the engine counts: the prompt's forward (not timed here) commits the first token, then each step drafts at
    most ``min(k_max, remaining - 1)`` tokens, verifies them in one forward over ``kept + 1`` rows and commits the
    accepted ones and the target's next token, never past the answer's end (its end-of-turn token or
    ``max_new_tokens``). τ = tokens / target forwards, the prompt's included."""
    kind, k_max, threshold = policy
    tokens = calls = decoded = 0
    ms = 0.0
    for a in answers:
        match, conf, n = a["match"], a["conf"], len(a["match"])
        i, fed_all = 1, False  # answer token 0 came from the prompt's forward
        tokens, calls = tokens + 1, calls + 1
        while i < n:
            limit = min(k_max, a["max_new_tokens"] - i - 1)
            kept = forwards = 0
            p = 1.0
            while kept < limit and i + kept < n:  # past the answer's end nothing is known (nor emitted)
                forwards += 1
                p = p * conf[i + kept] if kind == "stop-cumulative" else conf[i + kept]
                if kind != "fixed" and p < threshold:
                    kept += kind != "drop"
                    break
                kept += 1
            accepted = 0
            while accepted < kept and match[i + accepted]:
                accepted += 1
            # the first draft forward catches up: 2 rows when the last step accepted a token never fed to the draft
            ms += target_ms[kept + 1]
            if forwards:
                ms += draft_ms[2 if fed_all else 1] + draft_ms[1] * (forwards - 1)
            fed_all = kept > 0 and accepted == kept and forwards == kept
            step = min(accepted + 1, n - i)
            tokens, decoded, calls, i = tokens + step, decoded + step, calls + 1, i + step
    return tokens / calls, ms / decoded


def _label(policy: tuple[str, int, float]) -> str:
    kind, k, t = policy
    return f"fixed k={k}" if kind == "fixed" else f"{kind} k<={k} t={t}"


def _costs(data: dict) -> tuple[dict[int, float], dict[int, float]]:
    """An earlier output's measured costs (JSON keys are strings)."""
    return ({int(t): v for t, v in data["target_ms"].items()}, {int(t): v for t, v in data["draft_ms"].items()})


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a packaged target (its draft and "
                    "default quantizations are used)")
    ap.add_argument("--results", required=True, help="greedy `speculant bench` results.json files, ',' separated")
    ap.add_argument("--k-max", type=int, default=6)
    ap.add_argument("--thresholds", default="0.3,0.5,0.7,0.8,0.9")
    ap.add_argument("--draft-costs", default="0.1,0.05,0.02,0", help="for the scaled rows: a draft forward's cost "
                    "as a fraction of the target's one-token forward (the measured draft's is added)")
    ap.add_argument("--context", type=int, default=0, help="tokens of context the costs are timed at (0: the "
                    "median prompt length + 64)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replay", metavar="JSON", help="replay an earlier output's teacher-forced answers with its "
                    "measured costs (no model is loaded, nothing is timed)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    paths = args.results.split(",")
    results = {path: json.loads(Path(path).read_text()) for path in paths}
    for path, r in results.items():
        if r["settings"].get("temperature"):
            raise SystemExit(f"{path}: not a greedy run")
    if args.replay:
        earlier = json.loads(Path(args.replay).read_text())
        answers = {path: earlier["workloads"][path]["per_answer"] for path in paths}
        target_ms, draft_ms = _costs(earlier)
        timed = earlier["settings"].get("timed", earlier["settings"])  # where the costs were measured
        timed = {key: timed[key] for key in ("target", "context", "repeats", "threads")}
        draft, machine = earlier["settings"]["draft"], earlier["machine"]
    else:
        session = speculant.load(args.target)
        answers = {}
        for path in paths:
            answers[path] = teacher_forced(session, results[path])
            print(path, "teacher-forced", flush=True)
        lengths = sorted(a["prompt_tokens"] for rows in answers.values() for a in rows)
        context = args.context or lengths[len(lengths) // 2] + 64
        target_ms, draft_ms = measure_costs(session, context, args.k_max + 1, args.repeats)
        timed = {"target": args.target, "context": context, "repeats": args.repeats, "threads": args.threads}
        draft, machine = str(session.draft.name_or_path), machine_info()
    for path in paths:
        for a in answers[path]:  # the engine's draft limit
            a["max_new_tokens"] = results[path]["settings"]["max_new_tokens"]
    print("target ms", {t: round(v, 1) for t, v in target_ms.items()}, "draft ms",
          {t: round(v, 1) for t, v in draft_ms.items()}, flush=True)
    thresholds = [float(x) for x in args.thresholds.split(",")]
    policies = [("fixed", k, 0.0) for k in range(1, args.k_max + 1)]
    policies += [(kind, k, t) for kind in POLICIES[1:] for k in (3, 4, args.k_max) for t in thresholds]
    measured_share = round(draft_ms[1] / target_ms[1], 3)
    shares = [measured_share] + [float(x) for x in args.draft_costs.split(",")]
    out = {"settings": {**vars(args), "timed": timed, "draft": draft}, "machine": machine,
           "target_ms": target_ms, "draft_ms": draft_ms, "workloads": {}}
    for path in paths:
        rows_of = answers[path]
        flat_match = [m for a in rows_of for m in a["match"]]
        rows = {}
        for p in policies:
            tau, ms = replay(rows_of, p, target_ms, draft_ms)
            rows[_label(p)] = {"tau": round(tau, 3), "speedup": round(target_ms[1] / ms, 3)}
        measured = {}
        for method, runs in results[path]["runs"].items():
            if method.startswith("chain:k=") and method[8:].isdigit():
                calls = sum(r["target_calls"] for r in runs)
                measured[f"fixed k={method[8:]}"] = round(sum(r["new_tokens"] for r in runs) / calls, 3)
        scaled = {}
        for share in shares:  # the same acceptance, a draft forward costing `share` target forwards
            cheap = {t: v * share * target_ms[1] / draft_ms[1] for t, v in draft_ms.items()}
            scaled[str(share)] = {_label(p): round(target_ms[1] / replay(rows_of, p, target_ms, cheap)[1], 3)
                                  for p in policies}
        best = max(rows, key=lambda r: rows[r]["speedup"])
        best_fixed = max((r for r in rows if r.startswith("fixed")), key=lambda r: rows[r]["speedup"])
        # a drafter always right and free: k + 1 tokens per forward over k + 1 rows (up to the rows timed)
        ceiling = {f"k={k}": round((k + 1) * target_ms[1] / target_ms[k + 1], 3) for k in range(1, args.k_max + 1)}
        out["workloads"][path] = {"answers": len(rows_of), "positions": len(flat_match),
                                  "agreement": round(sum(flat_match) / len(flat_match), 4), "policies": rows,
                                  "best": best, "best_fixed": best_fixed, "measured_tau": measured,
                                  "draft_share_measured": measured_share, "scaled_draft_cost": scaled,
                                  "ceiling": ceiling, "per_answer": rows_of}
        print(f"\n{path}: {len(rows_of)} answers, greedy agreement {sum(flat_match) / len(flat_match):.3f}")
        for name, r in rows.items():
            note = f"  (measured τ {measured[name]:.2f})" if name in measured else ""
            print(f"  {name:<28} τ {r['tau']:.2f}  decode {r['speedup']:.2f}x{note}")
        print(f"  best: {best}; best fixed: {best_fixed}")
        for share, cells in scaled.items():
            top = max(cells, key=cells.get)
            fixed = max((c for c in cells if c.startswith("fixed")), key=cells.get)
            print(f"  draft forward = {share} target forward: best {top} {cells[top]:.2f}x, best fixed {fixed} "
                  f"{cells[fixed]:.2f}x")
        print("  always right, free:", " ".join(f"{k} {v:.2f}x" for k, v in ceiling.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("written", args.out)


if __name__ == "__main__":
    main()
