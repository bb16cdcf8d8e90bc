"""A dataset's own answers read by the target (teacher forcing): its top-k and states without generating.

The target writing its own answers (:mod:`.batch_answers`) decodes one token per forward; on a CPU that is the
slow part of making a drafter's data (the 1.5B Qwen: ~46 answer tokens/s with 16 sequences decoding together).
When the prompts come with answers (ShareGPT's assistant turns), the target can instead *read* each answer in one
forward over ``prompt + answer[:-1]``: the logits at the answer positions are its distribution of each answer token
given the text before it (the teacher ``q``), and the same forward hands over the states a feature drafter reads
(the outputs of the ``taps`` layers, then the final-normed state), as the EAGLE drafters were first trained (on
ShareGPT's fixed answers). A prefill-like forward runs several times more tokens per second than decoding.

What the drafter then learns is the target's next-token distribution on text the target did not write: the
contexts differ from the ones it will draft in (the target's own answers), the labels do not (they are the target's
own). Direct Alignment's point, answers the target wrote, is given up for data at a higher rate; both kinds of shard
train the same way.

Shards as :func:`.batch_answers.engine_answers` writes them (:class:`.answers.AnswerShard`, planned by
:func:`.answers.plan_shards`, features before answers, resumable, progress appended to ``OUT/RUNS.json``), with
``temperature`` :data:`FORCED` (no temperature wrote them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .answers import FORCED
from .batch_answers import plan_run, write_pair
from .features import to_bits

__all__ = ["FORCED", "forced_answers", "read_answer"]


@torch.inference_mode()
def read_answer(forward, prompt: list[int], answer: list[int], topk: int, with_states: bool
                ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray | None]:
    """One forward of ``forward`` (a :class:`~speculant.core.target_forward.TargetForward`) over
    ``prompt + answer[:-1]``: the target's top-``topk`` ``(ids [A, k] int32, log-probabilities [A, k] float16)`` at
    each answer token (raw distribution) and, with ``with_states``, its states ``[P + A - 1, F]`` as bfloat16 bits
    (int16)."""
    from ...core.cache import SpecCache
    from ...core.checks import num_layers

    model = forward.model
    seq = torch.tensor([prompt + answer[:-1]], device=model.device)  # [1, T]
    cache = SpecCache(num_layers(model), capacity=seq.shape[1] + 8)
    states: list[torch.Tensor] | None = [] if with_states else None
    logits = forward(cache, seq, logits_to_keep=len(answer), hidden_out=states)[0].float()  # [A, V]
    top = logits.topk(min(topk, logits.shape[-1]), dim=-1)  # the log-softmax's top-k: the logits' less their
    values = top.values - logits.logsumexp(-1, keepdim=True)  # log-sum-exp, [A, k]
    pair = (top.indices.to(torch.int32).cpu().numpy(), values.to(torch.float16).cpu().numpy())
    return pair, None if states is None else to_bits(states[0][0])


def forced_answers(target: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]], out: str | Path, *,
                   shard_size: int = 32, topk: int = 32, seed: int = 0, max_batches: int | None = None,
                   first_shard: int = 0, prompt_rows: list[int] | None = None, features: str | Path | None = None,
                   taps: list[int] | None = None, progress: bool = True) -> Path:
    """Write shards of ``prompts`` (token ids, chat template applied) with their given ``answers`` (token ids, stop
    token included where the answer ended) and the target's top-k at every answer token, read in one forward per
    sample (see the module doc); ``features``: also the target's states there (the outputs of ``taps``, then the
    final-normed state). Arguments otherwise as :func:`.batch_answers.engine_answers`; resumes after the shards
    already in ``out``. Returns ``out``."""
    from ...core.target_forward import TargetForward

    if len(answers) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    if any(len(a) == 0 for a in answers):
        raise ValueError("every answer needs at least one token")
    out, features, file_rows, todo, progress_ = plan_run(out, features, prompts, shard_size, seed, first_shard,
                                                         max_batches, prompt_rows, "answers read by the target",
                                                         progress, forced=True)
    forward = TargetForward(target, taps=list(taps or []))
    for n, rows in todo:
        results = {}
        for i in rows:
            top, states = read_answer(forward, prompts[i], answers[i], topk, features is not None)
            results[i] = (answers[i], top, states)
            progress_.tokens += len(answers[i])
        write_pair(out, features, n, rows, results, prompts, FORCED, file_rows)
        progress_.shard_written()
    progress_.close()
    return out
