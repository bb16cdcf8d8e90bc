"""SpecKV: draft-guided KV eviction (Galim et al. 2025, "Draft-based Approximate Inference for LLMs").

Attention-based policies score the cached prompt with the attention of queries they have seen: the prompt's
own last tokens (SnapKV's observation window). What matters is the attention of the tokens the model is *about
to generate*, which are not known yet. SpecKV asks a draft model for them: at the end of the prompt the draft
writes a short provisional answer (``lookahead`` tokens, greedy), the target runs those tokens once over its
(budgeted) cache to read their attention over the cached prompt, the provisional tokens are removed from the
cache again (never committed: decoding then starts from the prompt as if nothing happened), and the KV entries
they attend to most are kept, with SnapKV's max-pooling over neighbouring tokens.

Block-wise prefill (:func:`speculant.kv.budget.prefill_blockwise`) asks the policy's prefill hook
(:meth:`SpecKV.prefill_observers`, which calls :meth:`SpecKV.lookahead_attention`) for
the last block (``every_block=True``: for every block, the draft continuing the prefix read so far); the other
blocks, and eviction while decoding, score as SnapKV does, with the latest queries. It composes with CAOTE
(``caote:speckv``: the draft queries' attention is CAOTE's ``alpha``).

``passes=2`` (from :class:`SnapKV`: prefill twice, the second pass scoring every block before the last with the
first pass's end-of-prompt queries) adds the provisional answer's queries to the observation window's, so that
every block is kept for what the answer will attend to.

The draft is any causal LM with the target's tokenizer (``SpecKV(draft=model)``); ``generate`` fills it in from
the drafter's declared model (:meth:`SpecKV.bind_draft`) when it has none (``kv_policy="speckv"`` with a
draft-model method).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..core.cache import SpecCache, cache_kwarg
from ..core.checks import num_layers
from .attention import QueryCapture, attention_probs
from .policies import SnapKV

__all__ = ["SpecKV"]


@dataclass
class SpecKV(SnapKV):
    """SnapKV whose observation queries, at the end of the prompt, are a draft's provisional answer."""

    lookahead: int = 16
    every_block: bool = False
    draft: torch.nn.Module | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lookahead < 1:
            raise ValueError(f"speckv lookahead must be >= 1, got {self.lookahead}")

    def _need_draft(self) -> torch.nn.Module:
        if self.draft is None:
            raise ValueError("KV policy speckv needs a draft model: decode with a method that drafts with one "
                             "(chain, trees), or pass speculant.kv.SpecKV(draft=model)")
        return self.draft

    def bind_draft(self, model: torch.nn.Module | None) -> None:
        """Draft with ``model`` (the drafter's) unless a draft was given; a one-line ValueError without either."""
        if self.draft is None:
            self.draft = model
        self._need_draft()

    def prefill_observers(self, model, cache, prefix, following, last, queries_out=None):
        """The provisional answer's attention (:meth:`lookahead_attention`) for the last block (every block with
        ``every_block``, the draft continuing the prefix read so far); None for the other blocks."""
        if not (last or self.every_block):
            return None
        return self.lookahead_attention(model, cache, prefix.tolist(), following if last else (),
                                        queries_out=queries_out)

    @torch.no_grad()
    def provisional(self, prefix: Sequence[int], known: Sequence[int] = ()) -> list[int]:
        """``known`` tokens (already decided to follow ``prefix``) then the draft's greedy continuation, ``lookahead``
        tokens in all; the draft reads the whole prefix (its own, full cache: it is small)."""
        tokens = list(known)[: self.lookahead]
        if len(tokens) == self.lookahead:
            return tokens
        draft = self._need_draft()
        device = draft.device
        cache = SpecCache(num_layers(draft), capacity=len(prefix) + self.lookahead + 1)
        feed = torch.tensor([list(prefix) + tokens], device=device)  # [1, P + K]
        while len(tokens) < self.lookahead:
            logits = draft(input_ids=feed, **cache_kwarg(draft, cache), use_cache=True, logits_to_keep=1).logits
            nxt = int(logits[0, -1].argmax())
            tokens.append(nxt)
            feed = torch.tensor([[nxt]], device=device)
        return tokens

    @torch.no_grad()
    def lookahead_attention(self, model: torch.nn.Module, cache, prefix: Sequence[int], known: Sequence[int] = (),
                            queries_out: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Attention ``[B, H_q, n, T]`` per layer of the ``n`` provisional tokens over the ``T`` cached ones.

        The provisional tokens are fed through ``model`` on top of ``cache`` (original positions continuing) and
        cropped off again: the cache is left exactly as it was. ``queries_out`` receives their post-RoPE queries
        ``[B, H_q, n, D]`` per layer."""
        tokens = self.provisional(prefix, known)
        before = cache.length
        device = model.device
        positions = cache.position_ids(len(tokens), device=device)
        with QueryCapture(model) as cap:
            model(input_ids=torch.tensor([tokens], device=device), **cache_kwarg(model, cache),
                  position_ids=positions, use_cache=True, logits_to_keep=1)
        attn = {}
        for i, layer in enumerate(cache.layers):
            q = cap.queries.get(i)
            if q is not None:
                attn[i] = attention_probs(q, layer.keys, cap.scaling(i))[..., :before]  # [B, H_q, n, T]
        if queries_out is not None:
            queries_out.update(cap.queries)
        cache.crop(before)
        return attn
