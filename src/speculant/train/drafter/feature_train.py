"""Training a feature (EAGLE) drafter on the target's answers and its hidden states (Li et al. 2024).

Sequence ``s_0 .. s_{L-1}`` (the prompt tail and the answer but its last token) with the target's final-normed
states ``F_0 .. F_{L-1}`` (:mod:`.features`; ``F_j`` predicts ``s_{j+1}``). Drafter row ``j`` reads
``feature_fc([emb(s_{j+1}) ; F_j])`` at position ``j`` and outputs ``f̂_{j+1}``; the LM head over ``f̂_{j+1}``
drafts ``s_{j+2}``. The losses:

* the distillation loss (FKL, TVD or TVD++, :mod:`..losses`) of the drafted token against the target's stored
  top-k ``q`` at the answer positions, over the VocabTrim kept set, as for a token-level drafter;
* EAGLE's feature regression: smooth L1 between ``f̂_{j+1}`` and ``F_{j+1}`` at every row, weighted by
  ``regression`` (the states are RMS-normalised per row first, so the weight does not depend on the model's
  scale).

Deeper draft tokens are drafted from the drafter's own ``f̂``, not the target's ``F``: EAGLE-3's "training-time
test" (Li et al. 2025). With ``unroll = U`` the drafter runs U passes; pass ``d >= 1`` feeds row ``j`` with
``f̂_j`` (pass ``d - 1``'s output of row ``j - 1``) in place of ``F_j`` and is trained on the same targets: the
conditions of draft token ``d + 1``. Each pass attends exactly as that draft row does at inference
(:func:`ttt_mask`): to the real rows before its chain started (pass 0's keys) and to its own chain's rows of
the earlier passes, kept in one cache across the passes. Validation reports the agreement of each pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ...core.cache import cache_kwarg
from .answers import AnswerShard
from .draft_train import Batch, Objective, Sample, make_batch
from .features import sequence_lengths, to_tensor

__all__ = ["FeatureSample", "collect_feature_samples", "FeatureBatch", "FeatureObjective", "ttt_mask"]


@dataclass
class FeatureSample(Sample):
    features: np.ndarray = None  # [c + a - 1, H] bf16 bits (int16): the target's states over context + answer[:-1]
    prefix: np.ndarray = None  # [start] the prompt's tokens before the context (what the target read before it)


def collect_feature_samples(shards: list[AnswerShard], features: list[np.ndarray], context: int) -> list[FeatureSample]:
    """One :class:`FeatureSample` per answer (the last ``context`` prompt tokens), with its rows of ``features``
    (one array per shard, :func:`.features.load_features`)."""
    out = []
    for sh, feats in zip(shards, features):
        lengths = sequence_lengths(sh)
        if int(lengths.sum()) != feats.shape[0]:
            raise ValueError(f"target features do not match their answer shard ({feats.shape[0]} rows for "
                             f"{int(lengths.sum())} positions): extract them again")
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i in range(len(sh)):
            prompt, answer, rows = sh.sample(i)
            if len(answer) == 0:
                continue
            ctx = prompt[-context:]
            skip = len(prompt) - len(ctx)
            f = feats[offsets[i] + skip : offsets[i + 1]]  # [c + a - 1, H]
            out.append(FeatureSample(ctx, answer, sh.topk_ids[rows], sh.topk_logprobs[rows], skip,
                                     row=int(sh.prompt_index[i]), features=f, prefix=prompt[:skip]))
    return out


@dataclass
class FeatureBatch(Batch):
    features: torch.Tensor = None  # [B, T, H] the target's states at the batch's columns (zeros on padding)


@dataclass
class FeatureObjective(Objective):
    """The feature drafter's objective (module docstring). ``noise``: uniform noise of that half-width (relative
    to each state's RMS) added to the target's states in training, as EAGLE does, so the drafter tolerates its
    own imprecise states."""

    regression: float = 1.0
    unroll: int = 1
    noise: float = 0.0

    def batch(self, samples: list[FeatureSample], kept_index: torch.Tensor, pad: int) -> FeatureBatch:
        base = make_batch(samples, kept_index, pad)
        b, t = base.input_ids.shape
        feats = torch.zeros((b, t, samples[0].features.shape[1]))
        for r, s in enumerate(samples):
            feats[r, : len(s.features)] = to_tensor(s.features)
        # row j predicts s_{j+2}: the column of answer token m is c - 2 + m, one left of a token-level drafter's
        fields = {k: getattr(base, k) for k in Batch.__dataclass_fields__}
        fields["cols"] = base.cols - 1
        return FeatureBatch(**fields, features=feats)

    def _extra(self, draft, depth: int, first: int, rows: int) -> torch.Tensor | None:
        """What a variant adds to the input of pass ``depth``'s rows ``first .. first + rows - 1``, ``[B, R, H]``
        (ConFu: the future input, :mod:`speculant.train.drafter.confu_training`); None: nothing."""
        return None

    def _pass(self, draft, batch: FeatureBatch, feats: torch.Tensor, depth: int, cache,
              starts: list[int]) -> torch.Tensor:
        """Pass ``depth`` (0: the target's states) of rows ``j = starts[depth] .. T-2`` on ``feats [B, R, F]``
        (those rows), attending as a draft row of that depth does (:func:`ttt_mask`) over the keys of every earlier
        pass, kept in ``cache``; the output states ``f̂ [B, R, H]`` (row j: f̂_{j+1})."""
        first = starts[depth]
        emb = draft.get_input_embeddings()(batch.input_ids[:, 1 + first:])  # [B, R, H]: s_{j+1}
        x = draft.feature_fc(torch.cat([emb, feats.to(emb.dtype)], -1))
        extra = self._extra(draft, depth, first, x.shape[1])
        if extra is not None:
            x = x + extra.to(x.dtype)
        mask = ttt_mask(batch.mask[:, 1:].bool(), depth, x.dtype, starts[:depth + 1])  # [B, 1, R, keys]
        return draft.model(inputs_embeds=x, attention_mask=mask, position_ids=batch.positions[:, first:-1],
                           **cache_kwarg(draft.model, cache), use_cache=True).last_hidden_state

    def predict(self, draft, batch: FeatureBatch, head: torch.Tensor, training: bool):
        from transformers import DynamicCache

        states = batch.features  # [B, T, F]: tapped layers' outputs, then the final-normed state (last H)
        h = draft.config.hidden_size
        target = states[..., -h:]  # [B, T, H]
        inputs = states[:, :-1]
        if training and self.noise:
            scale = inputs.pow(2).mean(-1, keepdim=True).sqrt()  # per row (over all tapped states together)
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * self.noise * scale
        valid = batch.mask[:, 1:].bool()  # [B, T-1]: rows whose regression target F_{j+1} is real
        # pass d >= 1 only computes the rows an answer position's chain reaches: the first answer row a0 at the
        # last pass, one more row before it per earlier pass (the prompt rows before them are never read)
        first_answer = int(batch.cols.min())
        starts = [0] + [max(0, first_answer - (self.unroll - 1 - d)) for d in range(1, self.unroll)]
        steps, aux = [], None
        cache = DynamicCache(config=draft.config)  # every pass's keys: the draft rows' attention (ttt_mask)
        for depth in range(self.unroll):
            first = starts[depth]
            out = self._pass(draft, batch, inputs, depth, cache, starts)  # [B, R, H], rows first .. T-2
            steps.append(out[batch.rows, batch.cols - first] @ head.T)  # [N, K]
            if self.regression:
                rows = valid[:, first:]
                reg = _regression(out.float()[rows], target[:, 1 + first:][rows])
                aux = reg if aux is None else aux + reg
            if depth + 1 < self.unroll:  # next pass: row j reads f̂_j, the output of row j - 1 (no tapped layers)
                nxt = starts[depth + 1]
                own = out[:, nxt - 1 - first:out.shape[1] - 1].float() if nxt > 0 else \
                    torch.cat([target[:, :1], out[:, :-1].float()], 1)  # [B, R', H]
                inputs = torch.cat([torch.zeros_like(states[:, nxt:-1, :-h]), own], -1)
        if aux is not None:
            aux = self.regression * aux / self.unroll
        return steps, aux


def ttt_mask(valid: torch.Tensor, depth: int, dtype: torch.dtype, starts: list[int] | None = None) -> torch.Tensor:
    """EAGLE-3's training-time-test attention, additive ``[B, 1, R, keys]`` over the keys of passes ``0 .. depth``
    (``valid [B, T]``: real rows; pass ``l`` holds rows ``starts[l] .. T-1``, all of them when ``starts`` is None;
    ``R`` = the rows of pass ``depth``). Row ``p`` of pass ``depth`` stands for the draft row of that depth whose
    chain started after real row ``p - depth``: it sees the real rows ``0 .. p - depth`` (pass 0) and the rows of
    its own chain, row ``p - depth + l`` of pass ``l`` for ``l = 1 .. depth`` (itself last), exactly what the
    drafter's cache holds for it at inference. ``depth = 0``: causal over the real rows."""
    b, t = valid.shape
    starts = [0] * (depth + 1) if starts is None else list(starts)
    p = torch.arange(starts[depth], t)[:, None]  # [R, 1]
    blocks = [(torch.arange(t)[None, :] <= p - depth)[None] & valid[:, None, :]]  # [B, R, T]
    for level in range(1, depth + 1):
        q = torch.arange(starts[level], t)[None, :]  # [1, T - starts[level]]
        blocks.append((q == p - depth + level)[None].expand(b, -1, -1))
    allowed = torch.cat(blocks, -1)[:, None]  # [B, 1, R, keys]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)


def _regression(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Smooth L1 between ``pred`` and ``target`` ``[N, H]``, both divided by the target's RMS per row."""
    scale = target.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    return F.smooth_l1_loss(pred / scale, target / scale)
