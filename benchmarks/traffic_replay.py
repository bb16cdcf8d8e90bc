"""What drafting from the traffic memory gives on a stream, replayed exactly from its answers.

Greedy verification accepts the longest drafted path that matches the target's own answer, and a merged tree's
branches are the model chain, the prompt-lookup chain and the traffic chain: per step the accepted length is the
longest prefix of the answer any of them drafted. So the plain answers of a stream (``online_stream.py`` keeps the
shipped session's: greedy, they are plain decoding's) replayed request by request, in order, through the real
:class:`speculant.online.traffic.TrafficMemory` (every finished request added, as the online adapter does), with the
shipped draft's teacher-forced agreement (``draft_length.draft_matches``), give τ per window for the shipped method
with and without the traffic chain, exactly as the engine counts it (the prompt but its last token is prefilled apart;
every step, the first included, drafts at most ``remaining - 1`` tokens; τ = new tokens / steps). No timing: τ only;
the stream's own run has the measured tokens/s. The model chain is the *shipped* drafter's throughout (no
distillation): this separates what the memory gives from what the online updates give.

    python benchmarks/traffic_replay.py --stream benchmarks/results/online-stream-traffic-distill/online_stream.json \
        [--traffic 4,8,16] [--out .../traffic_replay.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import speculant
from speculant.drafters.lookup import lookup_continuation, merge_chain
from speculant.online.traffic import TrafficMemory

from draft_length import draft_matches
from online_stream import stream_prompts


def replay_request(ids: list[int], answer: list[int], match: list[bool] | None, k: int, lookup: int,
                   memory: TrafficMemory | None, traffic: int, max_new_tokens: int, tree: int = 0
                   ) -> tuple[int, int, list[tuple[int, int, bool]]]:
    """One request replayed: its steps (target calls), draft tokens over all steps (the merged trees' sizes) and per
    step ``(i, committed, refused)``: the answer index it started at, the tokens it committed (accepted + bonus) and
    whether a draft token was offered after the accepted path (the bonus replaced a refused draft). A model chain
    of ``k`` (its teacher-forced ``match``; 0: none), a prompt-lookup chain of ``lookup`` (ngram 3) and a traffic
    chain of ``traffic`` tokens from ``memory`` (None or 0: none) are merged, or with ``tree`` > 0 the memory's tree of
    that many nodes (:meth:`TrafficMemory.tree`, ``traffic`` deep); where the model's token is not the answer's its
    identity is unknown: it counts as a node of its own."""
    n, i, calls, nodes = len(answer), 0, 0, 0  # the prompt's last token is the first step's root: it drafts too
    steps: list[tuple[int, int, bool]] = []
    while i < n:
        limit = max_new_tokens - i - 1
        context = ids + answer[:i]
        model = [answer[i + j] if i + j < n and match[i + j] else -1 - j for j in range(min(k, limit))]
        chains = [model, lookup_continuation(context, 3, min(lookup, limit)) if lookup else []]
        if traffic and memory is not None:
            chains += (memory.tree(context, min(traffic, limit), tree) if tree else
                       [memory.continuation(context, min(traffic, limit))])
        best = 0
        runs = []
        tokens: list[int] = []
        parents: list[int] = []
        for chain in chains:
            run = 0
            while run < len(chain) and i + run < n and chain[run] == answer[i + run]:
                run += 1
            runs.append(run)
            best = max(best, run)
            tokens, parents = merge_chain(tokens, parents, chain)
        step = min(best + 1, n - i)
        refused = any(run >= best and len(chain) > best for run, chain in zip(runs, chains))
        steps.append((i, step, refused))
        i, calls, nodes = i + step, calls + 1, nodes + len(tokens)
    return calls, nodes, steps


def replay(prompts: list[list[int]], answers: list[list[int]], matches: list[list[bool]] | None, k: int,
           lookup: int, traffic: int, max_new_tokens: int, window: int, min_ngram: int = 1,
           scoring: str = "recent") -> dict[str, list[float]]:
    """Per window of ``window`` requests, ``tau`` and ``nodes`` (draft tokens per step: the merged tree's size) of
    :func:`replay_request` over the stream, every finished request added to the traffic memory (shortest n-gram
    ``min_ngram``, ``scoring`` as the stream's run had it: a stream whose results file records no scoring ran "recent")."""
    memory = TrafficMemory(min_ngram=min_ngram, scoring=scoring)
    per_request = []
    for r, (ids, answer) in enumerate(zip(prompts, answers)):
        calls, nodes, _ = replay_request(ids, answer, matches[r] if matches else None, k, lookup, memory, traffic,
                                         max_new_tokens)
        per_request.append((len(answer), calls, nodes))
        memory.add(ids + answer)
    parts = [per_request[w: w + window] for w in range(0, len(per_request) - window + 1, window)]
    return {"tau": [sum(p[0] for p in part) / sum(p[1] for p in part) for part in parts],
            "nodes": [sum(p[2] for p in part) / sum(p[1] for p in part) for part in parts]}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", required=True, help="an online_stream.json whose shipped rows hold token_ids")
    ap.add_argument("--traffic", default="4,8,16", help="traffic chain lengths to replay, comma-separated")
    ap.add_argument("--out", default=None, help="default: traffic_replay.json beside --stream")
    args = ap.parse_args()
    data = json.loads(Path(args.stream).read_text())
    st = data["settings"]
    rows = data["requests"]["shipped"]
    if "token_ids" not in rows[0]:
        raise SystemExit(f"{args.stream} holds no answers (token_ids): run online_stream.py again to get them")
    torch.set_num_threads(st["threads"])
    session = speculant.load(st["target"], method=st["method"], threads=st["threads"])
    prompts, _ = stream_prompts(st["prompts"], st["topic"], st["seed"], st["max_prompt_tokens"], st["requests"],
                                session.tokenizer)
    answers = [r["token_ids"] for r in rows]
    options = session.method.options
    k = int(options.get("k", 0)) if session.draft is not None else 0
    lookup = int(options.get("lookup", 0)) or (int(options.get("k", 8)) if session.method.name == "lookup" else 0)
    if session.method.name not in ("chain", "lookup"):
        raise SystemExit(f"the replay models chain[:lookup=N] and lookup, not {session.method.spec}")
    matches = [m["match"] for m in draft_matches(session, list(zip(prompts, answers)))] if k else None
    w, new, scoring = st["window"], st["max_new_tokens"], st.get("traffic_scoring", "recent")
    result = {"stream": args.stream, "method": session.method.spec, "window": w, "policies": {}}

    def add(label: str, got: dict[str, list[float]]) -> None:
        taus = got["tau"]
        result["policies"][label] = {**got, "last_over_first": taus[-1] / taus[0]}
        print(f"{label:48s} τ per window {[round(t, 3) for t in taus]} last/first {taus[-1] / taus[0]:.3f}, draft "
              f"tokens per step {[round(x, 1) for x in got['nodes']]}")

    add(session.method.spec, replay(prompts, answers, matches, k, lookup, 0, new, w))
    for t in (int(x) for x in args.traffic.split(",")):
        add(f"{session.method.spec} + traffic {t}",
            replay(prompts, answers, matches, k, lookup, t, new, w, scoring=scoring))
        add(f"{session.method.spec} + traffic {t} (n-grams >= 2)",
            replay(prompts, answers, matches, k, lookup, t, new, w, min_ngram=2, scoring=scoring))
    if lookup:
        add(f"lookup:k={lookup}", replay(prompts, answers, None, 0, lookup, 0, new, w))
        add(f"lookup:k={lookup} + traffic {lookup}",
            replay(prompts, answers, None, 0, lookup, lookup, new, w, scoring=scoring))
    measured = {name: [x["tau"] for x in data["windows"][name]] for name in ("shipped", "online")}
    result["measured"] = measured
    print(f"measured: shipped {[round(t, 3) for t in measured['shipped']]}, online "
          f"{[round(t, 3) for t in measured['online']]} (traffic {st.get('traffic', 0)}, with distillation)")
    out = Path(args.out) if args.out else Path(args.stream).with_name("traffic_replay.json")
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
