"""The target's own answers to instruction prompts, with its top-k distribution at every answer token.

Step (2) of Direct Alignment (Goel et al. 2024): the drafter learns what the TARGET writes, so the target answers
the training prompts (chat template applied), sampled at several temperatures. While it writes, the target's
log-probabilities at each answer position are at hand, so the top ``k`` of them are stored: the teacher ``q`` of
step (3) without a second pass of the target over the data (on a CPU that pass would cost as much as the
generation). The mass outside the top ``k`` is not stored; the losses use ``q`` on those ids only (its exact
values, not renormalised), which changes the acceptance reward ``1[q > p]`` only where ``q`` is below the k-th
largest probability.

Answers are written as numbered shards (``answers/shard-00000.npz``), one per generation batch, each renamed into
place when complete, so an interrupted run resumes at the next shard. A run that grows (more prompts appended to
its prompts file) answers the new rows in shards numbered after the existing ones (``first_shard``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from ...core.cache import cache_kwarg
from ...core.sampling import sample_rows

__all__ = ["FORCED", "AnswerShard", "generate_answers", "load_shards", "make_shard", "plan_shards", "sample_batch",
           "run_list", "shard_paths", "shard_totals"]

log = logging.getLogger(__name__)

FORCED = -1.0
"""The ``temperature`` of a teacher-forced sample: the dataset wrote its answer, the target read it
(:mod:`.forced_answers`)."""


@dataclass
class AnswerShard:
    """Answers of one batch, ragged arrays with offsets.

    ``prompt_ids[prompt_offsets[i]:prompt_offsets[i + 1]]`` is sample i's prompt and likewise its answer (stop
    token included); ``topk_ids`` / ``topk_logprobs`` ``[A, k]`` hold the target's top-k at each of the ``A``
    answer tokens, in answer order."""

    prompt_ids: np.ndarray  # [P] int32
    prompt_offsets: np.ndarray  # [N + 1] int64
    answer_ids: np.ndarray  # [A] int32
    answer_offsets: np.ndarray  # [N + 1] int64
    topk_ids: np.ndarray  # [A, k] int32
    topk_logprobs: np.ndarray  # [A, k] float16
    temperature: np.ndarray  # [N] float32
    prompt_index: np.ndarray  # [N] int64: row of the prompts file

    def __len__(self) -> int:
        return len(self.temperature)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, slice]:
        """Prompt ids, answer ids and the slice of answer positions in the top-k arrays of sample ``i``."""
        p0, p1 = self.prompt_offsets[i], self.prompt_offsets[i + 1]
        a0, a1 = self.answer_offsets[i], self.answer_offsets[i + 1]
        return self.prompt_ids[p0:p1], self.answer_ids[a0:a1], slice(int(a0), int(a1))

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **{k: getattr(self, k) for k in self.__dataclass_fields__})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> AnswerShard:
        with np.load(path) as z:
            return cls(**{k: z[k] for k in cls.__dataclass_fields__})


def shard_paths(folder: str | Path) -> list[Path]:
    """The complete shards in ``folder``, in shard order."""
    return sorted(p for p in Path(folder).glob("shard-*.npz") if ".tmp" not in p.name)


def run_list(text: str | None) -> list[Path]:
    """The run directories of a comma-separated list (``--extra-data``); none for None or an empty text."""
    return [Path(e.strip()) for e in (text or "").split(",") if e.strip()]


def shard_totals(folder: str | Path) -> tuple[int, int, bool]:
    """``(answers, answer tokens, forced)`` over the complete shards in ``folder``; ``forced``: some were read by the
    target rather than written (temperature :data:`FORCED`)."""
    answers = tokens = 0
    forced = False
    for path in shard_paths(folder):
        with np.load(path) as z:
            answers += len(z["temperature"])
            tokens += int(z["answer_offsets"][-1])
            forced = forced or bool((z["temperature"] == FORCED).any())
    return answers, tokens, forced


def load_shards(folder: str | Path) -> list[AnswerShard]:
    """Every complete shard in ``folder``, in order."""
    return [AnswerShard.load(p) for p in shard_paths(folder)]


@torch.inference_mode()
def sample_batch(model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                  stop_ids: list[int], topk: int, generator: torch.Generator) -> tuple[list[list[int]], list]:
    """Continue each of ``prompts`` (token ids) until a stop id or ``max_new_tokens``, greedy at ``temperature``
    0, sampled otherwise; returns the continuations (stop token included when reached) and per-continuation
    ``(topk ids [a, k], logprobs [a, k])`` of the model's distribution at each of its tokens."""
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), stop_ids[0], dtype=torch.long, device=device)
    mask = torch.zeros((b, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left padding: every row's next token sits at the same column
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwarg(model, cache),
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
    stop = torch.tensor(stop_ids, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    answers: list[list[int]] = [[] for _ in range(b)]
    tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(b)]
    position = positions[:, -1:]
    for _ in range(max_new_tokens):
        logp = logits.float().log_softmax(-1)
        top = logp.topk(topk, dim=-1)
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = sample_rows((logp / temperature).softmax(-1), generator)  # [B]
        for i in torch.nonzero(~done).flatten().tolist():
            answers[i].append(int(nxt[i]))
            tops[i].append((top.indices[i], top.values[i]))
        done |= torch.isin(nxt, stop)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], 1)
        position = position + 1
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position,
                       **cache_kwarg(model, cache), use_cache=True).logits[:, -1]
    packed = []
    for row in tops:
        packed.append((torch.stack([t[0] for t in row]).cpu().numpy().astype(np.int32),
                       torch.stack([t[1] for t in row]).cpu().numpy().astype(np.float16)))
    return answers, packed


