"""Can a short continued training give the bundled target in-context copying (induction heads)?

The bundled target does not copy from its context (``benchmarks/in_context_copying.py``), which is what prompt
lookup's rivals (mask probing) and a retrieval task need. This experiment continues its training on batches
where part of the rows are made to reward copying, and runs the copying probes every ``--eval-every`` steps:

* ``--random-fraction`` of the rows: a random token sequence of 16-128 tokens repeated to fill the row (after a
  random-length prefix of ordinary text), so only copying lowers their loss;
* ``--copy-fraction``: an ordinary window in which a span of 32 to half the window reappears verbatim later;
* the rest: ordinary training windows (the corpus the target was trained on).

It writes the probe results per evaluation and the validation loss to ``--out``; the bundled model is not changed.

    python benchmarks/copy_finetune.py [--steps 200] [--lr 6e-4] [--data /work/runs/data]
        [--out benchmarks/results/copy_finetune.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from in_context_copying import probe, summary
from tqdm.auto import tqdm

import speculant
from speculant.bench.speed import machine_info
from speculant.bench.kv_fidelity import default_texts
from speculant.train.bundled.data import load_split
from speculant.train.bundled.pretrain import evaluate


def _row(tokens: np.ndarray, rng: np.random.Generator, seq_len: int, random_fraction: float,
         copy_fraction: float, vocab: int) -> np.ndarray:
    """One ``[seq_len + 1]`` training row (see the module docstring)."""
    start = int(rng.integers(0, len(tokens) - seq_len - 1))
    row = tokens[start : start + seq_len + 1].astype(np.int64).copy()
    u = rng.random()
    if u < random_fraction:
        period = rng.integers(0, vocab, size=int(rng.integers(16, 129)))
        cut = int(rng.integers(0, seq_len // 2))
        row[cut:] = np.tile(period, (seq_len + 1 - cut) // len(period) + 1)[: seq_len + 1 - cut]
    elif u < random_fraction + copy_fraction:
        span = int(rng.integers(32, seq_len // 2 + 1))
        src = int(rng.integers(0, seq_len + 1 - 2 * span + 1))
        dst = int(rng.integers(src + span, seq_len + 1 - span + 1))
        row[dst : dst + span] = row[src : src + span]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--data", default="/work/runs/data", help="directory written by `speculant train prepare`")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--random-fraction", type=float, default=0.25)
    ap.add_argument("--copy-fraction", type=float, default=0.25)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/copy_finetune.json"))
    args = ap.parse_args()
    if not 0 <= args.random_fraction + args.copy_fraction <= 1:
        ap.error("--random-fraction + --copy-fraction must lie in [0, 1]")
    torch.set_num_threads(args.threads)
    model, tok = speculant.load_pretrained(args.target)
    model = model.float().train()
    train = load_split(args.data, "train")
    val = load_split(args.data, "validation")
    texts = default_texts(4)
    rng = np.random.default_rng(args.seed)
    cpu = torch.device("cpu")

    def checkpoint(step: int, loss: float | None) -> dict:
        found = probe(model, tok, texts, seed=args.seed)
        row = {"step": step, "train_loss": loss,
               "validation_loss": evaluate(model, val, args.seq_len, 8, args.batch_size, cpu, torch.bfloat16),
               "summary": summary(found), "probe": found}
        tqdm.write(json.dumps({k: row[k] for k in ("step", "train_loss", "validation_loss", "summary")}))
        return row

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    history = [checkpoint(0, None)]
    t0 = time.perf_counter()
    for step in tqdm(range(1, args.steps + 1), desc="copy fine-tune", unit="step"):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup)
        x = torch.from_numpy(np.stack([_row(train, rng, args.seq_len, args.random_fraction, args.copy_fraction,
                                            len(tok)) for _ in range(args.batch_size)]))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            history.append(checkpoint(step, float(loss)))
    result = {"benchmark": "copy_finetune", "machine": machine_info(), "seconds": time.perf_counter() - t0,
              "settings": vars(args) | {"out": str(args.out)}, "history": history}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
