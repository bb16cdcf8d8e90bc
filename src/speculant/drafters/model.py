"""Drafting with a smaller causal LM that shares the target's tokenizer.

:class:`DraftModelBase` is the plumbing every draft-model drafter shares: its own KV cache, id clamping, the
VocabTrim head (:mod:`.vocab_trim`), the cost figure for MBSU and the commit that keeps the draft cache equal to
what was accepted. :class:`DraftModelDrafter` drafts a chain of ``k`` tokens per step on it (Leviathan et al.
2023; Chen et al. 2023): greedy drafts under greedy decoding, samples from the warped draft distribution ``p``
otherwise, with ``p`` handed to the verifier; with ``stop`` the chain ends early after a token the draft itself
gives less than that probability (the draft's confidence, as transformers' assisted generation does). The tree
drafters (SpecInfer, RSD, dynamic trees) are in :mod:`.trees`.

Cache invariant (all draft-model drafters): between steps the draft cache holds the first ``_n_cached`` committed
tokens and nothing else. A proposal first feeds what the cache lacks (the root, plus the bonus and any accepted
token it never fed), so the cache then holds every committed token; draft nodes fed after that sit in the slots
behind them. On commit the slots of the accepted nodes that were fed are kept (compacted, like the target's
cache) and the rest dropped, so nothing is ever re-prefilled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..models.attached import is_feature_drafter
from ..core.cache import SpecCache, cache_kwarg
from ..core.checks import (
    check_fits_context,
    check_positive_int,
    check_vocab_compatible,
    num_layers,
    vocab_size,
    warn_once,
)
from ..core.llama_forward import LlamaForward
from ..core.sampling import sample, warp
from ..core.target_forward import llama_forward_for
from ..core.types import DraftTree
from .base import DecodeState, Drafter
from .vocab_trim import TrimmedHead, trimmed_head

__all__ = ["DraftModelBase", "DraftModelDrafter"]

log = logging.getLogger(__name__)


class DraftModelBase(Drafter):
    """Shared plumbing of the drafters that run a draft model (subclasses implement ``propose``).

    Args:
        draft_model: a transformers causal LM with the target's tokenizer (embedding matrices may differ by
            padding rows, as Qwen models' do).
        tokenizers_match: set by callers that compared the two tokenizers (the CLI does); ``None`` checks the
            vocabulary sizes only.
        vocab_trim: VocabTrim (:mod:`.vocab_trim`): draft over the ``N`` most frequent tokens of the draft's
            calibration (an int), or over the given token ids (a sequence); ``0`` uses the full LM head. ``None``
            (default) uses the size the draft model's calibration recommends if it ships one (the bundled draft
            does), else the full head. Lossless either way; trimming trades τ for a cheaper draft forward.

    Llama-family drafts run through :class:`speculant.core.llama_forward.LlamaForward` (the same layers without
    transformers' per-module overhead, shared with the target); set ``lean_forward = False`` on a drafter to use the
    model's own forward.

    A subclass's ``propose`` feeds :meth:`_catch_up` first, then its draft tokens, and ends with :meth:`_record`
    (which of the tree's nodes it fed); :meth:`commit` then keeps the draft cache consistent.
    """

    lean_forward: bool = True
    context_window: int = 0
    """Read at most this many of the prompt's last tokens (0: the whole prompt). The draft model then reads a
    short context whatever the prompt's length (a fill-in-the-middle request's file, a long conversation), as if
    the text began there (its positions start at 0): its prefill and its attention stay short. Exactness does not
    depend on it (the verifier decides); only acceptance may."""
    holds_target_ids: bool = True
    """The draft cache's slot ``i`` holds committed token ``state.ids[i]``: its keys/values are then reused from,
    and stored in, the generation's prefix cache (:attr:`DecodeState.prefixes`). A drafter that tokenizes the text
    its own way says False."""

    def __init__(
        self,
        draft_model: torch.nn.Module,
        tokenizers_match: bool | None = None,
        vocab_trim: int | Sequence[int] | None = None,
    ) -> None:
        if not isinstance(draft_model, torch.nn.Module):
            raise ValueError(
                f"{type(self).__name__} expects a loaded draft model (torch.nn.Module), got "
                f"{type(draft_model).__name__} {draft_model!r:.80}: load one with speculant.load_pretrained(name_or_dir)"
                " or, for an attached drafter, speculant.load_draft(name_or_dir, target)"
            )
        if is_feature_drafter(draft_model) and not self.uses_target_hidden:
            raise ValueError(f"the draft model is a feature (EAGLE) drafter, which {type(self).__name__} cannot "
                             "drive: build the method through speculant.build_drafter, or use "
                             "speculant.drafters.feature.feature_variant(" + type(self).__name__ + ")")
        self.model = draft_model  # the declared capability (Drafter.model)
        self._lean: LlamaForward | None = None
        self.tokenizers_match = tokenizers_match
        self.vocab_trim = vocab_trim
        self._head: TrimmedHead | None = None
        self._cache: SpecCache | None = None
        self._n_cached = 0  # committed tokens whose keys/values are in the draft cache
        self._offset = 0  # the first committed token the draft reads (context_window)
        self._vocab = 0
        self._max_input_id = 0
        # the last proposal, for commit: its tree, the cache length before its nodes, and where each node was fed
        self._tree: DraftTree | None = None
        self._base = 0
        self._fed: int | list[int] = 0  # an int n: nodes 0..n-1 fed in order; a list: fed position per node or -1

    def _extra_slots(self) -> int:
        """Most draft nodes one proposal feeds (sizes the draft cache; it grows past it if needed)."""
        return 0

    def _shared_vocab(self, state: DecodeState) -> int:
        """The ids draft and target share (checked: the same tokenizer, up to padding rows)."""
        return check_vocab_compatible(vocab_size(state.target), vocab_size(self.model), self.tokenizers_match)

    def begin(self, state: DecodeState) -> None:
        self._vocab = self._shared_vocab(state)
        # a target with more (padding) rows could in principle emit an id the draft cannot embed
        self._max_input_id = vocab_size(self.model) - 1
        check_fits_context(self.model, len(state.ids), state.remaining, role="draft")
        if self.model.training:
            self.model.eval()
        self._cache = SpecCache(num_layers(self.model), capacity=state.max_length + self._extra_slots() + 64)
        trim = self.vocab_trim
        if isinstance(trim, int) and not isinstance(trim, bool) and trim >= self._vocab:
            warn_once(log, f"vocab_trim (trim) = {trim} is not below the vocabulary size ({self._vocab} tokens): it "
                           "has no effect, the full LM head is used")
        self._head = trimmed_head(self.model, self.vocab_trim, self._vocab, sampling=not state.params.greedy)
        self._n_cached = 0
        self._tree = None
        self._fed = 0
        self._lean = llama_forward_for(self.model) if self.lean_forward else None
        window = self.context_window
        self._offset = max(0, len(state.ids) - window) if window else 0  # state.ids[offset + i] is in slot i
        # (the sequence gives none to a feature drafter, whose rows read the target's states: Sequence._reusable)
        self._prefixes = state.prefixes if self.holds_target_ids else None
        self._stored = 0  # the context length when its blocks were last stored
        if self._prefixes is not None:  # the context's longest prefix an earlier generation fed: copied, not fed
            self._n_cached = self._prefixes.restore(self.model, state.ids[self._offset:-1], self._cache, count=False)
            state.stats.draft_cached_tokens = self._n_cached

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

    # ------------------------------------------------------------------------------------------ forwards

    def _next_logits(self, state: DecodeState, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` causally (appending to the draft cache); logits after the last one: ``[V_shared]``,
        or ``[M]`` over the kept tokens with VocabTrim."""
        device = self.model.device
        inputs = torch.tensor([tokens], device=device).clamp_(max=self._max_input_id)  # [1, T]
        with state.draft_forward(device):
            if self._lean is not None:
                return self._head_logits(self._lean.hidden(inputs, self._cache)[0, -1])  # [V_shared] or [M]
            if self._head is not None:  # the base model, then only the kept rows of the head
                base = self.model.base_model
                hidden = base(input_ids=inputs, **cache_kwarg(base, self._cache), use_cache=True)
                return self._head.logits(hidden.last_hidden_state[0, -1])  # [M]
            out = self.model(input_ids=inputs, **cache_kwarg(self.model, self._cache), use_cache=True,
                             logits_to_keep=1)
        return out.logits[0, -1, : self._vocab]

    def _all_logits(
        self, state: DecodeState, tokens: list[int], mask: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Feed ``tokens`` in one forward with an explicit attention mask ``[1, 1, T, L + T]`` and position ids
        ``[1, T]`` (a tree level); logits after each of them: ``[T, V_shared]``, or ``[T, M]`` trimmed."""
        device = self.model.device
        inputs = torch.tensor([tokens], device=device).clamp_(max=self._max_input_id)  # [1, T]
        kwargs = {"input_ids": inputs, **cache_kwarg(self.model, self._cache), "attention_mask": mask,
                  "position_ids": positions, "use_cache": True}
        with state.draft_forward(device):
            if self._lean is not None:
                return self._head_logits(self._lean.hidden(inputs, self._cache, positions, mask)[0])  # [T, V_shared | M]
            if self._head is not None:
                hidden = self.model.base_model(**kwargs)
                return self._head.logits(hidden.last_hidden_state[0])  # [T, M]
            out = self.model(**kwargs)
        return out.logits[0, :, : self._vocab]

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` final hidden states -> logits ``[..., M]`` (VocabTrim) or ``[..., V_shared]``; through the lean
        forward's head where there is one (packed, or quantized: a q4 draft's head read in 4-bit, not as the float
        copy its ``nn.Linear`` keeps)."""
        if self._head is not None:
            return self._head.logits(hidden)
        if self._lean is not None:
            return self._lean.logits(hidden)[..., : self._vocab]
        return self.model.get_output_embeddings()(hidden)[..., : self._vocab]

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        """Start a proposal: feed what the cache lacks (ending with the root); ``p``'s logits after the root."""
        logits = self._next_logits(state, state.ids[self._offset + self._n_cached :])
        self._n_cached = len(state.ids) - self._offset  # the cache now holds every committed token (of the window)
        self._store_blocks(state)
        return logits

    def prefill(self, state: DecodeState, stop: int) -> None:
        """Feed the committed tokens ``state.ids[:stop]`` the cache lacks (a prompt joining a batch chunk by chunk:
        :meth:`Drafter.prefill`), without the LM head. Only a drafter whose cache holds the target's ids in order
        does (its own :meth:`_catch_up` reads the rest); the others read their context in their first proposal."""
        if not self.holds_target_ids or type(self)._catch_up is not DraftModelBase._catch_up:
            return
        tokens = state.ids[self._offset + self._n_cached: stop]
        if not tokens:
            return
        inputs = torch.tensor([tokens], device=self.model.device).clamp_(max=self._max_input_id)  # [1, T]
        # part of the prompt's prefill (the sequence counts its time there): not a draft call
        if self._lean is not None:
            self._lean.hidden(inputs, self._cache)
        else:
            base = self.model.base_model
            base(input_ids=inputs, **cache_kwarg(base, self._cache), use_cache=True)
        self._n_cached += len(tokens)
        self._store_blocks(state)

    def _store_blocks(self, state: DecodeState) -> None:
        """Store the context blocks the draft cache completed since the last call in the prefix cache."""
        block = self._prefixes.block if self._prefixes is not None else 0
        if block and self._n_cached // block > self._stored // block:
            # slots: the committed tokens in the cache
            self._prefixes.store(self.model, state.ids[self._offset: self._offset + self._n_cached], self._cache)
            self._stored = self._n_cached

    # ------------------------------------------------------------------------------------ trimmed indices

    def _token(self, index: int) -> int:
        """The vocabulary id of a drafted index (a trimmed-head index with VocabTrim)."""
        return index if self._head is None else self._head.token(index)

    def _token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Batched :meth:`_token` over a LongTensor of indices."""
        return indices if self._head is None else self._head.keep[indices]

    def _lift(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft probabilities ``[..., V_shared]`` from ``[..., V_shared]`` or trimmed ``[..., M]``."""
        return probs if self._head is None else self._head.lift(probs, self._vocab)

    def _allowed(self, state: DecodeState, tokens: list[int]) -> torch.Tensor | None:
        """Under an output constraint (a drafter declaring ``drafts_constrained``): which drafted indices
        (``[V_shared]``, or ``[M]`` trimmed) it allows after ``tokens``; None when none may be drafted there (a
        path ending at a stop token, or nothing allowed among the kept ids). Without one: an empty marker
        (``[0]``), everything allowed."""
        if state.constraint is None:
            return torch.ones(0, dtype=torch.bool)
        mask = state.constraint.mask_after(tokens)  # [V] bool
        if mask is None:
            return None
        mask = mask.to(self.model.device)
        if mask.shape[0] < self._vocab:
            mask = torch.nn.functional.pad(mask, (0, self._vocab - mask.shape[0]))
        mask = mask[: self._vocab] if self._head is None else mask[self._head.keep]
        return mask if bool(mask.any()) else None

    # --------------------------------------------------------------------------------------------- commit

    def _record(self, state: DecodeState, tree: DraftTree, fed: int | list[int]) -> None:
        """End a proposal: ``fed`` says which of ``tree``'s nodes are in the draft cache, in slots
        ``len(state.ids) + position``: an int ``n`` for nodes ``0..n-1`` at positions ``0..n-1``, or a list with
        each node's position (-1: not fed). Every fed node's parent must be fed before it."""
        self._tree = tree
        self._base = len(state.ids) - self._offset
        self._fed = fed

    def _root_slot(self) -> int:
        """The draft-cache slot of the proposal's root (tree levels are fed behind it): the last committed
        token's."""
        return self._n_cached - 1

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        """Keep the draft cache consistent with what was accepted (:meth:`_keep_accepted`)."""
        self._keep_accepted(accepted)
        self._tree = None

    def _keep_accepted(self, accepted: list[int]) -> None:
        """Keep the fed nodes of the accepted path in the draft cache, drop the rest of the proposal's slots.

        Siblings of a tree have distinct tokens, so the accepted tokens name the accepted nodes."""
        tree, fed = self._tree, self._fed
        slots: list[int] = []
        if tree is not None:
            node = -1
            for tok in accepted:
                nxt = next((c for c in tree.children[node + 1] if tree.tokens[c] == tok), None)
                if nxt is None:
                    break
                pos = (nxt if nxt < fed else -1) if isinstance(fed, int) else fed[nxt]
                if pos < 0:
                    break
                slots.append(self._base + pos)
                node = nxt
        self._cache.keep(self._base, slots)  # a crop when the kept slots are the first ones (chains)
        self._n_cached = self._base + len(slots)


class DraftModelDrafter(DraftModelBase):
    """Chain drafter over a draft model: ``k`` draft tokens per step.

    Args:
        draft_model: a transformers causal LM with the target's tokenizer.
        k: draft tokens per step (γ), >= 1: the most, with ``stop``.
        stop: in [0, 1): end the chain after a token whose probability under the draft (``p``, over the trimmed
            head with VocabTrim) is below ``stop``; that token is still proposed. 0: always ``k`` tokens. A draft
            too unsure to be accepted is not worth the draft forwards after it nor their verification rows; the
            decision reads the draft's own distribution only, so the verification stays exact (greedy and sampled).
        tokenizers_match, vocab_trim: see :class:`DraftModelBase`.
    """

    def __init__(
        self,
        draft_model: torch.nn.Module,
        k: int = 4,
        tokenizers_match: bool | None = None,
        vocab_trim: int | Sequence[int] | None = None,
        stop: float = 0.0,
    ) -> None:
        super().__init__(draft_model, tokenizers_match=tokenizers_match, vocab_trim=vocab_trim)
        self.k = check_positive_int("k", k)
        if not (isinstance(stop, (int, float)) and not isinstance(stop, bool) and 0 <= stop < 1):
            raise ValueError(f"stop must be a probability in [0, 1), got {stop!r}")
        self.stop = float(stop)

    drafts_constrained = True  # masks p with the output constraint (DecodeState.constraint): see _allowed

    def _extra_slots(self) -> int:
        return self.k

    def propose(self, state: DecodeState) -> DraftTree:
        k = min(self.k, state.draft_limit)
        logits = self._catch_up(state)  # [V_shared], or [M] trimmed
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            allowed = self._allowed(state, tokens)  # before the forward: a dead end costs none
            if allowed is None:
                break
            if i:
                logits = self._next_logits(state, [tokens[-1]])
            if allowed.numel():  # the draft's distribution under the constraint: p is what it draws from (exact)
                logits = logits.masked_fill(~allowed, float("-inf"))
            if state.params.greedy:
                tok = int(logits.argmax())
                unsure = self.stop and float(torch.softmax(logits.float(), -1)[tok]) < self.stop
            else:
                p = warp(logits, state.params)
                tok = sample(p, state.generator)
                rows.append(self._lift(p))  # [V_shared]
                unsure = self.stop and float(p[tok]) < self.stop
            tokens.append(self._token(tok))
            if unsure:  # proposed, and the last one (the decision reads p only)
                break
        n = len(tokens)
        if not n:
            self._record(state, DraftTree.empty(), 0)
            return DraftTree.empty()
        probs = torch.stack(rows) if rows else None  # [n, V_shared]: row i = p(. | root, d_1..d_i)
        if probs is not None:
            probs = torch.cat([probs, probs.new_zeros((1, probs.shape[1]))])  # row n: leaf, never read
        tree = DraftTree.chain(tokens, probs)
        self._record(state, tree, n - 1)  # the cache holds the first n - 1 draft tokens
        return tree
