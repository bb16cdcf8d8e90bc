"""The target's answers written by speculant's own batched engine, with its top-k and hidden states.

The same shards as :func:`.answers.generate_answers` (same planning, :func:`.answers.plan_shards`; same format,
:class:`.answers.AnswerShard`), written another way, for targets too large to answer through transformers in
reasonable time on a CPU:

* **the deployed weights**: the target as :func:`speculant.load_pretrained` gives it with its quantization (the
  1.5B's ``file`` quantization), decoded by the lean forward, so the drafter learns what the target people run writes;
* **continuous batching** (:class:`speculant.core.batch.Batch`): up to ``batch`` sequences decode together, one
  forward per step for all of them; a finished sequence's place goes to the next prompt at once (no padding, no
  waiting for a batch's longest answer). Shards complete out of order and each is written when its last answer is
  done, so an interruption loses at most the shards in flight;
* **the teacher for free**: the top-k log-probabilities of every answer token come out of the decoding forward
  (``logprobs=``, :mod:`speculant.core.logprobs`: raw distribution, as the transformers path stores);
* **features for free**: for feature drafters, each sequence carries a :class:`StateRecorder`, a drafter that
  never drafts but declares the capabilities that make the engine hand it the target's states (the outputs of the
  ``taps`` layers, then the final-normed state) of every token entering the cache: prompt and answer but its last
  token, exactly the rows :func:`.features.sequence_lengths` counts, written as ``FEATURES/shard-NNNNN.npy``
  before the answer shard (the answer shard marks the pair complete). The separate feature pass over the answers
  (:func:`.features.extract_features`), a second target forward over every token, is not needed.

Sampled answers draw from each sequence's own generator, seeded by the prompt's row of the prompts file: a resumed
run writes the same shards. Each run appends its progress (shards, answer tokens, seconds, tokens/s: tokens of
answers finished in that run, prompts' prefill included in the time) to ``OUT/RUNS.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ...core.batch import Batch
from ...core.drafting import DecodeState, Drafter
from ...core.tree import DraftTree
from .answers import make_shard, plan_shards
from .features import to_bits

__all__ = ["RunProgress", "StateRecorder", "engine_answers", "plan_run", "write_pair"]

log = logging.getLogger(__name__)


class StateRecorder(Drafter):
    """A drafter that never drafts and keeps every target state the engine hands it (see the module doc)."""

    uses_target_hidden = True

    def __init__(self, taps: list[int] | tuple[int, ...] = ()) -> None:
        self.target_taps = tuple(taps)
        self._state: DecodeState | None = None

    def begin(self, state: DecodeState) -> None:
        self._state = state

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree(tokens=[], parents=[])

    def states(self) -> torch.Tensor:
        """``[P + A - 1, F]``: the target's states of every token that entered the cache, in order."""
        if self._state is None or not self._state.target_hidden:
            raise ValueError("no target states recorded: the sequence has not run")
        return torch.cat(self._state.target_hidden)


def engine_answers(target: torch.nn.Module, prompts: list[list[int]], out: str | Path, *, stop_ids: list[int],
                   max_new_tokens: int = 128, temperatures: tuple[float, ...] = (0.0, 0.7, 1.0),
                   shard_size: int = 32, batch: int = 16, topk: int = 32, seed: int = 0,
                   max_batches: int | None = None, first_shard: int = 0, prompt_rows: list[int] | None = None,
                   features: str | Path | None = None, taps: list[int] | None = None,
                   progress: bool = True) -> Path:
    """Write the target's answers to ``prompts`` (token ids, chat template applied) as shards in ``out``
    (arguments as :func:`.answers.generate_answers`; ``shard_size`` prompts per shard, up to ``batch`` decoding at
    once), resuming after the shards already there. ``features``: also write each shard's target states there
    (the outputs of ``taps``, then the final-normed state). Returns ``out``."""
    out, features, file_rows, todo, progress_ = plan_run(out, features, prompts, shard_size, seed, first_shard,
                                                         max_batches, prompt_rows, "target answers", progress,
                                                         batch=batch)
    queue = deque((n, i) for n, rows in todo for i in rows)
    plan = dict(todo)  # shard -> its prompts, in plan order
    left = {n: len(rows) for n, rows in todo}
    done: dict[int, dict[int, tuple]] = {n: {} for n, _ in todo}
    engine = Batch(target, speculation="off")
    live: dict[int, tuple[int, int, StateRecorder | None]] = {}
    while queue or live:
        while queue and len(live) < batch:
            n, i = queue.popleft()
            recorder = StateRecorder(taps or []) if features is not None else None
            index = engine.add(prompts[i], recorder, max_new_tokens, temperatures[n % len(temperatures)],
                               seed=seed * 100003 + file_rows[i], eos_token_id=list(stop_ids), logprobs=topk)
            live[index] = (n, i, recorder)
        for event in engine.step():
            if not event.done:
                continue
            n, i, recorder = live.pop(event.sequence)
            gen = engine.result(event.sequence)
            engine.release(event.sequence)
            top = np.asarray([[t for t, _ in lp.top] for lp in gen.logprobs], np.int32)  # [a, k]
            values = np.asarray([[v for _, v in lp.top] for lp in gen.logprobs], np.float16)  # [a, k]
            states = None
            if recorder is not None:
                states = to_bits(recorder.states())  # [P + A - 1, F]
            done[n][i] = (list(gen.token_ids), (top, values), states)
            progress_.tokens += len(gen.token_ids)
            left[n] -= 1
            if left[n] == 0:
                write_pair(out, features, n, plan[n], done.pop(n),
                           prompts, temperatures[n % len(temperatures)], file_rows)
                progress_.shard_written()
    progress_.close()
    return out


