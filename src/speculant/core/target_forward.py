"""The target's forward in the decoding loop: the Llama forward where it reproduces the model, else its own.

``forward="auto"`` (the default everywhere) takes :class:`~speculant.core.llama_forward.LlamaForward` (the "lean"
forward) when :func:`~speculant.core.llama_forward.unsupported` finds nothing against the model and the generation
fits in its sliding window, and logs once why it does not otherwise; ``"lean"`` insists (a ValueError naming the
reason); ``"model"`` always calls the model's own forward (transformers), e.g. to compare the two.

Every :class:`~speculant.core.llama_forward.LlamaForward` built here is handed
:func:`speculant.core.draft_batch.active`, so that a batch's sequences drafting together share their draft forwards.

Both write the same :class:`~speculant.core.cache.SpecCache`, take the same tree mask and position ids, and return the
same logits up to float rounding, so the loop around them does not know which one runs.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from .cache import cache_kwarg
from .checks import sliding_window, warn_once
from .draft_batch import active
from .llama_forward import LlamaForward, Segment, unsupported
from .quant import quantization_of

__all__ = ["FORWARDS", "Segment", "TargetForward", "batched_logits", "llama_forward_for"]

log = logging.getLogger(__name__)

FORWARDS = ("auto", "lean", "model")
"""Accepted values of ``forward=`` (``--forward``)."""

_SLOT = "_speculant_llama_forward"  # the attribute of a model that holds its built LlamaForward


class _Slot:
    """A model's built forward, ``(key, LlamaForward)``, kept on the model itself. Why not a
    ``WeakKeyDictionary`` keyed by the model: its value (the forward) refers to the model, so the entry kept
    the model alive for the whole process (a demo that loaded two pairs ran out of memory); on the model it is an
    ordinary cycle that the garbage collector frees with the model. A copied or pickled model starts without one."""

    __slots__ = ("hit",)

    def __init__(self, hit: tuple | None) -> None:
        self.hit = hit

    def __deepcopy__(self, memo: dict) -> _Slot:
        return _Slot(None)

    def __reduce__(self) -> tuple:
        return (_Slot, (None,))


def _key(model: torch.nn.Module, packed: bool) -> tuple:
    """Changes when a parameter is replaced or the model switches dtype/device, and, for a packed LlamaForward
    (which holds copies), when a parameter changes in place (its version counter). An unpacked one needs no
    rebuild for in-place updates: it reads the model's tensors, see llama_forward._fused. Quantizing the model (in
    place, speculant.core.quant) changes it too."""
    if packed:
        return (quantization_of(model), *((id(p), p.dtype, p.device, _version(p)) for p in model.parameters()))
    return (quantization_of(model), *((id(p), p.dtype, p.device) for p in model.parameters()))


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (inference tensors have none and cannot change in place: 0)."""
    return 0 if t.is_inference() else t._version


def llama_forward_for(model: torch.nn.Module) -> LlamaForward | None:
    """The model's :class:`~speculant.core.llama_forward.LlamaForward`, built once per model (and rebuilt when its
    parameters are replaced, or when they change in place under a packed one) and handed the draft batcher
    (:func:`speculant.core.draft_batch.active`); None when :func:`~speculant.core.llama_forward.unsupported` names a
    reason."""
    if unsupported(model) is not None:
        return None
    slot = model.__dict__.get(_SLOT)
    hit = slot.hit if slot is not None else None
    if hit is None or hit[0] != _key(model, hit[1].packed):
        forward = LlamaForward(model, active_batcher=active)
        hit = (_key(model, forward.packed), forward)  # the key after fusing (it replaces the projection Parameters)
        model.__dict__[_SLOT] = _Slot(hit)  # not through Module.__setattr__: no submodule, no state_dict entry
    return hit[1]


