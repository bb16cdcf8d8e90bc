"""VocabTrim calibration of the Qwen2.5-Coder-0.5B draft on its 1.5B target's own answers.

The draft's tied LM head (151,936 x 896) is 28% of its weights and is read at every draft token; VocabTrim (Goel et
al. 2025) keeps only the tokens the *target* writes. This script:

1. generates the 1.5B target's greedy answers (q4, bfloat16, exact prompt-lookup speculation, which gives the
   same tokens as plain decoding) to calibration prompts that are never evaluation prompts: coding chats made
   from the *train* split of the standard library (``code_chat_prompts(split="train")``; ``builtin:code-chat`` is
   the test split) and the bundled instruction prompts (explain, rewrite, writing, reasoning, knowledge; train
   split). Answers are appended to ``--answers`` (JSONL) one by one, so an interrupted run resumes;
2. ranks token ids by their count in those answers, ties (and tokens the answers never hold) broken by their
   count in the train split's stdlib sources and docs tokenized by the same tokenizer, so the ranking covers the
   whole vocabulary the target plausibly writes;
3. writes ``vocab_trim.json`` (``--out``) with the coverage of the top N and ``default_size``.

    python benchmarks/qwen_vocab_trim.py --prompts 64 --max-new-tokens 192 \\
        --out src/speculant/assets/calibration/qwen2.5-coder-0.5b-instruct.vocab_trim.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import speculant
from speculant.data.code_chat import code_chat_prompts
from speculant.data.corpus import load_corpus
from speculant.data.instructions import instruction_prompts
from speculant.train.calibrate import write_calibration_tokens

TARGET = "qwen2.5-coder-1.5b-instruct"


def prompts(n: int) -> list[tuple[str, str]]:
    """``(id, user message)``: code chats (train split) and instruction prompts, alternating."""
    code = [(f"code-chat-train/{r['id']}", r["messages"][-1]["content"]) for r in code_chat_prompts(n, split="train")]
    other = [(f"instructions/{i}", r["messages"][-1]["content"]) for i, r in enumerate(instruction_prompts(n))]
    mixed = [p for pair in zip(code, other) for p in pair]
    return mixed[:n]


def corpus_tokens(tokenizer, limit_chars: int = 3_000_000) -> np.ndarray:
    """Train-split stdlib sources and docs, tokenized (the tie-break ranking)."""
    texts, total = [], 0
    for doc in load_corpus():
        if doc.split != "train":
            continue
        texts.append(doc.text)
        total += len(doc.text)
        if total >= limit_chars:
            break
    return np.array(tokenizer("\n".join(texts))["input_ids"], dtype=np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--answers", default="runs/qwen-vocab-trim/answers.jsonl")
    ap.add_argument("--out", default="src/speculant/assets/calibration/qwen2.5-coder-0.5b-instruct.vocab_trim.json")
    ap.add_argument("--default-size", type=int, default=32768)
    args = ap.parse_args()

    answers_path = Path(args.answers)
    answers_path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if answers_path.exists():
        for line in answers_path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["id"]] = row
    todo = [p for p in prompts(args.prompts) if p[0] not in done]
    session = speculant.load(TARGET, method="lookup", quantization="q4", dtype=torch.bfloat16)
    with answers_path.open("a") as f:
        for pid, text in tqdm(todo, desc="target answers", unit="prompt"):
            t0 = time.perf_counter()
            gen = session.generate(text, max_new_tokens=args.max_new_tokens, temperature=0.0)
            row = {"id": pid, "tokens": gen.token_ids, "seconds": round(time.perf_counter() - t0, 2)}
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[pid] = row
    answer = np.array([t for row in done.values() for t in row["tokens"]], dtype=np.int64)
    vocab = int(session.target.config.vocab_size)
    corpus = corpus_tokens(session.tokenizer)
    # one stream whose counts rank by (answer count, corpus count): each answer token weighs more than the whole
    # corpus, so corpus counts only break ties
    weight = int(np.bincount(corpus, minlength=vocab).max()) + 1
    counts = np.bincount(answer, minlength=vocab)[:vocab] * weight + np.bincount(corpus, minlength=vocab)[:vocab]
    stream = np.repeat(np.arange(vocab), counts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out.parent / ".calibrating"
    tmp_dir.mkdir(exist_ok=True)
    (tmp_dir / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    written = write_calibration_tokens(tmp_dir, stream,
                                       f"{TARGET} q4 greedy answers to {len(done)} train-split prompts "
                                       f"({answer.size} tokens), ties by train-split stdlib text ({corpus.size} tokens)",
                                       default_size=args.default_size)
    data = json.loads(written.read_text())
    # coverage of the answers themselves (the stream's coverage is dominated by the weighting)
    ranked = data["token_ids"]
    answer_counts = np.bincount(answer, minlength=vocab)
    data["calibration"]["tokens"] = int(answer.size)
    data["coverage"] = {str(n): round(float(answer_counts[ranked[:n]].sum()) / answer.size, 5)
                        for n in (1024, 4096, 8192, 16384, 32768) if n < vocab}
    out.write_text(json.dumps(data))
    written.unlink()
    (tmp_dir / "config.json").unlink()
    tmp_dir.rmdir()
    print(f"wrote {out}: {len(ranked)} ranked ids, answers {answer.size} tokens, coverage {data['coverage']}")


if __name__ == "__main__":
    main()