class RunProgress:
    """One answering run's progress: a bar over the shards and the run's record in ``OUT/RUNS.json`` (shards
    written, answer tokens finished, seconds, tokens/s; the progress of every run, for reports), rewritten after each
    shard. Add finished answers' tokens to :attr:`tokens`."""

    def __init__(self, out: Path, total: int, done: int, desc: str, progress: bool, **fields) -> None:
        from tqdm.auto import tqdm

        self._file = out / "RUNS.json"
        self._runs = json.loads(self._file.read_text()) if self._file.exists() else []
        self.record = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields, "shards": 0, "answer_tokens": 0,
                       "seconds": 0.0}
        self._runs.append(self.record)
        self._bar = tqdm(total=total, initial=done, desc=desc, unit="shard", disable=not progress)
        self.tokens, self._start = 0, time.perf_counter()

    def shard_written(self) -> None:
        self._bar.update(1)
        seconds = time.perf_counter() - self._start
        self._bar.set_postfix(tok_s=f"{self.tokens / seconds:.1f}")
        self.record.update(shards=self.record["shards"] + 1, answer_tokens=self.tokens, seconds=round(seconds, 1),
                           answer_tokens_per_s=round(self.tokens / seconds, 2))
        self._file.write_text(json.dumps(self._runs, indent=1))

    def close(self) -> None:
        self._bar.close()


def plan_run(out, features, prompts: list[list[int]], shard_size: int, seed: int, first_shard: int,
             max_batches: int | None, prompt_rows: list[int] | None, desc: str, progress: bool, **fields):
    """The common start of an answering run: ``(out, features, file_rows, todo, progress)``: the output folders made
    (``features`` None stays None), each prompt's row of the prompts file, the shards still to write
    ``[(n, prompt indices)]`` (:func:`.answers.plan_shards`; those already in ``out`` skipped) and the run's
    :class:`RunProgress` (``fields`` go into its record)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if features is not None:
        features = Path(features)
        features.mkdir(parents=True, exist_ok=True)
    file_rows = list(range(len(prompts))) if prompt_rows is None else list(prompt_rows)
    shards = list(enumerate(plan_shards(prompts, shard_size, seed, first_shard, max_batches), start=first_shard))
    todo = [(n, rows) for n, rows in shards if not (out / f"shard-{n:05d}.npz").exists()]
    return out, features, file_rows, todo, RunProgress(out, len(shards), len(shards) - len(todo), desc, progress,
                                                        **fields)


def write_pair(out: Path, features: Path | None, n: int, rows: list[int], results: dict[int, tuple],
               prompts: list[list[int]], temperature: float, file_rows: list[int]) -> None:
    """Shard ``n`` (its samples ``rows`` in plan order; ``results[i] = (answer ids, (top ids, top logprobs),
    states or None)``): the features first, then the answers (the completion mark)."""
    if features is not None:
        tmp = features / f"shard-{n:05d}.tmp.npy"
        np.save(tmp, np.concatenate([results[i][2] for i in rows]))
        os.replace(tmp, features / f"shard-{n:05d}.npy")
    shard = make_shard([prompts[i] for i in rows], [results[i][0] for i in rows], [results[i][1] for i in rows],
                       float(temperature), [file_rows[i] for i in rows])
    shard.save(out / f"shard-{n:05d}.npz")
