"""Instruction prompts written by the target itself (Magpie, Xu et al. 2024).

A chat model given its chat template up to the start of a user's message (the template's default system turn
included) writes what a user would ask it: sampled at temperature 1, those requests cover the kinds of
conversation the model was tuned on, which templated prompts (:mod:`speculant.data.instructions`) only approximate. Direct
Alignment needs prompts whose answers look like what the target writes for users; these come from the target's
own idea of a user, need no data and work for any chat target.

Requests are written to a JSONL file (``RUN/self_prompts.jsonl``), one generation batch at a time, each row
``{"messages": [{"role": "user", "content": ...}], "kind": "self", "batch": b}``; an interrupted run resumes
after the last complete batch (batch ``b`` is sampled with seed ``seed * 100003 + b``, so the file is a function
of the arguments). Requests that are empty, shorter than ``min_chars`` or repeat an earlier one are dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["SELF_KIND", "generate_self_prompts", "read_self_prompts"]

SELF_KIND = "self"


def read_self_prompts(path: str | Path) -> list[dict]:
    """The requests in ``path`` (none when it does not exist); a last line cut off by an interruption, and
    the rest of its batch, are dropped."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    if rows and not text.endswith("\n"):
        last = rows[-1]["batch"]
        rows = [r for r in rows if r["batch"] != last]
    return rows


@torch.inference_mode()
def generate_self_prompts(model, tokenizer, n: int, path: str | Path, *, stop_ids: list[int],
                          batch_size: int = 32, max_new_tokens: int = 64, temperature: float = 1.0,
                          min_chars: int = 12, seed: int = 0, progress: bool = True) -> list[dict]:
    """At least ``n`` user requests written by ``model`` after its chat template's user-turn prefix, appended to
    ``path`` batch by batch (resuming the batches already there); returns the first ``n`` rows.

    Args:
        model, tokenizer: a chat model and its tokenizer (with a chat template).
        n: requests wanted.
        stop_ids: the ids that end a turn (:func:`speculant.models.chat.stop_ids`); a request cut at ``max_new_tokens``
            is kept as written.
        temperature: sampling temperature (> 0).

    Raises:
        ValueError: ``n`` or ``batch_size`` below 1, a temperature that is not positive, a tokenizer without a
            chat template, or a model that writes nothing usable in 20 consecutive batches.
    """
    from tqdm.auto import tqdm

    from ...models.chat import user_turn_prefix_ids
    from .answers import sample_batch

    if n < 1 or batch_size < 1:
        raise ValueError(f"self prompts: n and batch_size must be >= 1, got {n} and {batch_size}")
    if not temperature > 0:
        raise ValueError(f"self prompts are sampled: temperature must be > 0, got {temperature}")
    prefix = user_turn_prefix_ids(tokenizer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = read_self_prompts(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")  # drop a cut-off batch
    seen = {r["messages"][0]["content"] for r in rows}
    batch = rows[-1]["batch"] + 1 if rows else 0
    barren = 0
    bar = tqdm(total=n, initial=min(len(rows), n), desc="self prompts", unit="prompt", disable=not progress)
    device = next(model.parameters()).device
    while len(rows) < n:
        gen = torch.Generator(device=device).manual_seed(seed * 100003 + batch)
        texts, _ = sample_batch(model, [prefix] * batch_size, max_new_tokens, temperature, stop_ids, 1, gen)
        new = []
        for ids in texts:
            text = tokenizer.decode([t for t in ids if t not in stop_ids], skip_special_tokens=True).strip()
            if len(text) >= min_chars and text not in seen:
                seen.add(text)
                new.append({"messages": [{"role": "user", "content": text}], "kind": SELF_KIND, "batch": batch})
        with path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in new))
        barren = 0 if new else barren + 1
        if barren >= 20:
            raise ValueError(f"self prompts: the model wrote no usable request in {barren} batches in a row")
        rows += new
        bar.update(min(len(new), n - bar.n))
        batch += 1
    bar.close()
    return rows[:n]
