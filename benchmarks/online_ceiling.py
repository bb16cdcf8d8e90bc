"""How far online adaptation could move τ on a stream at most: the traffic memory's learning curve, and
the draft model distilled offline on the stream's own earlier requests for many steps.

A target such as "τ of a stream's last 50-request window at 1.25x its first" is reached by adaptation only
if what it learns keeps growing past the first window. Three measurements, from the stream's greedy answers (as
``online_replay.py``: τ replayed exactly, no decoding, no timing):

- **the memory's curve**: per block of ``--block`` requests, τ of prompt lookup (``--lookup`` tokens) without and
  with the traffic memory (the real :class:`~speculant.online.traffic.TrafficMemory`, every finished request added,
  ``--traffic`` tokens per step, a tree of ``--traffic-tree`` nodes if given), and their ratio: how soon the
  memory's gain appears and where it levels off;
- **the memory's coverage**: per window of ``--window`` requests, the share of answer tokens that had followed the
  same ``n``-token context (n = 1-4) in an earlier request: what a memory could draft at best, one token deep,
  were it to pick the right one of everything that followed;
- **the distillation ceiling**: the shipped draft model distilled on every answer position of the stream's first
  ``--train`` requests (the target's top-32 from one teacher-forced forward, the online adapter's own loss and
  trainable parameters), with one optimizer across all ``--steps`` steps and no check or rollback. That is more
  training on more of the stream than online adaptation gives a drafter before its last window. Every
  ``--eval-every`` steps: τ of ``chain:k=--k`` (the model chain alone) and the greedy agreement on the remaining
  requests. ``--train-head`` also trains the drafter's own copy of the LM head, which online adaptation keeps
  frozen (it is shared with the target).

    python benchmarks/online_ceiling.py --requests 400 --train 300 --steps 600 --lr 0.001 \\
        --answers benchmarks/results/online-stream-traffic/online_stream.json \\
        --answers-cache benchmarks/results/online-replay-cc/answers.json --out benchmarks/results/online-ceiling-cc
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import speculant
from speculant.bench.speed import machine_info
from speculant.online import OnlineConfig
from speculant.online.observed import Observation
from speculant.online.scheduler import run_steps
from speculant.online.traffic import TrafficMemory
from speculant.online.trainer import optimizer_step, trainable_copy

from draft_length import draft_matches
from online_replay import load_answers, target_top
from online_stream import stream_arguments, stream_prompts, window_tau
from traffic_replay import replay_request


def memory_curve(pairs: list[tuple[list[int], list[int]]], lookup: int, traffic: int, memory: TrafficMemory,
                 block: int, max_new_tokens: int, tree: int = 0) -> list[dict]:
    """Per whole block of ``block`` requests: τ of prompt lookup without and with ``memory`` (each request added
    once replayed) and their ratio."""
    alone, merged = [], []
    for ids, answer in pairs:
        calls, _, _ = replay_request(ids, answer, None, 0, lookup, None, 0, max_new_tokens)
        alone.append({"tokens": len(answer), "target_calls": calls})
        calls, _, _ = replay_request(ids, answer, None, 0, lookup, memory, traffic, max_new_tokens, tree)
        merged.append({"tokens": len(answer), "target_calls": calls})
        memory.add(ids + answer)
    return [{"requests": a["requests"], "tau_lookup": a["tau"], "tau_memory": m["tau"], "gain": m["tau"] / a["tau"]}
            for a, m in zip(window_tau(alone, block), window_tau(merged, block))]


def coverage(pairs: list[tuple[list[int], list[int]]], window: int, orders: tuple[int, ...] = (1, 2, 3, 4)
             ) -> dict[str, list[float]]:
    """Per context length ``n`` (key ``"n"``), per window of ``window`` requests: the share of answer tokens whose
    ``n`` preceding tokens had been followed by them in an earlier request (prompt or answer)."""
    out = {}
    for n in orders:
        seen: set[tuple[int, ...]] = set()
        hits = []
        for ids, answer in pairs:
            full = ids + answer
            hits.append((sum(tuple(full[i - n: i + 1]) in seen for i in range(len(ids), len(full))), len(answer)))
            seen.update(tuple(full[i - n: i + 1]) for i in range(n, len(full)))
        out[str(n)] = [sum(h for h, _ in hits[w: w + window]) / sum(a for _, a in hits[w: w + window])
                       for w in range(0, len(hits) - window + 1, window)]
    return out


def chain_tau(session, pairs: list[tuple[list[int], list[int]]], k: int, max_new_tokens: int
              ) -> tuple[float, float]:
    """τ of a ``k``-token model chain over ``pairs`` (replayed from the draft's teacher-forced predictions) and the
    draft's greedy agreement with the answers."""
    tokens = calls = agree = 0
    for (ids, answer), m in zip(pairs, draft_matches(session, pairs)):
        steps, _, _ = replay_request(ids, answer, m["match"], k, 0, None, 0, max_new_tokens)
        tokens, calls, agree = tokens + len(answer), calls + steps, agree + sum(m["match"])
    return tokens / calls, agree / tokens


def observations(session, pairs: list[tuple[list[int], list[int]]], top_k: int) -> list[Observation]:
    """Every answer position of each request as an observation (none refused), the target's top-``top_k``."""
    out = []
    for ids, answer in pairs:
        positions = list(range(len(ids), len(ids) + len(answer)))
        top_ids, top_p = target_top(session, ids, answer, positions, top_k)
        out.append(Observation(ids=torch.tensor(ids + answer, dtype=torch.int32),
                               positions=torch.tensor(positions, dtype=torch.int64), top_ids=top_ids, top_p=top_p,
                               rejected=torch.zeros(len(positions), dtype=torch.bool)))
    return out


def distillation_ceiling(session, train: list[Observation], test: list[tuple[list[int], list[int]]], args
                         ) -> list[dict]:
    """The curve of :func:`chain_tau` on ``test`` while the shipped draft model is distilled on ``train`` (the
    module doc); ``session.draft`` is the trained copy afterwards."""
    config = OnlineConfig(positions="all", lr=args.lr, loss=args.loss, seed=args.seed)
    candidate, params = trainable_copy(session.draft, session.target)
    if args.train_head:  # an own copy of the LM head (untied from the target's)
        head = candidate.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        params.append(head.weight)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    tau, agreement = chain_tau(session, test, args.k, args.max_new_tokens)
    curve = [{"step": 0, "loss": None, "tau": tau, "agreement": agreement, "seconds": 0.0}]
    print(f"step 0: τ {tau:.3f}, agreement {agreement:.3f}", flush=True)
    start, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        pick = torch.randint(len(train), (min(4, len(train)),), generator=generator).tolist()
        losses.append(run_steps(optimizer_step(candidate, params, optimizer, [train[i] for i in pick], config)))
        if step % args.eval_every == 0 or step == args.steps:
            session.draft = candidate.eval()
            with torch.inference_mode():
                tau, agreement = chain_tau(session, test, args.k, args.max_new_tokens)
            candidate.train()
            loss = sum(losses) / len(losses)
            curve.append({"step": step, "loss": loss, "tau": tau, "agreement": agreement,
                          "seconds": time.perf_counter() - start})
            losses = []
            print(f"step {step}: loss {loss:.3f}, τ {tau:.3f} ({tau / curve[0]['tau']:.3f}x), agreement "
                  f"{agreement:.3f}, {curve[-1]['seconds']:.0f} s", flush=True)
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_arguments(ap)
    ap.set_defaults(requests=400, steps=600, lr=1e-3, traffic=10, traffic_min_ngram=2)
    ap.add_argument("--answers", default=None, help="an online_stream.json of the same stream (its shipped answers)")
    ap.add_argument("--answers-cache", default=None, help="a JSON file keeping the answers decoded here")
    ap.add_argument("--train", type=int, default=300, help="requests the draft model is distilled on (the first)")
    ap.add_argument("--k", type=int, default=4, help="the model chain's length for τ")
    ap.add_argument("--lookup", type=int, default=10, help="prompt lookup's tokens per step in the memory's curve")
    ap.add_argument("--block", type=int, default=10, help="requests per point of the memory's curve")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--train-head", action="store_true", help="also train an own copy of the drafter's LM head")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory's curve and coverage")
    ap.add_argument("--memory-only", action="store_true", help="skip the distillation ceiling")
    ap.add_argument("--out", default=None, help="a folder for online_ceiling[-head].json (default: print only)")
    args = ap.parse_args()
    if args.memory_only and args.no_memory:
        raise SystemExit("--memory-only and --no-memory leave nothing to measure")
    if not args.memory_only and not 0 < args.train < args.requests:
        raise SystemExit(f"--train must be between 1 and --requests - 1, got {args.train}")
    torch.set_num_threads(args.threads)
    session = speculant.load(args.target, method=f"chain:k={args.k}", threads=args.threads)
    prompts, _ = stream_prompts(args.prompts, args.topic, args.seed, args.max_prompt_tokens, args.requests,
                                session.tokenizer)
    pairs = list(zip(prompts, load_answers(args, session, prompts)))
    result = {"settings": vars(args), "machine": machine_info()}
    if not args.no_memory:
        memory = TrafficMemory(max_tokens=OnlineConfig.traffic_tokens, min_ngram=args.traffic_min_ngram,
                               scoring=args.traffic_scoring, min_score=args.traffic_min_score)
        result["memory_curve"] = curve = memory_curve(pairs, args.lookup, args.traffic, memory, args.block,
                                                      args.max_new_tokens, args.traffic_tree)
        print("memory's gain per block of", args.block, [round(c["gain"], 3) for c in curve], flush=True)
        result["coverage"] = cover = coverage(pairs, args.window)
        for n, shares in cover.items():
            print(f"coverage after {n}-token contexts per window: {[round(x, 3) for x in shares]}", flush=True)
    if not args.memory_only:
        with torch.inference_mode():
            train = observations(session, pairs[: args.train], OnlineConfig.top_k)
        result["distillation"] = curve = distillation_ceiling(session, train, pairs[args.train:], args)
        best = max(curve, key=lambda c: c["tau"])
        result["best_over_shipped_tau"] = best["tau"] / curve[0]["tau"]
        print(f"best τ {best['tau']:.3f} at step {best['step']}: {result['best_over_shipped_tau']:.3f}x the shipped "
              "drafter's", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = ("online_ceiling-memory.json" if args.memory_only else
                "online_ceiling-head.json" if args.train_head else "online_ceiling.json")
        (out / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
