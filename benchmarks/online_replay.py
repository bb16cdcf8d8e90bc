"""Online adaptation on a stream, replayed from its greedy answers: τ per window in minutes, not hours.

Under greedy verification a step accepts the longest drafted path that matches the target's own answer, and a chain
drafted by a greedy draft model matches it exactly as far as the model's teacher-forced predictions over the answer
do (``traffic_replay.replay_request``, which also merges prompt lookup and the traffic memory as the engine does). So
the stream's plain answers, replayed request by request through the real :class:`~speculant.online.OnlineAdapter`
give τ per window with and without adaptation without decoding anything:

- before each request, the draft model the adapter serves *at that moment* predicts the answer teacher-forced (one
  draft forward), which gives every step of the request;
- the request's :class:`~speculant.online.observed.Observation` is what :class:`ObservedDrafter` keeps from those
  steps (the rows along the committed path, the last one when the bonus replaced a refused draft), with the target's
  top-k probabilities from one teacher-forced target forward over the answer;
- the adapter takes it as it takes a live one (its buffer, its hold-out, its traffic memory), and its updates run when
  due: the same training, check and swap as in a server.

The shipped drafter's τ comes from the same replay with no updates and no memory. A replay is not bit for bit a live
run: the target's probabilities come from a teacher-forced forward instead of the verification forwards (float
rounding), which can move an update's training and so its check. ``--validate STREAM`` replays a live run's own
settings and answers (an ``online_stream.json``) and prints its measured τ beside the replay's. No timing: τ and
draft tokens per step only.

Answers: the shipped session's greedy answers of ``--answers`` (an ``online_stream.json`` of the same stream that
keeps them: its first requests), then ``--answers-cache``, then greedy decoding with ``--method`` (plain decoding's
output), kept in ``--answers-cache``.

    python benchmarks/online_replay.py --prompts builtin:sharegpt --topic 'javascript|react|typescript|node\\.?js' \\
        --requests 150 --method chain:k=4 --online-every 8 --steps 32 --lr 0.001 --positions all --min-held 4 \\
        [--traffic 10] --answers-cache benchmarks/results/online-replay-js/answers.json --out OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import speculant
from speculant.bench.speed import machine_info
from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers
from speculant.core.target_forward import TargetForward
from speculant.online.observed import Observation
from speculant.online import OnlineAdapter

from draft_length import draft_matches
from online_stream import (_plot, online_config, online_settings, progress, run_update, stream_arguments,
                           stream_prompts, stream_title, window_tau)
from traffic_replay import replay_request


class Replayed:
    """What :meth:`OnlineAdapter.observe` reads of a finished generation's drafter: its observation and token ids."""

    def __init__(self, observation: Observation | None, token_ids: list[int]) -> None:
        self._observation, self.token_ids = observation, token_ids

    def observation(self) -> Observation | None:
        return self._observation


