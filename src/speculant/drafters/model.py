"""Drafting with a smaller causal LM that shares the target's tokenizer.

:class:`DraftModelDrafter` drafts a chain of ``k`` tokens per step (Leviathan et al. 2023; Chen et al. 2023):
greedy drafts under greedy decoding, samples from the warped draft distribution ``p`` otherwise, with ``p``
handed to the verifier. The draft model keeps its own KV cache across steps: after verification it is cropped
to the accepted prefix, and tokens it has not processed yet (the bonus, and the last draft token when every
draft was accepted) are fed at the start of the next step, so nothing is ever re-prefilled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache import SpecCache
from ..checks import check_fits_context, check_positive_int, check_vocab_compatible, num_layers, vocab_size
from ..sampling import sample, warp
from ..types import DraftTree
from .base import DecodeState
from .vocab_trim import TrimmedHead, resolve_keep_ids

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter:
    """Chain drafter over a draft model: ``k`` draft tokens per step.

    Args:
        draft_model: a transformers causal LM with the target's tokenizer (embedding matrices may differ by
            padding rows, as Qwen models' do).
        k: draft tokens per step (γ), >= 1.
        tokenizers_match: set by callers that compared the two tokenizers (the CLI does); ``None`` checks the
            vocabulary sizes only.
        vocab_trim: VocabTrim (:mod:`.vocab_trim`): draft over the ``N`` most frequent tokens of the draft's
            calibration (an int), or over the given token ids (a sequence); ``0`` uses the full LM head. ``None``
            (default) uses the size the draft model's calibration recommends if it ships one (the bundled draft
            does), else the full head. Lossless either way; trimming trades τ for a cheaper draft forward.
    """

    def __init__(
        self,
        draft_model: torch.nn.Module,
        k: int = 4,
        tokenizers_match: bool | None = None,
        vocab_trim: int | Sequence[int] | None = None,
    ) -> None:
        self.model = draft_model
        self.k = check_positive_int("k", k)
        self.tokenizers_match = tokenizers_match
        self.vocab_trim = vocab_trim
        self._head: TrimmedHead | None = None
        self._head_for: tuple | None = None  # (vocab, weight version) the head was built for
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
        lm_head = self.model.get_output_embeddings()
        key = (self._vocab, lm_head.weight.data_ptr(), lm_head.weight._version)
        if self._head_for != key:
            keep = resolve_keep_ids(self.model, self.vocab_trim, self._vocab)
            self._head = None if keep is None else TrimmedHead(lm_head, keep)
            self._head_for = key
        self._n_cached = 0
        self._tail = []

    def params_per_forward(self) -> int:
        """Parameters one draft forward reads (for MBSU's cost ratio): the transformer blocks and final norm,
        and the LM head rows actually computed (all of them, or the kept ones with VocabTrim). The input
        embedding is read one row per token, so it is not counted unless it is tied to the head."""
        head = self.model.get_output_embeddings()
        embed = self.model.get_input_embeddings()
        counted = {id(p): p for p in self.model.parameters()}
        counted.pop(id(head.weight), None)
        counted.pop(id(embed.weight), None)
        rows = head.weight.shape[0] if self._head is None else self._head.size
        return sum(p.numel() for p in counted.values()) + rows * head.weight.shape[1]

    def _next_logits(self, state: DecodeState, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` to the draft model (appending to its cache); logits after the last one: ``[V_shared]``,
        or ``[M]`` over the kept tokens with VocabTrim."""
        device = self.model.device
        inputs = torch.tensor([tokens], device=device).clamp_(max=self._max_input_id)  # [1, T]
        with state.draft_forward(device):
            if self._head is not None:  # the base model, then only the kept rows of the head
                hidden = self.model.base_model(input_ids=inputs, past_key_values=self._cache, use_cache=True)
                return self._head.logits(hidden.last_hidden_state[0, -1])  # [M]
            out = self.model(input_ids=inputs, past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1, : self._vocab]

    def propose(self, state: DecodeState) -> DraftTree:
        k = min(self.k, state.remaining - 1)
        feed = state.ids[self._n_cached :]  # the root, plus anything committed the draft has not seen
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self._next_logits(state, feed)  # [V_shared], or [M] trimmed
            if state.params.greedy:
                tok = int(logits.argmax())
            else:
                p = warp(logits, state.params)
                tok = sample(p, state.generator)
                rows.append(p if self._head is None else self._head.lift(p, self._vocab))  # [V_shared]
            if self._head is not None:
                tok = self._head.token(tok)
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
