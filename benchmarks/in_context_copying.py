"""Does the target copy from its context, and how far back does it look? (Why retrieval tasks, mask probing and
KeyDiff say little on the bundled model.)

Teacher-forced probes on the ``--files`` longest held-out modules:

* **held-out text repeated:** ``segment + segment`` for a ``--length``-token segment of each module; greedy top-1
  accuracy on the first occurrence vs on the verbatim repeat. A model that copies (induction heads) is
  near-perfect on the repeat.
* **random tokens repeated:** ``--repeats`` copies of a random token sequence; accuracy on each copy (the first
  one cannot be predicted; later ones can only be copied).
* **attention heads** (on the repeated held-out segments): per layer, the largest mean attention any head pays to
  the previous token (a previous-token head) and, from the repeat, to the token after the earlier occurrence of
  the current token (an induction head; Olsson et al. 2022). Scores near 1 mark such heads; near 0, none.
* **context dependence:** top-1 agreement and KL between the predictions for the last tokens of a
  ``--window``-token window with the whole window as context and with its first D tokens dropped. A model that
  uses distant context disagrees more as D grows; one that agrees almost fully is local, so a recent-window
  cache (StreamingLLM) is nearly optimal for it.

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
from speculant.bench.kv_fidelity import default_texts

DROPS = (8, 32, 128, 256, 400)


def _accuracy(logits: torch.Tensor, ids: list[int], start: int, end: int) -> float:
    """Top-1 accuracy of ``logits [T, V]``'s predictions of ``ids[start:end]``."""
    pred = logits[start - 1 : end - 1].argmax(-1)
    return float((pred == torch.tensor(ids[start:end])).float().mean())


def _head_scores(attentions, n: int) -> tuple[list[float], list[float]]:
    """Per layer, the best head's mean previous-token and induction attention on a ``2n``-token ``seg + seg``."""
    prev_rows, ind_rows = torch.arange(1, 2 * n), torch.arange(n, 2 * n - 1)
    prev, ind = [], []
    for att in attentions:  # [1, H, T, T]
        a = att[0].float()
        prev.append(float(a[:, prev_rows, prev_rows - 1].mean(-1).max()))
        ind.append(float(a[:, ind_rows, ind_rows - n + 1].mean(-1).max()))
    return prev, ind


@torch.no_grad()
def probe(model, tok, texts: dict[str, str], length: int = 200, repeats: int = 3, window: int = 600,
          seed: int = 0) -> dict:
    """All probes on ``model`` (its attention implementation is switched to eager for the head scores and back)."""
    was_training = model.training
    model.eval()
    n = length
    rows, prev, ind = [], [], []
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        for name, text in texts.items():
            seg = tok(text, add_special_tokens=False)["input_ids"][:n]
            ids = seg + seg
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
            logits = out.logits[0]
            rows.append({"module": name, "first": _accuracy(logits, ids, 1, n), "repeat": _accuracy(logits, ids, n, 2 * n)})
            p, i = _head_scores(out.attentions, n)
            prev.append(p)
            ind.append(i)
    finally:
        model.config._attn_implementation = impl
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, len(tok), (n,), generator=gen).tolist()
    ids = seq * repeats
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    random_rows = [_accuracy(logits, ids, max(1, i * n), (i + 1) * n) for i in range(repeats)]
    scored = window - max(DROPS)  # the last tokens, predicted in every variant
    dependence = {d: {"top1_agreement": [], "kl": []} for d in DROPS}
    for text in texts.values():
        ids = tok(text, add_special_tokens=False)["input_ids"][:window]
        full = model(input_ids=torch.tensor([ids])).logits[0, -scored:].float().log_softmax(-1)
        for d in DROPS:
            part = model(input_ids=torch.tensor([ids[d:]])).logits[0, -scored:].float().log_softmax(-1)
            dependence[d]["top1_agreement"].append(float((full.argmax(-1) == part.argmax(-1)).float().mean()))
            dependence[d]["kl"].append(float((full.exp() * (full - part)).sum(-1).mean()))
    model.train(was_training)
    return {
        "held_out_text": rows,
        "held_out_mean": {k: mean([r[k] for r in rows]) for k in ("first", "repeat")},
        "random_tokens_accuracy_per_copy": random_rows,
        "previous_token_head_per_layer": [mean(col) for col in zip(*prev)],
        "induction_head_per_layer": [mean(col) for col in zip(*ind)],
        "context_dependence": {
            "window": window, "scored_last_tokens": scored,
            "rows": [{"dropped_first_tokens": d, "top1_agreement": mean(v["top1_agreement"]), "kl": mean(v["kl"])}
                     for d, v in dependence.items()],
        },
    }


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def summary(result: dict) -> dict:
    """The headline numbers of :func:`probe`'s result."""
    return {
        "repeat_vs_first": [round(result["held_out_mean"][k], 3) for k in ("repeat", "first")],
        "random_copies": [round(x, 3) for x in result["random_tokens_accuracy_per_copy"]],
        "max_induction_head": round(max(result["induction_head_per_layer"]), 3),
        "max_previous_token_head": round(max(result["previous_token_head_per_layer"]), 3),
        "agreement_after_drop": {r["dropped_first_tokens"]: round(r["top1_agreement"], 3)
                                 for r in result["context_dependence"]["rows"]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--length", type=int, default=200, help="tokens per segment")
    ap.add_argument("--files", type=int, default=4, help="held-out modules (the longest)")
    ap.add_argument("--repeats", type=int, default=3, help="copies of the random sequence")
    ap.add_argument("--window", type=int, default=600, help="tokens per window of the context-dependence probe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/in_context_copying.json"))
    args = ap.parse_args()
    if args.window <= max(DROPS):
        ap.error(f"--window must exceed {max(DROPS)} (the largest number of dropped tokens)")
    torch.set_num_threads(args.threads)
    model, tok = speculant.load_pretrained(args.target)
    found = probe(model, tok, default_texts(args.files), args.length, args.repeats, args.window, args.seed)
    result = {"benchmark": "in_context_copying", "machine": machine_info(),
              "settings": vars(args) | {"out": str(args.out)}} | found
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary(result)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
