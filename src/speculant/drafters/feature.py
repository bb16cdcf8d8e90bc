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

Trees (EAGLE-2's dynamic tree, as EAGLE-3 drafts): :class:`FeatureInputs` gives any level-by-level tree drafter of
:mod:`.trees` feature inputs. A tree node's row reads its token and the output state ``f̂`` of its parent's row
(the root's: the last real row's output), so each branch drafts from its own predicted states; the tree mask
is the token-level drafters' with the last real row as the root's slot. :func:`feature_variant` makes the
feature class of a drafter class (what the registry builds when a method gets a feature draft model).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..models.attached import feature_layers, is_feature_drafter
from ..core.cache import cache_kwarg
from ..core.checks import num_layers
from .base import DecodeState
from .model import DraftModelBase, DraftModelDrafter
from .trees import DynamicTreeDrafter

__all__ = ["FeatureDrafter", "FeatureInputs", "FeatureTreeDrafter", "feature_variant", "mixin_variant"]


class FeatureInputs:
    """Mixin over a :class:`~speculant.drafters.model.DraftModelBase` drafter: its rows are built from the
    target's hidden states and the drafter's own output states instead of token embeddings alone (module doc).
    Chains feed one draft row at a time (:meth:`_next_logits`), trees a level at a time (:meth:`_all_logits`,
    each node reading its parent's state)."""

    uses_target_hidden = True
    """Tells the engine to hand over the target's states (:attr:`DecodeState.target_hidden`)."""

    def __init__(self, draft_model: torch.nn.Module, *args, **kwargs) -> None:
        super().__init__(draft_model, *args, **kwargs)
        if not is_feature_drafter(draft_model):
            raise ValueError(f"{type(draft_model).__name__} is not a feature drafter (it has no feature_fc input "
                             "map): use the chain method for a token-level draft model")
        self.target_taps = feature_layers(draft_model)  # target layers whose outputs it also reads (EAGLE-3 style)
        self._n_real = 0  # draft-cache rows built from the target's own hidden states
        self._rows_before = 0  # cache rows when the proposal's draft rows start (the root's row is the last)
        self._f: torch.Tensor | None = None  # [H] the drafter's last output state f̂ (input of the next row)
        self._node_f: list[torch.Tensor] = []  # [H] per tree node fed this proposal, in feed order

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

    def _rows(self, state: DecodeState, tokens: list[int], feats: torch.Tensor, mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """Feed rows ``feature_fc([emb(tokens) ; feats])`` (``feats [T, F]``: the tapped layers' outputs, then the
        final state; a draft row has only the drafter's own state, zeros in place of the taps, whose columns of
        ``feature_fc`` are then skipped), causally or with
        ``mask [1, 1, T, L + T]`` and ``positions [1, T]``; the drafter's output states ``f̂ [T, H]``
        (final-normed, what the LM head reads)."""
        device = self.model.device
        ids = torch.tensor(tokens, device=device).clamp_(max=self._max_input_id)  # [T]
        emb = self.model.get_input_embeddings()(ids)  # [T, H]
        fc = self.model.feature_fc
        h = emb.shape[-1]
        if fc.in_features - h > feats.shape[-1]:  # a draft row: no tapped states (zeros), so only the columns
            w = fc.weight  # of the embedding and of the final state count: [H, H] + [H, H] of the [H, F + H]
            x = F.linear(emb, w[:, :h], fc.bias) + F.linear(feats.to(emb.dtype), w[:, -feats.shape[-1]:])
            x = x[None]  # [1, T, H]
        else:
            x = F.linear(torch.cat([emb, feats.to(emb.dtype)], -1), fc.weight, fc.bias)[None]  # [1, T, H]
        extra = self._extra_input(len(tokens))
        if extra is not None:
            x = x + extra.to(x.dtype)
        with state.draft_forward(device):
            if self._lean is not None:
                return self._lean.hidden(None, self._cache, positions, mask, inputs_embeds=x)[0]
            base = self.model.base_model
            return base(inputs_embeds=x, attention_mask=mask, position_ids=positions,
                        **cache_kwarg(base, self._cache), use_cache=True).last_hidden_state[0]

    def _extra_input(self, rows: int) -> torch.Tensor | None:
        """What a variant adds to the input of the next ``rows`` rows, ``[rows, H]`` (ConFu: its future input,
        :mod:`.confu`); None: nothing."""
        return None

    def _catch_up(self, state: DecodeState) -> torch.Tensor:
        """Feed the rows of every position whose target state arrived since the last proposal; ``p``'s logits
        after the last one (it drafts the token after the root)."""
        feats = torch.cat(state.target_hidden) if state.target_hidden else None  # [N, H]
        state.target_hidden.clear()
        n = 0 if feats is None else feats.shape[0]
        if self._n_real + n != len(state.ids) - 1:
            raise RuntimeError(f"feature drafter out of step: {self._n_real} + {n} target states for "
                               f"{len(state.ids)} committed tokens")
        if n == 0:  # a one-token prompt: no target state yet; draft from the embedding alone, in a made-up row
            feats = self.model.get_input_embeddings().weight.new_zeros((1, self.model.config.hidden_size))  # [1, H]
            out = self._rows(state, state.ids[-1:], feats)  # dropped on commit with the draft rows
            self._rows_before = self._n_real + 1
        else:
            out = self._rows(state, state.ids[self._n_real + 1:], feats)  # row t: (f_t, x_{t+1})
            self._n_real += n
            self._rows_before = self._n_real
        self._n_cached = len(state.ids)
        self._f = out[-1]
        self._node_f = []
        return self._head_logits(self._f)

    def _next_logits(self, state: DecodeState, tokens: list[int]) -> torch.Tensor:
        """One draft row of a chain: the last draft token with the drafter's own last state ``f̂``."""
        out = self._rows(state, tokens, self._f[None].expand(len(tokens), -1))
        self._f = out[-1]
        return self._head_logits(self._f)

    def _all_logits(self, state: DecodeState, tokens: list[int], mask: torch.Tensor | None,
                    positions: torch.Tensor | None) -> torch.Tensor:
        """One tree level (``tokens``, the last fed nodes): each row reads its parent's output state."""
        parents = self._fed_parents[len(self._fed_parents) - len(tokens):]
        feats = torch.stack([self._f if p < 0 else self._node_f[p] for p in parents])  # [T, H]
        out = self._rows(state, tokens, feats, mask, positions)  # [T, H]
        self._node_f.extend(out)
        return self._head_logits(out)

    def _root_slot(self) -> int:
        return self._rows_before - 1  # the root's row: the last real (or made-up) row

    def _keep_accepted(self, accepted: list[int]) -> None:
        """Drop every draft row: the accepted positions are fed again with the target's states."""
        self._cache.crop(self._n_real)
        self._n_cached = self._n_real


def mixin_variant(mixin: type, cls: type, known: dict[type, type], prefix: str, what: str) -> type:
    """``known[cls]``, else a class ``mixin`` over the draft-model drafter class ``cls`` named ``prefix + name``
    (documented as "``cls`` with ``what``"). Callers cache it, so there is one class per ``cls``."""
    if not issubclass(cls, DraftModelBase):
        raise ValueError(f"{cls.__name__} does not draft with a draft model")
    if cls in known:
        return known[cls]
    return type(f"{prefix}{cls.__name__}", (mixin, cls),
                {"__doc__": f"{cls.__name__} with {what}.", "__module__": mixin.__module__})


@functools.cache
def feature_variant(cls: type) -> type:
    """The feature-input class of the draft-model drafter class ``cls`` (:class:`FeatureInputs` over it; one
    class per ``cls``)."""
    return mixin_variant(FeatureInputs, cls, {DraftModelDrafter: FeatureDrafter, DynamicTreeDrafter: FeatureTreeDrafter},
                         "Feature", "feature inputs")


class FeatureDrafter(FeatureInputs, DraftModelDrafter):
    """Chain of ``k`` draft tokens from a feature (EAGLE) drafter; :class:`DraftModelDrafter`'s proposal loop and
    sampling, with inputs built from the target's hidden states.

    Args:
        draft_model: an attached feature drafter (:func:`speculant.models.attached.is_feature_drafter`; e.g. loaded with
            :func:`speculant.load_draft`), sharing the target's embedding and LM head.
        k, tokenizers_match, vocab_trim: as :class:`DraftModelDrafter`.
    """


class FeatureTreeDrafter(FeatureInputs, DynamicTreeDrafter):
    """EAGLE-2's greedy dynamic tree (:class:`~speculant.drafters.trees.DynamicTreeDrafter`) from a feature drafter:
    how EAGLE-3 drafts. Same arguments."""
