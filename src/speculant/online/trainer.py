"""The training side of an online update: a trainable copy of the draft model and one optimizer step on it.

The copy shares (does not copy) every tensor of the target, and trains only the draft's own parameters: its token
embedding and LM head (for an attached drafter: the target's, shared) stay frozen. A step distils the copy towards
the target's kept top-``k`` distribution at the observed positions (forward KL by default, the loss of Liu et al.
2024; TVD or TVD++ as options), optionally plus a next-token loss on the prompt's own text.
"""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import torch

from ..train.losses import distill_loss_probs
from .config import OnlineConfig
from .observed import Observation
from .window import window_logits

__all__ = ["distillation_loss", "optimizer_step", "trainable_copy", "trained_positions"]


def trainable_copy(model: torch.nn.Module, target: torch.nn.Module
                   ) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """A deep copy of ``model`` sharing (not copying) ``target``'s tensors, and its trainable parameters: all but
    the token embedding, the LM head and anything shared with the target."""
    memo: dict[int, Any] = {id(t): t for t in target.parameters()}
    memo.update({id(m): m for m in target.modules()})
    candidate = copy.deepcopy(model, memo)
    frozen = {id(p) for p in target.parameters()}
    for m in (candidate.get_input_embeddings(), candidate.get_output_embeddings()):
        if m is not None:
            frozen.update(id(p) for p in m.parameters())
    params = []
    for p in candidate.parameters():
        train = id(p) not in frozen and p.is_floating_point()
        p.requires_grad_(train)
        if train:
            params.append(p)
    if not params:
        raise ValueError("the draft model has no parameters of its own to adapt")
    return candidate, params


def trained_positions(o: Observation, positions: str) -> torch.Tensor:
    """``[P]`` bool: the positions of ``o`` a step trains on (``"rejected"``: the refused ones; ``"all"``)."""
    return o.rejected if positions == "rejected" else torch.ones_like(o.rejected)


def distillation_loss(model: torch.nn.Module, o: Observation, config: OnlineConfig) -> torch.Tensor:
    """The distillation loss of ``model`` on ``o``'s trained positions (within the context window), plus
    :attr:`~.config.OnlineConfig.prompt_weight` times the next-token loss on the prompt's tokens in that window."""
    keep = trained_positions(o, config.positions)  # [P']
    prompt = config.prompt_weight > 0
    logits, selected, text_rows = window_logits(model, o, keep, config.window, prompt)  # [P + R, V]
    top_ids, top_p = o.top_ids[keep][selected].long(), o.top_p[keep][selected].float()  # [P, k]
    vocab = logits.shape[-1]
    own, text = logits[: len(top_ids)], logits[len(top_ids):]  # [P, V], [R, V]
    top_p = top_p * (top_ids < vocab)  # [P, k]: a token beyond the draft's vocabulary weighs nothing
    q = torch.zeros_like(own, dtype=torch.float32).scatter_(1, top_ids.clamp_max(vocab - 1), top_p)  # [P, V]
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-12)
    loss = distill_loss_probs(own, q, config.loss)
    labels = o.ids[text_rows + 1].long()  # [R]: the prompt token each row predicts
    if prompt and bool((labels < vocab).any()):  # (an id beyond the draft's vocabulary is no label)
        loss = loss + config.prompt_weight * torch.nn.functional.cross_entropy(
            text.float(), labels.masked_fill(labels >= vocab, -100), ignore_index=-100)
    return loss


def optimizer_step(candidate: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                   batch: list[Observation], config: OnlineConfig) -> Generator[None, None, float]:
    """Generator: one optimizer step of ``candidate`` on ``batch`` (one forward and backward per observation,
    yielding after each: a server gets the CPU back between them, gradients clipped to norm 1); returns the batch's
    mean loss (drive it with :func:`~.scheduler.run_steps` to take it whole)."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for o in batch:
        with torch.enable_grad():
            loss = distillation_loss(candidate, o, config) / len(batch)
            loss.backward()
        total += float(loss.detach())
        yield
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return total
