"""Distillation data: the target's own completions of training-split prompts.

Step (2) of the draft-training pipeline of Goel et al. 2024 ("Direct Alignment of Draft Model for Speculative
Decoding with Chat-Fine-Tuned LLMs"): a drafter is rewarded for predicting what the TARGET writes, so it is
fine-tuned on text the target generated, with the target's distribution as the teacher (step 3, in
:mod:`.pretrain` with ``teacher`` and ``train_split``).

Prompts come only from the training split, so held-out modules stay unseen: half are a function's signature and
docstring (the shape of the benchmark prompts), half random windows of the token stream starting at a line
start. The target completes them in batches (left padding), cycling through the configured temperatures, and
the result is written next to the prepared splits as ``{split}.npy`` (prompt + completion + EOS per sample,
uint16) with a ``{split}.json`` describing how it was made.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .data import load_split

__all__ = ["DistillDataConfig", "generate_distill_data"]


@dataclass
class DistillDataConfig:
    """How the target's completions are generated (saved beside the data)."""

    data: str  # directory written by ``prepare``; the result lands there as ``{split}.npy``
    teacher: str  # HF directory of the target model
    split: str = "distill"
    prompts: int = 4096
    max_new_tokens: int = 160
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 384
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.6, 1.0])  # cycled per batch
    batch_size: int = 64
    precision: str = "auto"  # auto | fp32 | bf16 (generation speed only: the teacher is re-run in training)
    seed: int = 0
    threads: int | None = None


def _window_prompts(tokens: np.ndarray, newline_ids: set[int], n: int, lo: int, hi: int,
                    rng: np.random.Generator) -> list[list[int]]:
    """``n`` windows of the stream of ``lo..hi`` tokens, each starting just after a newline token."""
    out: list[list[int]] = []
    while len(out) < n:
        s = int(rng.integers(0, len(tokens) - hi - 1))
        while s < len(tokens) - hi - 1 and int(tokens[s]) not in newline_ids:
            s += 1
        length = int(rng.integers(lo, hi + 1))
        out.append([int(t) for t in tokens[s + 1 : s + 1 + length]])
    return out


def _docstring_prompts(tokenizer, n: int, lo: int, hi: int, rng: np.random.Generator) -> list[list[int]]:
    from ...data.prompts import (
        code_prompts,  # signature + docstring extraction, here on the TRAIN split
    )

    rows = code_prompts(n=10**9, split="train")
    picked = rng.permutation(len(rows))
    out: list[list[int]] = []
    for i in picked:
        ids = tokenizer(rows[int(i)]["prompt"], add_special_tokens=False).input_ids
        if lo <= len(ids) <= hi:
            out.append(ids)
        if len(out) == n:
            break
    return out


def generate_distill_data(cfg: DistillDataConfig, progress: bool = True) -> Path:
    """Generate the completions; return the path of the written ``{split}.npy``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data = Path(cfg.data)
    tokenizer = AutoTokenizer.from_pretrained(data, local_files_only=True)
    eos = tokenizer.eos_token_id
    use_bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.teacher, local_files_only=True, dtype=dtype).eval()
    rng = np.random.default_rng(cfg.seed)
    newline_ids = {i for tok, i in tokenizer.get_vocab().items() if tok.endswith("Ċ")}  # byte-level "\n"
    tokens = load_split(data, "train")
    half = cfg.prompts // 2
    prompts = _docstring_prompts(tokenizer, half, cfg.min_prompt_tokens, cfg.max_prompt_tokens, rng)
    prompts += _window_prompts(tokens, newline_ids, cfg.prompts - len(prompts), cfg.min_prompt_tokens,
                               cfg.max_prompt_tokens, rng)
    prompts.sort(key=len)  # similar lengths per batch: little padding
    batches = [prompts[i : i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    order = rng.permutation(len(batches))
    stream: list[int] = []
    generated = 0
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), disable=not progress, desc="distill data", unit="prompt")
    gen = torch.Generator().manual_seed(cfg.seed)
    for step, b in enumerate(order):
        batch = batches[int(b)]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), eos, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        temperature = cfg.temperatures[step % len(cfg.temperatures)]
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {
            "do_sample": False}
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                 pad_token_id=eos, eos_token_id=eos, **sampling)
        for row, p in enumerate(batch):
            completion = out[row, width:].tolist()
            if eos in completion:
                completion = completion[: completion.index(eos)]
            generated += len(completion)
            stream.extend(p + completion + [eos])
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.0f}")
    bar.close()
    path = data / f"{cfg.split}.npy"
    np.save(path, np.asarray(stream, dtype=np.uint16))
    info = {"config": asdict(cfg), "samples": len(prompts), "tokens": len(stream), "generated_tokens": generated,
            "seconds": round(time.perf_counter() - start, 1), "dtype": str(dtype)}
    (data / f"{cfg.split}.json").write_text(json.dumps(info, indent=1))
    return path
