"""Does the target copy from its context? (Why retrieval tasks and mask probing say little on the bundled model.)

Two teacher-forced probes, greedy top-1 accuracy of the next token:

* held-out text repeated: ``segment + segment`` for a ``--length``-token segment of each of the ``--files``
  longest held-out modules; accuracy on the first occurrence vs on the verbatim repeat. A model that copies
  (induction heads) is near-perfect on the repeat.
* random tokens repeated: ``--repeats`` copies of a random token sequence; accuracy on each copy (the first one
  cannot be predicted; later ones can only be copied).

    python benchmarks/in_context_copying.py [--target default-target] [--length 200] [--files 4]
        [--out benchmarks/results/in_context_copying.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import speculant
from speculant.bench.speed import machine_info
from speculant.kv.evaluate import default_texts


@torch.no_grad()
def _accuracy(model, ids: list[int], start: int, end: int) -> float:
    """Top-1 accuracy of the predictions of ``ids[start:end]`` given everything before each."""
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    pred = logits[start - 1 : end - 1].argmax(-1)
    return float((pred == torch.tensor(ids[start:end])).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--length", type=int, default=200, help="tokens per segment")
    ap.add_argument("--files", type=int, default=4, help="held-out modules (the longest)")
    ap.add_argument("--repeats", type=int, default=3, help="copies of the random sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/in_context_copying.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = speculant.load_pretrained(args.target)
    n = args.length
    text_rows = []
    for name, text in default_texts(args.files).items():
        seg = tok(text, add_special_tokens=False)["input_ids"][:n]
        ids = seg + seg
        text_rows.append({"module": name, "first": _accuracy(model, ids, 1, n), "repeat": _accuracy(model, ids, n, 2 * n)})
    gen = torch.Generator().manual_seed(args.seed)
    seq = torch.randint(0, len(tok), (n,), generator=gen).tolist()
    ids = seq * args.repeats
    random_rows = [_accuracy(model, ids, max(1, i * n), (i + 1) * n) for i in range(args.repeats)]
    result = {
        "benchmark": "in_context_copying", "machine": machine_info(), "settings": vars(args) | {"out": str(args.out)},
        "held_out_text": text_rows,
        "held_out_mean": {k: sum(r[k] for r in text_rows) / len(text_rows) for k in ("first", "repeat")},
        "random_tokens_accuracy_per_copy": random_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("held_out_mean", "random_tokens_accuracy_per_copy")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
