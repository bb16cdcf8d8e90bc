"""What the traffic memory holds per token (speculant.online.traffic), for each scoring: Python heap bytes measured
with tracemalloc while a stream's requests (prompt + answer) are added, no bound reached.

    python benchmarks/traffic_memory_size.py --out benchmarks/results/traffic_memory_size.json

The stream: the 400 code-chat-train requests of benchmarks/results/online-replay-cc (its answers: the first 100
from online-stream-traffic, the rest from its answers.json), SmolLM2's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from pathlib import Path

import speculant
from speculant.bench.speed import machine_info
from speculant.online.traffic import SCORINGS, TrafficMemory

from online_replay import load_answers
from online_stream import stream_prompts

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--answers", default=str(RESULTS / "online-stream-traffic/online_stream.json"))
    ap.add_argument("--answers-cache", default=str(RESULTS / "online-replay-cc/answers.json"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    session = speculant.load("smollm2-135m-instruct", method="ar")
    prompts, _ = stream_prompts("builtin:code-chat-train", None, 0, 1024, args.requests, session.tokenizer)
    answers = load_answers(argparse.Namespace(answers=args.answers, answers_cache=args.answers_cache,
                                              max_new_tokens=128), session, prompts)
    rows = []
    for scoring in SCORINGS:
        for min_ngram in (1, 2):
            tracemalloc.start()
            memory = TrafficMemory(min_ngram=min_ngram, scoring=scoring, max_tokens=1 << 22)
            for ids, answer in zip(prompts, answers):
                memory.add(ids + answer)
            held, _ = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            entries = len(memory._index) + len(memory._best)
            rows.append({"scoring": scoring, "min_ngram": min_ngram, "tokens": len(memory), "ngrams": entries,
                         "bytes": held, "bytes_per_token": held / len(memory)})
            print(f"{scoring:8s} min_ngram {min_ngram}: {len(memory)} tokens, {entries} n-grams, "
                  f"{held / len(memory):.0f} bytes per token")
    if args.out:
        Path(args.out).write_text(json.dumps({"requests": len(prompts), "machine": machine_info(), "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
