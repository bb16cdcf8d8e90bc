"""How much a lookup drafter would gain from the traffic it has served (issue 30): a simulation, no model.

A stream of ShareGPT conversations on one topic (their first user turn matching ``--topic``), in file order; the
chat model's reply to each stands in for the target's answer. At every position of a reply, a greedy verifier
accepts the longest run of the proposal that equals the reply's next tokens, plus one token of its own (τ = reply
tokens / steps). Two drafters propose up to ``--k`` tokens:

* ``prompt``: prompt lookup over the prompt and the reply so far (speculant's ``lookup``);
* ``traffic``: the same, and where the context has no match, the continuation of the longest suffix (``--ngram``
  down to 2 tokens) of the context found in the replies served before (a bounded memory of the last ``--memory``
  tokens, most recent first): a drafter that learns from its traffic without training.

Reported per window of ``--window`` requests: the mean τ of each drafter. Tokenised with the bundled default
target's tokenizer (a stand-in: the relative gain is what this measures).

    python benchmarks/traffic_lookup.py --topic '\\bsql\\b|database|query' --out benchmarks/results/traffic_lookup.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from transformers import AutoTokenizer

from speculant.data.sharegpt import read_conversations, sharegpt_file
from speculant.drafters.lookup import lookup_continuation


def tau(prompt: list[int], reply: list[int], k: int, ngram: int, memory: list[int] | None, mem_ngram: int) -> float:
    ctx, steps, i = list(prompt), 0, 0
    while i < len(reply):
        proposal = lookup_continuation(ctx, ngram, k)
        if not proposal and memory is not None:
            proposal = _from_memory(ctx, memory, mem_ngram, k)
        accepted = 0
        while accepted < len(proposal) and i + accepted < len(reply) and proposal[accepted] == reply[i + accepted]:
            accepted += 1
        n = min(accepted + 1, len(reply) - i)
        ctx += reply[i:i + n]
        i, steps = i + n, steps + 1
    return len(reply) / steps


def _from_memory(ctx: list[int], memory: list[int], ngram: int, k: int) -> list[int]:
    for n in range(min(ngram, len(ctx)), 1, -1):
        suffix = ctx[-n:]
        for s in range(len(memory) - n - 1, -1, -1):
            if memory[s] == suffix[0] and memory[s:s + n] == suffix:
                follow = memory[s + n:s + n + k]
                if follow:
                    return follow
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topic", required=True, metavar="REGEX")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--memory-ngram", type=int, default=6)
    ap.add_argument("--memory", type=int, default=20000, help="tokens of served replies kept")
    ap.add_argument("--max-reply-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    topic = re.compile(args.topic, re.IGNORECASE)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "src/speculant/assets/default-target"))
    stream = []
    for conv in read_conversations(sharegpt_file()):
        turns = conv.get("conversations") or []
        if (len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt"
                and isinstance(turns[0].get("value"), str) and topic.search(turns[0]["value"])):
            stream.append((turns[0]["value"], turns[1]["value"]))
        if len(stream) >= args.requests:
            break
    memory: list[int] = []
    rows = []
    for question, answer in stream:
        prompt = tokenizer(question)["input_ids"][-512:]
        reply = tokenizer(answer)["input_ids"][: args.max_reply_tokens]
        if not reply:
            continue
        rows.append({"prompt": tau(prompt, reply, args.k, args.ngram, None, args.memory_ngram),
                     "traffic": tau(prompt, reply, args.k, args.ngram, memory, args.memory_ngram)})
        memory = (memory + reply)[-args.memory:]
    windows = []
    for w in range(0, len(rows) - args.window + 1, args.window):
        part = rows[w:w + args.window]
        windows.append({"requests": [w, w + args.window], **{m: sum(r[m] for r in part) / len(part)
                                                              for m in ("prompt", "traffic")}})
    result = {"settings": vars(args), "requests": len(rows), "windows": windows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for w in windows:
        print(f"requests {w['requests'][0]}-{w['requests'][1] - 1}: tau prompt lookup {w['prompt']:.2f}, "
              f"with the traffic memory {w['traffic']:.2f} ({w['traffic'] / w['prompt']:.2f}x)")


if __name__ == "__main__":
    main()
