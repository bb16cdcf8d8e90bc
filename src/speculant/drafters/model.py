"""Drafting with a smaller causal LM that shares the target's tokenizer.

:class:`DraftModelDrafter` drafts a chain of ``k`` tokens per step (Leviathan et al. 2023; Chen et al. 2023):
greedy drafts under greedy decoding, samples from the warped draft distribution ``p`` otherwise, with ``p``
handed to the verifier. The draft model keeps its own KV cache across steps: after verification it is cropped
to the accepted prefix, and tokens it has not processed yet (the bonus, and the last draft token when every
draft was accepted) are fed at the start of the next step, so nothing is ever re-prefilled.
"""

from __future__ import annotations

import torch

from ..cache import SpecCache
from ..checks import check_fits_context, check_positive_int, check_vocab_compatible, num_layers, vocab_size
from ..sampling import sample, warp
from ..types import DraftTree
from .base import DecodeState

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter:
    """Chain drafter over a draft model: ``k`` draft tokens per step.

    Args:
        draft_model: a transformers causal LM with the target's tokenizer (embedding matrices may differ by
            padding rows, as Qwen models' do).
        k: draft tokens per step (γ), >= 1.
        tokenizers_match: set by callers that compared the two tokenizers (the CLI does); ``None`` checks the
            vocabulary sizes only.
    """

    def __init__(self, draft_model: torch.nn.Module, k: int = 4, tokenizers_match: bool | None = None) -> None:
        self.model = draft_model
        self.k = check_positive_int("k", k)
        self.tokenizers_match = tokenizers_match
        self._cache: SpecCache | None = None
        self._n_cached = 0  # committed tokens whose keys/values are in the draft cache
        self._tail: list[int] = []  # draft tokens in the cache after those, from the last proposal
        self._vocab = 0
        self._max_input_id = 0

    def begin(self, state: DecodeState) -> None:
        self._vocab = check_vocab_compatible(
            vocab_size(state.target), vocab_size(self.model), self.tokenizers_match
        )
        # a target with more (padding) rows could in principle emit an id the draft cannot embed
        self._max_input_id = vocab_size(self.model) - 1
        check_fits_context(self.model, len(state.ids), state.remaining, role="draft")
        if self.model.training:
            self.model.eval()
        self._cache = SpecCache(num_layers(self.model), capacity=state.max_length + self.k + 64)
        self._n_cached = 0
        self._tail = []

    def _next_logits(self, state: DecodeState, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` to the draft model (appending to its cache); logits after the last one ``[V_shared]``."""
        device = self.model.device
        inputs = torch.tensor([tokens], device=device).clamp_(max=self._max_input_id)  # [1, T]
        with state.draft_forward(device):
            out = self.model(
                input_ids=inputs,
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[0, -1, : self._vocab]

    def propose(self, state: DecodeState) -> DraftTree:
        k = min(self.k, state.remaining - 1)
        feed = state.ids[self._n_cached :]  # the root, plus anything committed the draft has not seen
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self._next_logits(state, feed)
            if state.params.greedy:
                tok = int(logits.argmax())
            else:
                p = warp(logits, state.params)  # [V_shared]
                rows.append(p)
                tok = sample(p, state.generator)
            tokens.append(tok)
            feed = [tok]
        # the cache now holds every committed token and the first k - 1 draft tokens
        self._n_cached = len(state.ids)
        self._tail = tokens[:-1]
        probs = torch.stack(rows) if rows else None  # [k, V_shared]: row i = p(. | root, d_1..d_i)
        if probs is not None:
            probs = torch.cat([probs, probs.new_zeros((1, probs.shape[1]))])  # row k: leaf, never read
        return DraftTree.chain(tokens, probs)

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        keep = 0
        for drafted, acc in zip(self._tail, accepted):
            if drafted != acc:
                break
            keep += 1
        self._n_cached += keep
        self._cache.crop(self._n_cached)
        self._tail = []
