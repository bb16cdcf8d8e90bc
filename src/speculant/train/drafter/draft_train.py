"""Stage 3 of ``speculant train draft``: fine-tune an attached drafter on the target's answers.

The drafter (:mod:`speculant.models.attached`: a few of the target's layers, the target's embedding and LM head frozen)
learns, at every answer position, the target's distribution ``q`` (its stored top-k) with one of the losses of
:mod:`..losses` (FKL, TVD, TVD++). The student's distribution is taken over the VocabTrim kept set ``K`` (the
most frequent tokens of the answers) because that is the head the deployed drafter drafts from: training and
use see the same ``p_θ``, and the head costs |K| instead of |V| rows per position.

Each sample is its prompt's last ``context`` tokens followed by the answer (with their original positions, so
RoPE sees what it sees at inference); the loss covers the answer tokens only. Validation reports the greedy
agreement (the student's top token is the target's) and ``α = Σ_{x ∈ K} min(p_θ(x), q(x))`` on held-out answers:
the acceptance rates of one draft token under greedy and T=1 speculative decoding (α a lower bound: ``q`` is
known on its top-k only).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .answers import AnswerShard
from ..losses import distill_loss_probs

__all__ = ["Sample", "collect_samples", "kept_ids", "kept_head", "Batch", "make_batch", "batches", "evaluate",
           "train_attached", "Objective", "TokenObjective"]

log = logging.getLogger(__name__)


@dataclass
class Sample:
    context: np.ndarray  # [c] prompt tail
    answer: np.ndarray  # [a]
    topk_ids: np.ndarray  # [a, k]
    topk_logprobs: np.ndarray  # [a, k]
    start: int  # position of context[0]
    row: int = -1  # the prompt's row in the run's prompts file (which split it belongs to)


def collect_samples(shards: list[AnswerShard], context: int) -> list[Sample]:
    """One :class:`Sample` per answer, with the last ``context`` prompt tokens."""
    out = []
    for sh in shards:
        for i in range(len(sh)):
            prompt, answer, rows = sh.sample(i)
            if len(answer) == 0:
                continue
            ctx = prompt[-context:]
            out.append(Sample(ctx, answer, sh.topk_ids[rows], sh.topk_logprobs[rows], len(prompt) - len(ctx),
                              row=int(sh.prompt_index[i])))
    return out


def kept_ids(samples: list[Sample], vocab: int, keep: int, always: list[int]) -> list[int]:
    """The ``keep`` most frequent answer tokens (VocabTrim's ranking), plus ``always`` (the stop tokens)."""
    from ..calibrate import token_ranking

    ranking, _ = token_ranking(np.concatenate([s.answer for s in samples]), vocab)
    ids = ranking[:keep]
    return ids + [t for t in always if t not in set(ids)]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    positions: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1 for real tokens
    rows: torch.Tensor  # [N] batch row of each answer position
    cols: torch.Tensor  # [N] column whose hidden state predicts it
    answer: torch.Tensor  # [N] the answer token (in vocabulary ids)
    q: torch.Tensor  # [N, K] the target's probabilities on the kept set (top-k only, zeros elsewhere)


def make_batch(samples: list[Sample], kept_index: torch.Tensor, pad: int) -> Batch:
    """Pack samples; ``kept_index`` ``[V]`` maps a vocabulary id to its kept-set column (-1: not kept)."""
    width = max(len(s.context) + len(s.answer) - 1 for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad, dtype=torch.long)
    pos = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    rows, cols, answers, tids, tlps = [], [], [], [], []
    for r, s in enumerate(samples):
        seq = np.concatenate([s.context, s.answer[:-1]])
        n = len(seq)
        ids[r, :n] = torch.from_numpy(seq.astype(np.int64))
        pos[r, :n] = torch.arange(s.start, s.start + n)
        mask[r, :n] = 1
        a = len(s.answer)
        rows.append(torch.full((a,), r))
        cols.append(torch.arange(len(s.context) - 1, len(s.context) - 1 + a))
        answers.append(torch.from_numpy(s.answer.astype(np.int64)))
        tids.append(torch.from_numpy(s.topk_ids.astype(np.int64)))
        tlps.append(torch.from_numpy(s.topk_logprobs.astype(np.float32)))
    tid, tlp = torch.cat(tids), torch.cat(tlps)  # [N, k]
    col = kept_index[tid]  # [N, k]
    q = torch.zeros((tid.shape[0], int(kept_index.max()) + 1))
    keep = col >= 0
    q[torch.nonzero(keep)[:, 0], col[keep]] = tlp[keep].exp()
    return Batch(ids, pos, mask, torch.cat(rows), torch.cat(cols), torch.cat(answers), q)


def kept_head(draft, kept: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept_index [V]: vocabulary id -> kept column or -1, head [K, H]: the frozen LM head's kept rows)``."""
    vocab = draft.get_input_embeddings().weight.shape[0]
    kept_index = torch.full((vocab,), -1, dtype=torch.long)
    kept_index[torch.tensor(kept)] = torch.arange(len(kept))
    head = draft.get_output_embeddings().weight.detach()[torch.tensor(kept)].float()
    return kept_index, head


class Objective:
    """What a drafter is trained on: how samples become a batch and what the drafter predicts from it.

    :meth:`predict` returns the student's logits over the kept set at the answer positions, ``[N, K]``, once per
    draft depth it simulates (a token-level drafter: one; a feature drafter unrolled over its own states: more),
    and an auxiliary loss (or None). The distillation loss is averaged over the depths."""

    def batch(self, samples: list[Sample], kept_index: torch.Tensor, pad: int):
        raise NotImplementedError

    def predict(self, draft, batch, head: torch.Tensor, training: bool) -> tuple[list[torch.Tensor],
                                                                                  torch.Tensor | None]:
        raise NotImplementedError


class TokenObjective(Objective):
    """A token-level drafter: its hidden state at a position predicts the next token."""

    def batch(self, samples: list[Sample], kept_index: torch.Tensor, pad: int) -> Batch:
        return make_batch(samples, kept_index, pad)

    def predict(self, draft, batch: Batch, head: torch.Tensor, training: bool):
        hidden = draft.model(input_ids=batch.input_ids, attention_mask=batch.mask,
                             position_ids=batch.positions).last_hidden_state  # [B, T, H]
        h = hidden[batch.rows, batch.cols]  # [N, H]
        return [h @ head.T], None


TOKEN = TokenObjective()


def batches(samples: list[Sample], kept_index: torch.Tensor, batch_size: int, pad: int,
            objective: Objective = TOKEN) -> list:
    """``samples`` packed in order, ``batch_size`` at a time (validation)."""
    return [objective.batch(samples[i:i + batch_size], kept_index, pad) for i in range(0, len(samples), batch_size)]


@torch.no_grad()
def evaluate(draft, batches: list, head: torch.Tensor, objective: Objective = TOKEN) -> dict:
    """Greedy agreement and α on held-out batches (see the module docstring); with several simulated depths,
    also ``greedy_agreement_d2``... for the deeper ones."""
    agree: list[float] = []
    alpha: list[float] = []
    n = 0
    for batch in batches:
        steps, _ = objective.predict(draft, batch, head, training=False)
        for d, logits in enumerate(steps):
            logits = logits.float()
            if d == len(agree):
                agree.append(0.0)
                alpha.append(0.0)
            agree[d] += float((logits.argmax(-1) == batch.q.argmax(-1)).sum())
            alpha[d] += float(torch.minimum(logits.softmax(-1), batch.q).sum())
        n += steps[0].shape[0]
    out = {"greedy_agreement": agree[0] / max(n, 1), "alpha_t1": alpha[0] / max(n, 1), "positions": int(n)}
    for d in range(1, len(agree)):
        out[f"greedy_agreement_d{d + 1}"] = agree[d] / max(n, 1)
        out[f"alpha_t1_d{d + 1}"] = alpha[d] / max(n, 1)
    return out


def train_attached(draft, samples: list[Sample], validation: list[Sample], kept: list[int], out: Path, *,
                   loss: str, steps: int, batch_size: int, lr: float, warmup: int, seed: int, pad: int,
                   amp: torch.dtype | None = None, eval_every: int = 50, ckpt_every: int = 50,
                   progress: bool = True, objective: Objective = TOKEN, group_by_length: bool = False,
                   frozen: tuple[str, ...] = ()) -> list[dict]:
    """Train the drafter's own parameters but those whose names start with one of ``frozen`` (resumable from
    ``out/checkpoint.pt``); return the history. ``amp``:
    the autocast dtype of the drafter's forward (the loss is computed in float32); ``objective``: what it
    learns to predict (:class:`TokenObjective`, or a feature drafter's). ``group_by_length``: each batch is a
    random run of samples of similar length (less padding: a batch costs its longest sample) instead of a
    uniform random draw."""
    from tqdm.auto import tqdm

    from ...models.attached import own_state

    out.mkdir(parents=True, exist_ok=True)
    kept_index, head = kept_head(draft, kept)  # [V], [K, H] frozen
    for p in draft.parameters():
        p.requires_grad_(False)
    trained = {n for n in own_state(draft) if not n.startswith(frozen)}  # the parameters learning (and saved)
    own = [p for n, p in draft.named_parameters() if n in trained]
    for p in own:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(own, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(seed)
    val_batches = batches(validation, kept_index, batch_size, pad, objective)
    by_length = np.argsort([len(x.context) + len(x.answer) for x in samples], kind="stable") if group_by_length \
        else None
    ckpt = out / "checkpoint.pt"
    step, history = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["own"], strict=False)
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        step, history = state["step"], state["history"]
        log.info("resumed %s at step %d", out, step)
    if step == 0:
        history.append({"step": 0, **evaluate(draft.eval(), val_batches, head, objective)})

    def lr_at(s: int) -> float:
        if s < warmup:
            return lr * (s + 1) / warmup
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))

    bar = tqdm(total=steps, initial=step, desc=f"drafter {loss}", unit="step", disable=not progress)
    t0 = time.perf_counter() - float(history[-1].get("seconds") or 0.0) if history else time.perf_counter()
    while step < steps:
        draft.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        picks = _picks(rng, by_length, len(samples), min(batch_size, len(samples)))
        batch = objective.batch([samples[i] for i in picks], kept_index, pad)
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            depths, aux = objective.predict(draft, batch, head, training=True)
        value = sum(distill_loss_probs(logits, batch.q, loss) for logits in depths) / len(depths)
        if aux is not None:
            value = value + aux
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(own, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{value.item():.4f}")
        if step % eval_every == 0 or step == steps:
            row = {"step": step, "loss": value.item(), "lr": lr_at(step - 1),
                   "seconds": time.perf_counter() - t0, **evaluate(draft.eval(), val_batches, head, objective)}
            history.append(row)
            bar.set_postfix(loss=f"{value.item():.4f}", agree=f"{row['greedy_agreement']:.3f}",
                            alpha=f"{row['alpha_t1']:.3f}")
        if step % ckpt_every == 0 or step == steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"own": {k: v for k, v in own_state(draft).items() if k in trained},
                        "optimizer": opt.state_dict(), "rng": rng.bit_generator.state,
                        "step": step, "history": history}, tmp)
            tmp.replace(ckpt)
    bar.close()
    draft.eval()
    (out / "history.json").write_text(json.dumps(history, indent=1))
    return history


def _picks(rng: np.random.Generator, by_length: np.ndarray | None, n: int, size: int) -> np.ndarray:
    """One batch's indices among ``n`` samples: ``size`` drawn uniformly without replacement, or, with
    ``by_length`` (the sample indices sorted by length), a random window of ``size`` consecutive ones in it."""
    if by_length is None:
        return rng.choice(n, size=size, replace=False)
    return by_length[int(rng.integers(0, n - size + 1)):][:size]