class TargetForward:
    """``logits [1, T, V] = forward(cache, input_ids=[1, T] | inputs_embeds=[1, T, H], positions, mask,
    capture)`` through :class:`~speculant.core.llama_forward.LlamaForward` (:attr:`llama`) or the model's own;
    :attr:`kind` says which (``"lean"``/``"model"``, the ``forward=`` option's names)."""

    def __init__(self, model: torch.nn.Module, mode: str = "auto", max_length: int | None = None,
                 taps: list[int] | tuple[int, ...] = ()) -> None:
        if mode not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {mode!r}")
        self.model = model
        self.taps = list(taps)  # layers whose outputs hidden_out also receives (a feature drafter's, EAGLE-3 style)
        self.llama: LlamaForward | None = None
        if mode != "model":
            reason = unsupported(model)
            if reason is None:
                window = sliding_window(model.config)
                if window is not None and max_length is not None and max_length > window:
                    reason = f"the sequence ({max_length} tokens) exceeds the sliding window ({window})"
            if reason is not None and mode == "lean":
                raise ValueError(f"forward='lean' is not available for {type(model).__name__}: {reason}")
            if reason is not None:
                warn_once(log, f"lean forward not used ({reason}); using the model's own forward")
            else:
                self.llama = llama_forward_for(model)
        self.kind = "lean" if self.llama is not None else "model"

    def __call__(self, cache, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 capture=None, logits_to_keep: int = 0, hidden_out: list | None = None,
                 head_rows: int | None = None) -> torch.Tensor:
        """Logits ``[1, T, V]`` (``logits_to_keep=k``: of the last k inputs only, ``[1, k, V]``; ``head_rows=n``:
        of the first n only, ``[1, n, V]``, the other rows' states still reach ``hidden_out``).

        ``hidden_out``: a list that receives the states a feature drafter reads, ``[1, T, (len(taps) + 1) H]``: the
        outputs of the layers in :attr:`taps`, then the final-normed hidden state; the logits are then the LM
        head over the latter."""
        if self.llama is None and hidden_out is None and head_rows is None:
            feed = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
            with capture if capture is not None else nullcontext():
                out = self.model(**feed, **cache_kwarg(self.model, cache), attention_mask=mask,
                                 position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep)
            return out.logits
        hidden = self._hidden(cache, input_ids, inputs_embeds, positions, mask, capture, hidden_out)  # [1, T, H]
        head = self.llama.logits if self.llama is not None else self.model.get_output_embeddings()
        if head_rows is not None:
            hidden = hidden[:, :head_rows]
        return head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

    def prefill(self, cache, input_ids: torch.Tensor | None, hidden_out: list | None = None,
                inputs_embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        """Feed ``input_ids [1, T]`` (or their embeddings ``inputs_embeds [1, T, H]``, e.g. a vision-language
        prompt's with its image features) into ``cache`` without computing logits (the prompt before the root);
        ``hidden_out`` as in :meth:`__call__`; ``positions``: ``[1, T]``, or M-RoPE's ``[3, 1, T]`` (Qwen2-VL's
        image prompts, through the model's own forward: the Llama forward takes one position per token)."""
        self._hidden(cache, None if inputs_embeds is not None else input_ids, inputs_embeds, positions, None, None,
                     hidden_out)

    def _hidden(self, cache, input_ids, inputs_embeds, positions, mask, capture, hidden_out) -> torch.Tensor:
        """The final-normed hidden states ``[1, T, H]``; appends the drafter's states to ``hidden_out``."""
        taps = {i: None for i in self.taps} if hidden_out is not None and self.taps else None
        if self.llama is not None and (positions is None or positions.dim() == 2):
            hidden = self.llama.hidden(input_ids, cache, positions, mask, inputs_embeds=inputs_embeds,
                                      capture=capture, taps=taps)
        else:
            feed = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
            hooks = [] if taps is None else [self.model.model.layers[i].register_forward_hook(_tap(taps, i))
                                             for i in taps]
            try:
                with capture if capture is not None else nullcontext():
                    base = self.model.base_model
                    hidden = base(**feed, **cache_kwarg(base, cache), attention_mask=mask, position_ids=positions,
                                  use_cache=True).last_hidden_state
            finally:
                for hook in hooks:
                    hook.remove()
        if hidden_out is not None:
            hidden_out.append(hidden if taps is None else torch.cat([taps[i] for i in self.taps] + [hidden], -1))
        return hidden


def batched_logits(forwards: list[TargetForward], segments: list[Segment],
                   hidden_outs: list[list | None]) -> list[torch.Tensor]:
    """Logits ``[1, T_s, V]`` for each of several sequences' new tokens (``segments``, each with its own cache),
    ``forwards[s]`` being sequence s's forward (one model). Those on a Llama forward run as one forward over all
    their rows (:meth:`~speculant.core.llama_forward.LlamaForward.hidden_batch`: every matrix, the LM head included,
    read once per step for the whole batch); any on the model's own forward run one by one. ``hidden_outs[s]``: as
    :meth:`TargetForward.__call__`'s ``hidden_out`` for sequence s (None: not wanted). A segment with
    ``head_rows=0`` (a prompt chunk: its keys and values, no logits) gets an empty ``[1, 0, *]`` tensor."""
    out: list[torch.Tensor | None] = [None] * len(segments)
    first = next((f.llama for f in forwards if f.llama is not None), None)
    shared = [i for i, f in enumerate(forwards) if f.llama is not None and f.llama is first]
    if len(shared) <= 1:  # nothing to batch
        shared = []
    for i, (f, seg, h) in enumerate(zip(forwards, segments, hidden_outs)):
        if i not in shared:
            out[i] = f(seg.cache, seg.input_ids, seg.inputs_embeds, seg.positions, seg.mask, seg.capture,
                       hidden_out=h, head_rows=seg.head_rows)
    if shared:
        engine = forwards[shared[0]].llama
        wanted = sorted({t for i in shared if hidden_outs[i] is not None for t in forwards[i].taps})
        taps = {t: None for t in wanted} if wanted else None
        hidden = engine.hidden_batch([segments[i] for i in shared], taps)  # [1, T_s, H] each
        heads = [h.shape[1] if segments[i].head_rows is None else segments[i].head_rows
                 for i, h in zip(shared, hidden)]
        rows = torch.cat([h[:, :n] for h, n in zip(hidden, heads)], 1)  # [1, sum n_s, H]: the rows wanting logits
        logits = engine.logits(rows) if rows.shape[1] else rows  # [1, sum n_s, V]; none wanted: [1, 0, H]
        start = head = 0  # the segment's first row in hidden, in logits
        for i, h, n in zip(shared, hidden, heads):
            stop = start + h.shape[1]
            out[i] = logits[:, head:head + n]
            head += n
            if hidden_outs[i] is not None:
                own = [taps[t][:, start:stop] for t in forwards[i].taps]
                hidden_outs[i].append(torch.cat(own + [h], -1) if own else h)
            start = stop
    return out


def _tap(taps: dict, index: int):
    """A forward hook storing a decoder layer's output hidden states in ``taps[index]``."""

    def hook(module, args, output):
        taps[index] = output[0] if isinstance(output, tuple) else output

    return hook