def target_top(session, ids: list[int], answer: list[int], positions: list[int], top_k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``top_k`` ids ``[P, k]`` (int32) and probabilities (float16, temperature 1) for the tokens at
    ``positions`` of ``ids + answer``, from one teacher-forced forward (row ``p - 1`` predicts token ``p``)."""
    full = torch.tensor([ids + answer])  # [1, L]
    forward = TargetForward(session.target)
    cache = SpecCache(num_layers(session.target), capacity=full.shape[1] + 8)
    if forward.llama is not None:
        hidden = forward.llama.hidden(full, cache)[0]  # [L, H]
        logits = forward.llama.logits(hidden[[p - 1 for p in positions]])  # [P, V]
    else:
        logits = forward(cache, input_ids=full)[0, [p - 1 for p in positions]]
    top = logits.float().softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


def observation(session, ids: list[int], answer: list[int], steps: list[tuple[int, int, bool]], top_k: int
                ) -> Observation | None:
    """The observation :class:`ObservedDrafter` keeps of these steps: per step the rows predicting the committed
    tokens, the last one only where the bonus replaced a refused draft (it then counts as refused); not the last
    step's (the generation ends there, at the budget or a stop token, and its drafter is not told)."""
    positions: list[int] = []
    rejected: list[bool] = []
    for i, committed, refused in steps[:-1]:
        rows = committed if refused else committed - 1
        positions += [len(ids) + i + r for r in range(rows)]
        rejected += [False] * (rows - 1) + [refused] if rows else []
    if not positions:
        return None
    top_ids, top_p = target_top(session, ids, answer, positions, top_k)
    end = max(positions) + 1
    return Observation(ids=torch.tensor((ids + answer)[:end], dtype=torch.int32),
                       positions=torch.tensor(positions, dtype=torch.int64), top_ids=top_ids, top_p=top_p,
                       rejected=torch.tensor(rejected, dtype=torch.bool))


def chains_of(session) -> tuple[int, int]:
    """The method's model chain length ``k`` (0: none) and prompt-lookup chain length, as the replay models them."""
    spec, options = session.method, session.method.options
    if (spec.name not in ("chain", "lookup") or options.get("stop") is not None or "k" not in options
            or int(options.get("ngram", 3)) != 3):
        raise SystemExit(f"the replay models chain:k=N[:lookup=N] and lookup:k=N (ngram 3), k given; not {spec.spec}")
    k = int(options.get("k", 0)) if session.draft is not None and spec.name == "chain" else 0
    lookup = int(options.get("lookup", 0)) or (int(options.get("k", 8)) if spec.name == "lookup" else 0)
    return k, lookup


def load_answers(args, shipped, prompts: list[list[int]]) -> list[list[int]]:
    """The stream's greedy answers: ``--answers``' shipped rows (where they hold them), then ``--answers-cache``,
    then decoded with ``--method`` (greedy: plain decoding's output) and cached."""
    answers: list[list[int]] = []
    if args.answers:
        rows = json.loads(Path(args.answers).read_text())["requests"]["shipped"]
        if rows and "token_ids" not in rows[0]:
            print(f"{args.answers} keeps no answers (token_ids): decoding them", flush=True)
        else:
            answers = [r["token_ids"] for r in rows][: len(prompts)]
    cache = Path(args.answers_cache) if args.answers_cache else None
    cached = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    for i in range(len(answers), len(prompts)):
        key = f"{i}:{hash(tuple(prompts[i])) & 0xFFFFFFFF:08x}:{args.max_new_tokens}"
        if key not in cached:
            cached[key] = shipped.generate(prompts[i], max_new_tokens=args.max_new_tokens).token_ids
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(cached))
            print(f"  answer {i + 1}/{len(prompts)} decoded", flush=True)
        answers.append(cached[key])
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_arguments(ap)
    ap.add_argument("--answers", default=None, help="an online_stream.json of the same stream (its shipped answers)")
    ap.add_argument("--answers-cache", default=None, help="a JSON file keeping the answers decoded here")
    ap.add_argument("--validate", default=None, metavar="STREAM",
                    help="replay this online_stream.json's own settings and answers and compare with its measured τ")
    ap.add_argument("--out", default=None, help="a folder for online_replay.json and tau.png (default: print only)")
    args = ap.parse_args()
    measured = None
    if args.validate:
        data = json.loads(Path(args.validate).read_text())
        for key, value in data["settings"].items():
            if key != "out":
                setattr(args, key, value)
        if "min_z" not in data["settings"]:  # a run from before the check's z bound kept what did not drop
            args.min_z = 0.0
        args.answers = args.validate
        measured = {name: [w["tau"] for w in data["windows"][name]] for name in ("shipped", "online")}
    torch.set_num_threads(args.threads)
    shipped = speculant.load(args.target, method=args.method, threads=args.threads)
    adapting = speculant.load(args.target, method=args.method, threads=args.threads)
    k, lookup = chains_of(shipped)
    prompts, skipped = stream_prompts(args.prompts, args.topic, args.seed, args.max_prompt_tokens, args.requests,
                                      shipped.tokenizer)
    answers = load_answers(args, shipped, prompts)
    adapter = OnlineAdapter(adapting, online_config(args))
    cfg = adapter.config
    base = [m["match"] for m in draft_matches(shipped, list(zip(prompts, answers)))] if k else None
    rows: dict[str, list[dict]] = {"shipped": [], "online": []}
    updates = []
    start = time.perf_counter()
    with torch.inference_mode():
        for r, (ids, answer) in enumerate(zip(prompts, answers)):
            calls, nodes, _ = replay_request(ids, answer, base[r] if base else None, k, lookup, None, 0,
                                             args.max_new_tokens)
            rows["shipped"].append({"request": r, "tokens": len(answer), "target_calls": calls, "draft_tokens": nodes,
                                    "tau": len(answer) / calls, "version": 0})
            if k:  # the serving drafter's predictions; until an update is kept it is the shipped one (base)
                match = base[r] if adapter.version == 0 else draft_matches(adapting, [(ids, answer)])[0]["match"]
            else:
                match = None
            calls, nodes, steps = replay_request(ids, answer, match, k, lookup, adapter.traffic, cfg.traffic,
                                                 args.max_new_tokens, cfg.traffic_tree)
            rows["online"].append({"request": r, "tokens": len(answer), "target_calls": calls, "draft_tokens": nodes,
                                   "tau": len(answer) / calls, "version": adapter.version})
            seen = observation(adapting, ids, answer, steps, cfg.top_k) if cfg.distill else None
            adapter.observe(Replayed(seen, ids + answer))
            if adapter.due():
                with torch.inference_mode(False):  # training
                    run_update(adapter, updates)
            progress(r, len(prompts), rows, adapter.version)
    windows = {name: window_tau(rs, args.window) for name, rs in rows.items()}
    taus = {name: [w["tau"] for w in ws] for name, ws in windows.items()}
    result = {"settings": vars(args), "machine": machine_info(), "method": shipped.method.spec,
              "online": online_settings(args), "windows": windows,
              "online_last_over_first_tau": taus["online"][-1] / taus["online"][0],
              "shipped_last_over_first_tau": taus["shipped"][-1] / taus["shipped"][0],
              "online_last_over_shipped_last_tau": taus["online"][-1] / taus["shipped"][-1],
              "measured_tau": measured, "updates": updates, "requests": rows, "skipped_long_prompts": skipped,
              "seconds": time.perf_counter() - start}
    print(f"τ per window: shipped {[round(t, 3) for t in taus['shipped']]}, online "
          f"{[round(t, 3) for t in taus['online']]}; online last/first {result['online_last_over_first_tau']:.3f} "
          f"(shipped {result['shipped_last_over_first_tau']:.3f}), last window online/shipped "
          f"{result['online_last_over_shipped_last_tau']:.3f}; {sum(u['accepted'] for u in updates)} of "
          f"{len(updates)} updates kept")
    if measured is not None:
        print(f"measured in {args.validate}: shipped {[round(t, 3) for t in measured['shipped']]}, online "
              f"{[round(t, 3) for t in measured['online']]}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "online_replay.json").write_text(json.dumps(result, indent=1))
        _plot(rows, windows, args.window, out / "tau.png")
        write_readme(out, result)


def write_readme(out: Path, result: dict) -> None:
    """``README.md`` in ``out``: the settings in words and τ per window, from a replay's ``result``."""
    args = argparse.Namespace(**result["settings"])
    windows, n = result["windows"], len(result["requests"]["online"])
    lines = [stream_title(args, n, "Online adaptation replayed"), "",
             f"`benchmarks/online_replay.py`: target {args.target}, method `{result['method']}` with its shipped "
             f"drafter, greedy, {args.max_new_tokens} new tokens; online: {result['online']}. τ from the stream's "
             "greedy answers replayed through the real adapter (no decoding, no timing).", "",
             "| window | τ shipped | τ online | draft tokens per step, shipped | online |", "|---|---|---|---|---|"]
    lines += [f"| {a['requests'][0]}-{a['requests'][1] - 1} | {a['tau']:.3f} | {b['tau']:.3f} | "
              f"{a['draft_tokens_per_step']:.2f} | {b['draft_tokens_per_step']:.2f} |"
              for a, b in zip(windows["shipped"], windows["online"])]
    updates = result["updates"]
    lines += ["", f"τ of the last window over the first (online): **{result['online_last_over_first_tau']:.2f}x** "
              f"(shipped: {result['shipped_last_over_first_tau']:.2f}x); last window online over shipped: "
              f"{result['online_last_over_shipped_last_tau']:.2f}x. Updates: {len(updates)} "
              f"({sum(u['accepted'] for u in updates)} kept).", "", "![tau](tau.png)", ""]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