def generate_answers(model, prompts: list[list[int]], out: str | Path, *, stop_ids: list[int],
                     max_new_tokens: int = 128, temperatures: tuple[float, ...] = (0.0, 0.7, 1.0),
                     batch_size: int = 16, topk: int = 32, seed: int = 0, max_batches: int | None = None,
                     first_shard: int = 0, prompt_rows: list[int] | None = None, progress: bool = True) -> Path:
    """Write the target's answers to ``prompts`` (token ids, chat template applied) as shards in ``out``,
    batches of ``batch_size`` prompts of similar length, temperatures cycled per batch. Resumes after the
    shards already there (the batches and their seeds are a function of the arguments only). ``max_batches``
    stops after that many batches (a prefix of the shuffled batch order: a random subset of the prompts).
    ``first_shard`` numbers the shards (and seeds their batches) after those of earlier prompts of the same run;
    ``prompt_rows[i]`` is prompt ``i``'s row in the prompts file (stored as ``prompt_index``; default ``i``)."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    batches = plan_shards(prompts, batch_size, seed, first_shard, max_batches)
    bar = tqdm(total=len(batches), desc="target answers", unit="batch", disable=not progress)
    file_rows = list(range(len(prompts))) if prompt_rows is None else list(prompt_rows)
    for n, rows in enumerate(batches, start=first_shard):
        path = out / f"shard-{n:05d}.npz"
        if path.exists():
            bar.update(1)
            continue
        temperature = float(temperatures[n % len(temperatures)])
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed * 100003 + n)
        answers, tops = sample_batch(model, [prompts[i] for i in rows], max_new_tokens, temperature, stop_ids,
                                      topk, gen)
        shard = make_shard([prompts[i] for i in rows], answers, tops, temperature, [file_rows[i] for i in rows])
        shard.save(path)
        bar.update(1)
        bar.set_postfix(tokens=int(shard.answer_offsets[-1]), T=temperature)
    bar.close()
    return out


def plan_shards(prompts: list[list[int]], size: int, seed: int, first_shard: int = 0,
                max_batches: int | None = None) -> list[list[int]]:
    """The prompts (indices) of each shard, shard ``first_shard`` first: ``size`` prompts of similar length per
    shard, the shards in an order shuffled by ``seed`` (so that any prefix mixes prompt lengths and kinds), the
    first ``max_batches`` of them (all when None). A function of the arguments only: a resumed run plans the same
    shards."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))  # similar lengths: little padding
    batches = [order[s:s + size] for s in range(0, len(order), size)]
    rng = np.random.default_rng(seed + first_shard)
    rng.shuffle(batches)
    return batches[:max_batches] if max_batches is not None else batches


def make_shard(prompts: list[list[int]], answers: list[list[int]], tops: list[tuple[np.ndarray, np.ndarray]],
               temperature: float, prompt_index: list[int]) -> AnswerShard:
    """One shard from its samples: prompt and answer ids, per answer the target's top-k ``(ids [a, k] int32,
    logprobs [a, k] float16)``, the temperature it was written at and each prompt's row of the prompts file."""
    return AnswerShard(
        prompt_ids=np.concatenate([np.asarray(p, np.int32) for p in prompts]),
        prompt_offsets=np.cumsum([0] + [len(p) for p in prompts]).astype(np.int64),
        answer_ids=np.concatenate([np.asarray(a, np.int32) for a in answers]),
        answer_offsets=np.cumsum([0] + [len(a) for a in answers]).astype(np.int64),
        topk_ids=np.concatenate([t[0] for t in tops]),
        topk_logprobs=np.concatenate([t[1] for t in tops]),
        temperature=np.full(len(prompts), temperature, np.float32),
        prompt_index=np.asarray(prompt_index, np.int64),
    )
