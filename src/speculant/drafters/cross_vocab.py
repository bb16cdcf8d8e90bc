"""Drafting with a causal LM whose tokenizer is not the target's (cross-vocabulary drafting, OmniDraft style).

The draft model reads and writes its own tokens; the engine and the verifier only ever see the target's. Each
step:

1. **sync**: the committed target tokens are decoded to text, and the draft's cache is brought to the draft
   tokenization of that text. The cache keeps its rows for all but the last :data:`ROLLBACK` draft tokens of the
   text it held; the rest of the text is encoded again and fed (a tokenizer may merge the old last token with the
   new text, so the tail is never trusted). Text that no longer extends the held text (it cannot happen with a
   tokenizer whose decode is prefix-stable, but guard anyway) re-encodes everything;
2. **draft**: the draft model continues greedily for up to ``k`` of its tokens (its end-of-text token ends the
   draft);
3. **translate**: the text those tokens add is turned into target tokens by the :class:`~.token_bridge.TokenBridge`
   (its n-gram cache of aligned token runs, learned online from the committed text and from each translation, or
   the target tokenizer on the text), at most the step's draft limit;
4. **verify**: the translated tokens are a *deterministic* draft (``draft_probs`` None): there is no draft
   distribution over the target's vocabulary to compare with, so the one verifier applies the greedy rule at
   temperature 0 and the deterministic-draft rule otherwise (draw the target's token from ``q``; descend while it
   equals the draft's): every emitted token is a sample of the target's own distribution, exactly;
5. **commit**: the draft rows of the proposal are dropped (the next sync feeds the committed text again).
"""

from __future__ import annotations

import logging

import torch

from ..core.checks import check_positive_int, vocab_size
from ..core.types import DraftTree
from .base import DecodeState
from .model import DraftModelBase
from .token_bridge import TokenBridge

__all__ = ["CrossVocabDrafter", "ROLLBACK"]

log = logging.getLogger(__name__)

ROLLBACK = 2
"""Draft tokens at the end of the held text that every sync encodes again."""

_PROMPT_LEARN_CHARS = 2048  # the prompt's last characters the bridge learns from at the start of a generation


class CrossVocabDrafter(DraftModelBase):
    """A draft model with its own tokenizer drafts for the target (see the module doc).

    Args:
        draft_model: any causal LM (transformers), with ``draft_tokenizer``.
        draft_tokenizer, target_tokenizer: the two tokenizers (``encode(text, add_special_tokens=False)`` and
            ``decode(ids, skip_special_tokens=False)`` are all that is used).
        k: draft tokens (the draft's) per step.
        max_ngram: the longest draft run the bridge's cache keys.
        vocab_trim: VocabTrim over the draft's own vocabulary (see :class:`~.model.DraftModelBase`).
    """

    def __init__(self, draft_model: torch.nn.Module, draft_tokenizer, target_tokenizer, k: int = 6,
                 max_ngram: int = 4, vocab_trim: int | None = None) -> None:
        super().__init__(draft_model, tokenizers_match=None, vocab_trim=vocab_trim)
        for name, tok in (("draft_tokenizer", draft_tokenizer), ("target_tokenizer", target_tokenizer)):
            if not (callable(getattr(tok, "encode", None)) and callable(getattr(tok, "decode", None))):
                raise ValueError(f"cross-vocabulary drafting needs {name} (an object with encode and decode), got "
                                 f"{type(tok).__name__}")
        self.k = check_positive_int("k", k)
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.bridge = TokenBridge(draft_tokenizer, target_tokenizer, max_ngram=max_ngram)
        eos = getattr(draft_model.config, "eos_token_id", None)
        self._draft_stops = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self._ids: list[int] = []  # the draft tokenization of the held text; its rows are in the draft cache
        self._text = ""  # the committed text the draft cache holds
        self._learned = 0  # characters of committed text the bridge has learned from

    def _shared_vocab(self, state: DecodeState) -> int:
        return vocab_size(self.model)  # its own vocabulary: nothing is shared with the target's ids

    holds_target_ids = False  # its cache holds the draft tokenizer's tokens of the text

    def _extra_slots(self) -> int:
        return self.k

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self._ids, self._text = [], ""
        text = self._decode_target(state.ids)
        self._learned = len(text)
        self.bridge.learn(text[-_PROMPT_LEARN_CHARS:])

    def _decode_target(self, ids: list[int]) -> str:
        return self.target_tokenizer.decode(ids, skip_special_tokens=False)

    def _sync(self, text: str) -> list[int]:
        """Crop the draft cache to the held text's tokens but the last :data:`ROLLBACK`, and return the draft
        tokens of the rest of ``text`` (to feed; never empty for a non-empty text)."""
        keep, held = [], ""
        if self._ids and text.startswith(self._text):
            keep = self._ids[:-ROLLBACK]
            held = self.draft_tokenizer.decode(keep, skip_special_tokens=False)
            if not text.startswith(held):
                keep, held = [], ""
        new = self.draft_tokenizer.encode(text[len(held):], add_special_tokens=False)
        if not new and keep:  # nothing after the kept part: feed its last token again
            keep, new = keep[:-1], keep[-1:]
        self._cache.crop(len(keep))
        self._ids, self._text = keep + new, text
        return new

    def propose(self, state: DecodeState) -> DraftTree:
        text = self._decode_target(state.ids)
        if len(text) > self._learned:  # what was committed since: aligned runs for the cache
            self.bridge.learn(text[self._learned:])
            self._learned = len(text)
        feed = self._sync(text)
        if not feed:  # an empty text (a prompt of tokens that decode to nothing): nothing to draft from
            self._record(state, DraftTree(tokens=[], parents=[]), 0)
            return DraftTree(tokens=[], parents=[])
        drafted = self._draft(state, feed, min(self.k, max(state.draft_limit, 0)))
        tokens: list[int] = []
        if drafted:
            context = self._ids[-8:]  # decode in context: tokenizers that mark word starts decode differently
            base = self.draft_tokenizer.decode(context, skip_special_tokens=False)
            full = self.draft_tokenizer.decode(context + drafted, skip_special_tokens=False)
            if full.startswith(base):
                tokens = self.bridge.translate(drafted, full[len(base):])[: state.draft_limit]
        tree = DraftTree.chain(tokens)  # no draft_probs: a deterministic draft (module doc, step 4)
        self._record(state, tree, 0)
        return tree

    def _draft(self, state: DecodeState, feed: list[int], k: int) -> list[int]:
        """Feed ``feed`` (the synced text's new draft tokens) and continue greedily for up to ``k`` draft tokens
        (the draft's end of text ends it); the drafted draft-token ids."""
        logits = self._next_logits(state, feed)  # [V_draft] (or [M] trimmed)
        self._n_cached = len(self._ids)
        drafted: list[int] = []
        for i in range(k):
            if i:
                logits = self._next_logits(state, [drafted[-1]])
            tok = self._token(int(logits.argmax()))
            drafted.append(tok)
            if tok in self._draft_stops:
                break
        return drafted

    def _keep_accepted(self, accepted: list[int]) -> None:
        """Drop the proposal's draft rows; the next sync feeds the committed text."""
        self._cache.crop(len(self._ids))
        self._n_cached = len(self._ids)
