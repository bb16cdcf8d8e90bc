"""Feature-level drafting (EAGLE, Li et al. 2024): the drafter reads the target's own last hidden states.

A token-level drafter must rebuild, from tokens alone, what the target knows about the context; a feature drafter
is handed it. The target's final-normed hidden state ``f_t`` (what its LM head reads to predict ``x_{t+1}``) and
the embedding of the token that followed, ``x_{t+1}``, enter the drafter as one input row
``feature_fc([emb(x_{t+1}) ; f_t])`` (:func:`speculant.models.attached.add_feature_input`); its layers and final norm turn
the row at ``t`` into ``f̂_{t+1}``, and the target's LM head reads ``f̂_{t+1}`` to draft ``x_{t+2}``. Deeper draft
tokens feed the drafter's own ``f̂`` back in place of the target's (the target's are not known yet).

Cache invariant: between steps the drafter's cache holds one row per position ``t`` whose target state ``f_t`` is
known (``t = 0 .. _n_real - 1``) and nothing else. The engine hands over the target's states of the tokens that
entered its cache (:attr:`DecodeState.target_hidden`: the prompt after prefill, then the root and the accepted
tokens of each step), a proposal feeds the rows it now can, then the draft rows; on commit the draft rows are
dropped (they were computed from ``f̂``; the next proposal feeds the accepted positions again with the target's
true ``f``). Verification is unchanged: the one exact verifier checks the chain as any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..models.attached import feature_layers, is_feature_drafter
from ..core.cache import cache_kwarg
from ..core.checks import num_layers
from .base import DecodeState
from .model import DraftModelDrafter

__all__ = ["FeatureDrafter"]


class FeatureDrafter(DraftModelDrafter):
    """Chain of ``k`` draft tokens from a feature (EAGLE) drafter; :class:`DraftModelDrafter`'s proposal loop and
    sampling, with inputs built from the target's hidden states.

    Args:
        draft_model: an attached feature drafter (:func:`speculant.models.attached.is_feature_drafter`; e.g. loaded with
            :func:`speculant.load_draft`), sharing the target's embedding and LM head.
        k, tokenizers_match, vocab_trim: as :class:`DraftModelDrafter`.
    """

    uses_target_hidden = True
    """Tells the engine to hand over the target's states (:attr:`DecodeState.target_hidden`)."""

    def __init__(self, draft_model: torch.nn.Module, k: int = 4, tokenizers_match: bool | None = None,
                 vocab_trim: int | Sequence[int] | None = None) -> None:
        super().__init__(draft_model, k=k, tokenizers_match=tokenizers_match, vocab_trim=vocab_trim)
        if not is_feature_drafter(draft_model):
            raise ValueError(f"{type(draft_model).__name__} is not a feature drafter (it has no feature_fc input "
                             "map): use the chain method for a token-level draft model")
        self.target_taps = feature_layers(draft_model)  # target layers whose outputs it also reads (EAGLE-3 style)
        self._n_real = 0  # draft-cache rows built from the target's own hidden states
        self._f: torch.Tensor | None = None  # [H] the drafter's last output state f̂ (input of the next row)

    def begin(self, state: DecodeState) -> None:
        cfg = getattr(state.target, "config", None)
        if getattr(cfg, "final_logit_softcapping", None):
            raise ValueError("a feature drafter needs a target whose logits are its LM head over its final hidden "
                             "state; this one soft-caps its logits")
        if self.model.config.hidden_size != cfg.hidden_size:
            raise ValueError(f"the feature drafter's hidden size ({self.model.config.hidden_size}) is not the "
                             f"target's ({cfg.hidden_size})")
        layers = num_layers(state.target)
        if any(not 0 <= i < layers for i in self.target_taps):
            raise ValueError(f"the feature drafter reads target layers {self.target_taps}; the target has {layers}")
        super().begin(state)
        self._n_real = 0
        self._f = None

    def _rows(self, state: DecodeState, tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
        """Feed rows ``feature_fc([emb(tokens) ; feats])`` (``feats [T, F]``: the tapped layers' outputs, then the
        final state; a draft row has only the drafter's own state, zeros in place of the taps); the drafter's
        output states ``f̂ [T, H]`` (final-normed, what the LM head reads)."""
        device = self.model.device
        ids = torch.tensor(tokens, device=device).clamp_(max=self._max_input_id)  # [T]
        emb = self.model.get_input_embeddings()(ids)  # [T, H]
        fc = self.model.feature_fc
        missing = fc.in_features - emb.shape[-1] - feats.shape[-1]
        if missing:  # a draft row: no tapped states
            feats = torch.cat([feats.new_zeros((feats.shape[0], missing)), feats], -1)
        x = F.linear(torch.cat([emb, feats.to(emb.dtype)], -1), fc.weight, fc.bias)[None]  # [1, T, H]
        with state.draft_forward(device):
            if self._lean is not None:
                return self._lean.hidden(None, self._cache, inputs_embeds=x)[0]
            base = self.model.base_model
            return base(inputs_embeds=x, **cache_kwarg(base, self._cache), use_cache=True).last_hidden_state[0]

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        """Feed the rows of every position whose target state arrived since the last proposal; ``p``'s logits
        after the last one (it drafts the token after the root)."""
        feats = torch.cat(state.target_hidden) if state.target_hidden else None  # [N, H]
        state.target_hidden.clear()
        n = 0 if feats is None else feats.shape[0]
        if self._n_real + n != len(state.ids) - 1:
            raise RuntimeError(f"feature drafter out of step: {self._n_real} + {n} target states for "
                               f"{len(state.ids)} committed tokens")
        if n == 0:  # a one-token prompt: no target state yet; draft from the embedding alone
            feats = self.model.get_input_embeddings().weight.new_zeros((1, self.model.config.hidden_size))  # [1, H]
            out = self._rows(state, state.ids[-1:], feats)
            self._cache.crop(self._n_real)  # a made-up row: never kept
        else:
            out = self._rows(state, state.ids[self._n_real + 1:], feats)  # row t: (f_t, x_{t+1})
            self._n_real += n
        self._n_cached = len(state.ids)
        self._f = out[-1]
        return self._head_logits(self._f)

    def _next_logits(self, state: DecodeState, tokens: list[int]) -> torch.Tensor:
        """One draft row: the last draft token with the drafter's own last state ``f̂``."""
        out = self._rows(state, tokens, self._f[None].expand(len(tokens), -1))
        self._f = out[-1]
        return self._head_logits(self._f)

    def commit(self, state: DecodeState, accepted: list[int]) -> None:
        """Drop the draft rows: the accepted positions are fed again with the target's states."""
        self._cache.crop(self._n_real)
        self._n_cached = self._n_real
        self._tree = None
