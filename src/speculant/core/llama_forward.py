"""The Llama-family forward as plain tensor ops: the same computation as transformers' forward without its machinery.

On a real model the forward is almost all of a decoding step, and a large part of transformers' forward is not
arithmetic: 30 layers of module calls, kwargs plumbing, per-call mask and RoPE building, cache bookkeeping.
:class:`LlamaForward` runs the same layers as plain tensor ops on the model's own weights:

* q/k/v and gate/up projections fused into one matmul each, prepared once and without a second copy: the
  model's own q/k/v (gate/up) weights become views of the fused matrix (:func:`_fused`; Phi-3 ships them fused);
* RoPE tables computed once (grown on demand), indexed by the step's position ids;
* keys and values written straight into our :class:`~speculant.core.cache.SpecCache` (or its evicting subclass);
* attention for forwards of at most 64 new tokens (decoding, verification) computed row by row
  (:mod:`speculant.core.attention`: a token's output is the same bits alone or beside others, under the caller's
  tree mask or the causal one); longer prefills use SDPA (``is_causal`` for an empty cache, a small boolean mask
  otherwise). With the compiled library, a layer's RoPE, cache write and row-by-row attention are one call
  (:func:`speculant.core.kernels.rope_attend`, the same bits as the torch ops it replaces: ten-odd tensor ops per
  layer were a fifth of a 0.5B draft forward's time);
* on a CPU, the matrices (and the LM head) reordered once into oneDNN's blocked layout
  (:class:`~speculant.core.packed.PackedMatrix`) where :func:`~speculant.core.packed.pack_enabled` allows the copy: in
  bfloat16 the same results bit for bit, 1.35-1.7x faster matmuls for decoding (see :mod:`speculant.core.packed`);
* for a model quantized by :func:`~speculant.core.quant.quantize_model` (int8, int4), the recorded quantized
  matrices (fused where the projections are) multiplied by torch's weight-only quantized kernels
  (:mod:`speculant.core.quant`).

One class serves the target (plain decoding, chains, trees, probe slots, evicted caches) and the draft models.
Covered: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` (per-head q/k
norms), ``Phi3ForCausalLM`` (fused projections, partial rotary), in eval mode, with RMSNorm, ``silu`` MLPs and
a static RoPE (``default``, ``linear``, ``llama3``, ``yarn``). :func:`unsupported` names the reason for anything
else, and callers fall back to the model's own forward. A sliding-window model is covered while a sequence fits
in its window (:attr:`LlamaForward.window`; the engine checks it per generation).

Numerics follow transformers' order of operations (float32 RMSNorm statistics, RoPE tables cast to the model
dtype, SDPA), so float32 logits agree with the model's own forward to rounding (bit for bit in our tests). In
bfloat16/float16 on a CPU the attention itself runs in float32 (SDPA is 3-5x slower there in bf16 for a few
queries): the logits then differ from transformers' bf16 ones by bf16 rounding, as any two bf16 kernels do; the
tests check both dtypes on every covered architecture within the dtype's tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import attention, kernels
from .checks import sliding_window
from .modes import normal_mode
from .ops import fused_linear, rms_norm
from .packed import PackedMatrix, linear, pack_enabled, packable
from .quant import ATTR, BLOCK_KINDS, QuantMatrix, quantization_of

__all__ = ["COVERED", "Batcher", "LlamaForward", "Segment", "fused_groups", "unsupported"]

PREFILL_CHUNK = 512
"""Tokens per forward when a long causal segment (a prompt) is fed: attention over a chunk's rows at a time keeps
its scores small (measured on 2 Zen 4 cores, Qwen2.5-Coder-1.5B in its GGUF's 4-bit weights: a 4,096-token prompt
28.2 s in one forward, 19.2 s in chunks of 512, 19.4 s in chunks of 128; 8,192 tokens 96.2 s, 58.5 s, 60.2 s).
Quantized rows and row-by-row attention are row independent, so the chunks give the same bits as one forward
(float weights: the products of a chunk may round differently from those of the whole prompt)."""

COVERED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")
"""Model classes :class:`LlamaForward` reproduces."""

_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq and attention_scaling fixed at init


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's tensors, fused where the model keeps them apart."""

    in_norm: torch.Tensor  # [H]
    qkv: torch.Tensor | PackedMatrix | QuantMatrix  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D]: Qwen3's per-head q and k norm weights, one row per head
    o: torch.Tensor | PackedMatrix | QuantMatrix  # [H, Hq D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor | PackedMatrix | QuantMatrix  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | PackedMatrix | QuantMatrix  # [H, I]
    down_bias: torch.Tensor | None


@dataclass
class Segment:
    """One sequence's new tokens in a forward over several sequences (:meth:`LlamaForward.hidden_batch`): each has
    its own cache, positions and mask; the matrix products take every sequence's rows together."""

    cache: Any  # its SpecCache (possibly evicting)
    input_ids: torch.Tensor | None = None  # [1, T]
    inputs_embeds: torch.Tensor | None = None  # [1, T, H] (instead of input_ids: probe slots)
    positions: torch.Tensor | None = None  # [1, T]; None: the cache length onwards (a chain)
    mask: torch.Tensor | None = None  # [1, 1, T, L + T] additive or boolean (a tree); None: causal
    capture: Any = None  # a QueryCapture recording each layer's post-RoPE queries (attention-scored KV policies)
    head_rows: int | None = None  # logits of the first n rows only (the rest: states only), None: of every row


class Batcher(Protocol):
    """What runs the forwards of several callers together (a batch's sequences drafting at once): :meth:`hidden`
    takes one caller's request and returns its final-normed states ``[1, T, H]`` once the shared forward
    (:meth:`LlamaForward.hidden_batch`) ran."""

    def hidden(self, forward: LlamaForward, segment: Segment) -> torch.Tensor: ...


@dataclass
class _Plan:
    """How one segment attends in this forward (worked out once, used by every layer)."""

    t: int  # new tokens
    past: int  # cached tokens before them
    positions: torch.Tensor  # [1, T] int64
    last: int  # the largest position + 1
    rowwise: bool  # row-independent attention (speculant.core.attention), else SDPA
    allowed: torch.Tensor | None  # [T, L + T] bool (rowwise with a mask), None: causal
    mask: torch.Tensor | None  # SDPA's mask
    causal: bool  # SDPA's is_causal


def unsupported(model: torch.nn.Module) -> str | None:
    """Why :class:`LlamaForward` cannot reproduce ``model``, or None when it can."""
    name = type(model).__name__
    cfg = getattr(model, "config", None)
    if name not in COVERED or cfg is None:
        return f"{name} is not a covered architecture ({', '.join(COVERED)})"
    if model.training:
        return "the model is in training mode"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r} (covered: silu)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return f"attention implementation {cfg._attn_implementation!r} (covered: sdpa, eager)"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in _STATIC_ROPE:
        return f"RoPE type {rope_type!r} changes with the sequence length (covered: {', '.join(_STATIC_ROPE)})"
    if getattr(model, "hf_quantizer", None) is not None:
        return "quantized weights"
    return None


def _bias(*linears: torch.nn.Module) -> torch.Tensor | None:
    """The biases of ``linears`` concatenated (zeros for those without one), or None if none has one."""
    biases = [getattr(m, "bias", None) for m in linears]
    if all(b is None for b in biases):
        return None
    like = next(b for b in biases if b is not None)  # (a weight may be a released meta tensor)
    return torch.cat([b.detach() if b is not None else like.new_zeros(m.weight.shape[0])
                      for m, b in zip(linears, biases)])


def _adjacent(weights: list[torch.Tensor]) -> bool:
    """True when ``weights`` are contiguous row blocks lying back to back in one storage."""
    first = weights[0]
    offset = first.storage_offset()
    for w in weights:
        if (not w.is_contiguous() or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or w.storage_offset() != offset or w.shape[1:] != first.shape[1:]):
            return False
        offset += w.numel()
    return True


def _fused(*linears: torch.nn.Module) -> torch.Tensor:
    """``[sum of rows, in]``: the weights of ``linears`` stacked into one matrix, in place.

    The first time, the weights are copied into one new matrix and each module's ``weight`` becomes a Parameter
    viewing its rows of it (same values, same ``requires_grad``; no memory kept twice, and in-place updates of
    the model's weights are seen by :class:`LlamaForward`). Later builds find the views back to back and reuse them.
    """
    weights = [m.weight for m in linears]
    if _adjacent(weights):
        rows = sum(w.shape[0] for w in weights)
        return weights[0].detach().as_strided((rows, *weights[0].shape[1:]), weights[0].stride())
    # normal tensors even when built under inference_mode: the model may be trained or run with autograd later
    with normal_mode():
        fused = torch.cat([w.detach() for w in weights])
        start = 0
        for m, w in zip(linears, weights):
            m.weight = torch.nn.Parameter(fused[start : start + w.shape[0]], requires_grad=w.requires_grad)
            start += w.shape[0]
    return fused


def _extract(layer: torch.nn.Module, heads: int, kv_heads: int) -> _Layer:
    a, m = layer.self_attn, layer.mlp
    if hasattr(a, "qkv_proj"):  # Phi-3: already fused
        qkv, qkv_bias = a.qkv_proj.weight.detach(), _bias(a.qkv_proj)
    else:
        qkv, qkv_bias = _fused(a.q_proj, a.k_proj, a.v_proj), _bias(a.q_proj, a.k_proj, a.v_proj)
    if hasattr(m, "gate_up_proj"):
        gate_up, gate_up_bias = m.gate_up_proj.weight.detach(), _bias(m.gate_up_proj)
    else:
        gate_up, gate_up_bias = _fused(m.gate_proj, m.up_proj), _bias(m.gate_proj, m.up_proj)
    q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    qk_norm = None
    if q_norm is not None:  # one norm call over the q and k heads together
        qk_norm = torch.cat([q_norm.weight.detach().expand(heads, -1), k_norm.weight.detach().expand(kv_heads, -1)])
    return _Layer(
        in_norm=layer.input_layernorm.weight.detach(), qkv=qkv, qkv_bias=qkv_bias, qk_norm=qk_norm,
        o=a.o_proj.weight.detach(), o_bias=_bias(a.o_proj), post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=gate_up, gate_up_bias=gate_up_bias, down=m.down_proj.weight.detach(), down_bias=_bias(m.down_proj),
    )


def _quantized(*linears: torch.nn.Module) -> QuantMatrix:
    """The quantized matrices :func:`~speculant.core.quant.quantize_model` recorded on ``linears``, fused into one."""
    matrices = [getattr(m, ATTR, None) for m in linears]
    if any(q is None for q in matrices):
        raise ValueError("the model is marked quantized but a projection has no quantized matrix")
    return QuantMatrix.cat(matrices)


def _groups(layer: torch.nn.Module) -> tuple[tuple[torch.nn.Module, ...], tuple[torch.nn.Module, ...]]:
    """A decoder layer's linears that :class:`LlamaForward` multiplies as one matrix: ``(q/k/v, gate/up)``."""
    a, m = layer.self_attn, layer.mlp
    qkv = (a.qkv_proj,) if hasattr(a, "qkv_proj") else (a.q_proj, a.k_proj, a.v_proj)
    gate_up = (m.gate_up_proj,) if hasattr(m, "gate_up_proj") else (m.gate_proj, m.up_proj)
    return qkv, gate_up


def fused_groups(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]]:
    """Every group of linears of ``model``'s decoder layers that :class:`LlamaForward` fuses into one matrix (q/k/v,
    gate/up): what :func:`speculant.core.quant.unify_fused` takes."""
    return [group for layer in model.model.layers for group in _groups(layer)]


def _quantize_layer(layer: torch.nn.Module, w: _Layer) -> _Layer:
    """``w`` with its four matrices replaced by the layer's quantized ones (biases and norms unchanged)."""
    qkv, gate_up = _groups(layer)
    return dataclasses.replace(w, qkv=_quantized(*qkv), o=_quantized(layer.self_attn.o_proj),
                               gate_up=_quantized(*gate_up), down=_quantized(layer.mlp.down_proj))


class LlamaForward:
    """``logits = forward(input_ids [1, T] | inputs_embeds [1, T, H], cache, positions [1, T] | None,
    mask [1, 1, T, L + T] | None)``; :meth:`hidden` stops before the LM head (final-normed states ``[1, T, H]``).

    Build it with :meth:`build`, which returns None (and :func:`unsupported` says why) for a model it does not
    reproduce. Unpacked (:attr:`packed` False) it reads the model's weights in place (in-place updates are seen);
    rebuild it when parameters are replaced by new tensors or biases change (biases, rare in these models, are
    concatenated copies), and, when packed, when weights change in place
    (:func:`speculant.core.target_forward.llama_forward_for` does both).

    ``pack``: reorder the matrices once for the CPU's matmul kernels (:mod:`speculant.core.packed`); None (default)
    lets :func:`~speculant.core.packed.pack_enabled` decide.

    A model quantized by :func:`~speculant.core.quant.quantize_model` runs on its quantized matrices
    (:attr:`quantization` names the kind; ``pack`` is then ignored) and, like a packed one, holds copies
    (:attr:`packed` is True: rebuild after in-place changes).

    ``active_batcher``: called by :meth:`hidden` to ask for the :class:`Batcher` the calling code runs under (None:
    the forward runs at once). Whoever builds the forward passes it
    (:func:`~speculant.core.target_forward.llama_forward_for` passes the draft batcher's); this module knows no
    batcher."""

    def __init__(self, model: torch.nn.Module, pack: bool | None = None,
                 active_batcher: Callable[[], Batcher | None] | None = None) -> None:
        cfg = model.config
        base = model.model
        self.model = model
        self.active_batcher = active_batcher
        self.embed = base.embed_tokens.weight  # [V, H]
        self.lm_head = model.get_output_embeddings()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        attn = base.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.eps = cfg.rms_norm_eps
        self.window = sliding_window(cfg)
        self.layers = [_extract(layer, self.heads, self.kv_heads) for layer in base.layers]
        matrices = [m for w in self.layers for m in (w.qkv, w.o, w.gate_up, w.down)]
        head = self.lm_head.weight
        self.quantization = quantization_of(model)
        self._head: PackedMatrix | QuantMatrix | None = None  # the packed LM head, made by the first head_matrix()
        self._table_for: torch.dtype | None = None  # _q4_table(): the dtype its table was built for
        self._table: torch.Tensor | None = None
        self._table_keep: list[torch.Tensor] = []
        self._intermediate = 0
        if self.quantization != "none":  # the quantized matrices: private copies, like packed ones
            self.packed = True
            self.layers = [_quantize_layer(layer, w) for layer, w in zip(base.layers, self.layers)]
            self._head = _quantized(self.lm_head)
        else:
            if pack is None:
                pack = pack_enabled([*matrices, head])
            self.packed = bool(pack) and all(packable(m) for m in (*matrices, head))
            if self.packed:
                self.layers = [dataclasses.replace(w, qkv=PackedMatrix(w.qkv), o=PackedMatrix(w.o),
                                                   gate_up=PackedMatrix(w.gate_up), down=PackedMatrix(w.down))
                               for w in self.layers]
        # SDPA on CPU is several times slower in bfloat16/float16 than in float32 for a few queries (measured:
        # 250 vs 80 us for one query over 300 keys): attend in float32 there (inputs upcast, output rounded back)
        low = self.embed.dtype in (torch.bfloat16, torch.float16)
        self.attention_dtype = torch.float32 if low and self.embed.device.type == "cpu" else self.embed.dtype
        self.norm = base.norm.weight
        rotary = base.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float()  # [R/2], R = rotary dims (= D unless partial)
        self._rope_scale = float(rotary.attention_scaling)
        self.rotary_dim = 2 * self._inv_freq.numel()
        self._cos = self._sin = self.embed.new_empty((0, self.rotary_dim))  # [P, R], grown on demand
        self._grow(min(getattr(cfg, "max_position_embeddings", 4096), 4096))

    @classmethod
    def build(cls, model: torch.nn.Module, pack: bool | None = None,
              active_batcher: Callable[[], Batcher | None] | None = None) -> LlamaForward | None:
        """A :class:`LlamaForward` for ``model``, or None if :func:`unsupported` names a reason."""
        return None if unsupported(model) is not None else cls(model, pack, active_batcher)

    def _grow(self, n: int) -> None:
        """RoPE tables for positions ``[0, n)`` (at least double the old size), as transformers computes them."""
        n = max(int(n), 2 * self._cos.shape[0])
        positions = torch.arange(n, device=self.embed.device, dtype=torch.float32)
        freqs = positions[:, None] * self._inv_freq.to(self.embed.device)[None]  # [P, R/2]
        emb = torch.cat([freqs, freqs], -1)  # [P, R]
        self._cos = (emb.cos() * self._rope_scale).to(self.embed.dtype)
        self._sin = (emb.sin() * self._rope_scale).to(self.embed.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first R dims of ``x [1, heads, T, D]`` (``cos``/``sin`` ``[1, 1, T, R]``)."""
        r = self.rotary_dim
        rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
        half = r // 2
        out = rot * cos + torch.cat([-rot[..., half:], rot[..., :half]], -1) * sin
        return out if rest is None else torch.cat([out, rest], -1)

    def _fused_attention(self, segments: list[Segment], plans: list[_Plan], x: torch.Tensor):
        """The compiled library when this forward's attention blocks can run as one call per layer and sequence
        (:func:`speculant.core.kernels.rope_attend`: full-width RoPE, no per-head q/k norm, caches that append in
        place, row-by-row attention, nothing captured), else None (the torch ops and :func:`attention.attend`)."""
        if (self.rotary_dim != self.head_dim or self.layers[0].qk_norm is not None or x.device.type != "cpu"
                or x.dtype not in (torch.float32, torch.bfloat16)
                or any(not p.rowwise for p in plans) or any(s.capture is not None for s in segments)
                or any(len(s.cache.layers) != len(self.layers)
                       or not all(getattr(layer, "appends_in_place", False) for layer in s.cache.layers)
                       for s in segments)):
            return None
        return kernels.library()

    def _q4_table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """int64 ``[L, 14]`` addresses of every layer's q4 / q8 / q6 matrices, biases and norms and the matrices' code bits
        for :func:`speculant.core.kernels.q4_layers` (built once), or None when some layer cannot run there (another
        weight kind, a dtype or bias the q4 kernel does not take)."""
        if self._table_for == dtype:
            return self._table
        self._table_for, self._table, keep = dtype, None, []

        def address(t: torch.Tensor | None, numel: int) -> int | None:
            if t is None:
                return 0
            if t.dtype != dtype or t.device.type != "cpu" or t.numel() != numel:
                return None
            t = t.contiguous()
            keep.append(t)
            return t.data_ptr()

        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        h, rows = self.embed.shape[1], []
        for w in self.layers:
            mats = (w.qkv, w.o, w.gate_up, w.down)
            if not all(type(m) is QuantMatrix and m.kind in BLOCK_KINDS and m.dtype == dtype for m in mats):
                return None
            inter = w.gate_up.shape[0] // 2
            if (w.qkv.shape != ((hq + 2 * hkv) * d, h) or w.o.shape != (h, hq * d) or w.down.shape != (h, inter)
                    or w.gate_up.shape[1] != h):
                return None
            row = [w.qkv._kernel[0].data_ptr(), address(w.qkv_bias, w.qkv.shape[0]), address(w.in_norm, h),
                   w.o._kernel[0].data_ptr(), address(w.o_bias, h), address(w.post_norm, h),
                   w.gate_up._kernel[0].data_ptr(), address(w.gate_up_bias, 2 * inter),
                   w.down._kernel[0].data_ptr(), address(w.down_bias, h), *(m.kernel_bits for m in mats)]
            if None in row or (rows and inter != self._intermediate):
                return None
            self._intermediate = inter
            rows.append(row)
        self._table, self._table_keep = torch.tensor(rows, dtype=torch.int64), keep
        return self._table

    def _q4_layers(self, x: torch.Tensor, segments: list[Segment], plans: list[_Plan], keys: list,
                   table: torch.Tensor, lib) -> bool:
        """Run every layer over ``x [1, T, H]`` (all segments' rows) in place in one compiled call; False (nothing
        done) when a cache's layers do not share one buffer layout."""
        rows, handles, first = [], [], 0
        for seg, plan, allowed in zip(segments, plans, keys):
            bufs = [layer.extend(plan.t, self.kv_heads, self.head_dim, self.head_dim, x.dtype, x.device)
                    for layer in seg.cache.layers]  # (k [1, Hkv, C, D], v, start) per layer
            handles.append((seg, plan.t))
            k0, v0, start = bufs[0]
            ks, vs = (k0.stride(1), k0.stride(2)), (v0.stride(1), v0.stride(2))
            if any(b[2] != start or (b[0].stride(1), b[0].stride(2)) != ks or (b[1].stride(1), b[1].stride(2)) != vs
                   for b in bufs):
                for s, t in handles:  # give the slots back: the per-layer path appends them itself
                    for layer in s.cache.layers:
                        layer.crop(-t)
                return False
            rows.append(([first, plan.t, start, 0 if allowed is None else allowed.data_ptr(), *ks, *vs],
                         [[k.data_ptr(), v.data_ptr()] for k, v, _ in bufs]))
            first += plan.t
        segs = torch.tensor([r for r, _ in rows], dtype=torch.int64)  # [S, 8]
        caches = torch.tensor([c for _, c in rows], dtype=torch.int64)  # [S, L, 2]
        positions = torch.cat([p.positions[0] for p in plans]).contiguous()  # [T]
        kernels.q4_layers(x[0], table, self._intermediate, self.heads, self.kv_heads, positions, self._cos,
                          self._sin, segs, caches, self.scaling, self.eps, lib)
        return True

    def head_matrix(self) -> torch.Tensor | PackedMatrix | QuantMatrix:
        """The LM head's ``[V, H]`` matrix as :meth:`logits` multiplies by it: quantized when the model is, packed
        when the layers are (made on first use: a drafter's forward never needs its shared head), else the
        model's own weight."""
        if not self.packed:
            return self.lm_head.weight.detach()
        if self._head is None:
            self._head = PackedMatrix(self.lm_head.weight)
        return self._head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over ``hidden [..., H]`` -> ``[..., V]`` (in the model dtype, like transformers)."""
        if not self.packed:
            return self.lm_head(hidden)
        return linear(hidden, self.head_matrix(), getattr(self.lm_head, "bias", None))

    def __call__(self, input_ids: torch.Tensor | None, cache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                 capture=None) -> torch.Tensor:
        """Logits ``[1, T, V]`` for the new tokens (see :meth:`hidden`)."""
        return self.logits(self.hidden(input_ids, cache, positions, mask, inputs_embeds, capture))

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor | None, cache, positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
               capture=None, taps: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[1, T, H]`` of the new tokens; their keys and values are appended to
        ``cache`` (a :class:`~speculant.core.cache.SpecCache`, possibly evicting).

        Args:
            input_ids: ``[1, T]``, or None when ``inputs_embeds`` ``[1, T, H]`` is given (probe slots).
            positions: ``[1, T]`` position ids; default: the cache length onwards (a chain).
            mask: ``[1, 1, T, L + T]`` additive or boolean mask (a tree); default: causal.
            capture: a :class:`~speculant.kv.attention.QueryCapture` that records each layer's post-RoPE
                queries (for attention-scored KV policies).
            taps: layer index -> filled with that layer's output (the residual stream after it, ``[1, T, H]``);
                the keys name the layers to tap (values are overwritten).
        """
        t = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if t > PREFILL_CHUNK and positions is None and mask is None and capture is None:
            return self._chunked(input_ids, cache, inputs_embeds, taps, t)
        segment = Segment(cache, input_ids, inputs_embeds, positions, mask, capture)
        batcher = None if self.active_batcher is None else self.active_batcher()
        if batcher is not None and taps is None:  # a batch's sequences drafting together: one forward for all
            return batcher.hidden(self, segment)
        return self.hidden_batch([segment], taps)[0]

    def _chunked(self, input_ids: torch.Tensor | None, cache, inputs_embeds: torch.Tensor | None,
                 taps: dict[int, torch.Tensor] | None, t: int) -> torch.Tensor:
        """:meth:`hidden` of a causal segment of ``t`` > :data:`PREFILL_CHUNK` tokens, fed in chunks of it."""
        outs: list[torch.Tensor] = []
        tapped: dict[int, list[torch.Tensor]] = {i: [] for i in taps} if taps is not None else {}
        for start in range(0, t, PREFILL_CHUNK):
            part = slice(start, start + PREFILL_CHUNK)
            part_taps = dict.fromkeys(taps) if taps is not None else None
            outs.append(self.hidden(None if input_ids is None else input_ids[:, part], cache,
                                    inputs_embeds=None if inputs_embeds is None else inputs_embeds[:, part],
                                    taps=part_taps))  # [1, chunk, H]
            for i in tapped:
                tapped[i].append(part_taps[i])
        for i, parts in tapped.items():
            taps[i] = torch.cat(parts, 1)  # [1, T, H]
        return torch.cat(outs, 1)  # [1, T, H]

    @torch.no_grad()
    def hidden_batch(self, segments: list[Segment], taps: dict[int, torch.Tensor] | None = None
                     ) -> list[torch.Tensor]:
        """:meth:`hidden` for several sequences in one forward: per segment its final-normed hidden states
        ``[1, T_s, H]``, its keys and values appended to its own cache. Every matrix product takes all segments' rows
        at once (the weights are read once for the batch); attention runs per segment over its own cache. With
        quantized weights and row-by-row attention each row is the same bits as in a forward of its sequence alone
        (both are row independent); with float weights the products may round differently (torch's dense kernels
        are not row independent). ``taps``: as in :meth:`hidden`, the layer outputs of all rows ``[1, sum T_s,
        H]`` in segment order."""
        xs = [F.embedding(s.input_ids, self.embed) if s.inputs_embeds is None else s.inputs_embeds
              for s in segments]  # [1, T_s, H] each
        plans = [self._plan(s, x) for s, x in zip(segments, xs)]
        last = max(p.last for p in plans)
        if last > self._cos.shape[0]:
            self._grow(last)
        x = xs[0] if len(xs) == 1 else torch.cat(xs, 1)  # [1, sum T_s, H]
        bounds = []
        for p in plans:
            start = bounds[-1][1] if bounds else 0
            bounds.append((start, start + p.t))
        lib = self._fused_attention(segments, plans, x)
        keys = [None] * len(plans)  # the compiled calls' masks, uint8 [T, L + T] (the torch path reads plan.allowed)
        if lib is not None:
            keys = [None if p.allowed is None else p.allowed.to(torch.uint8).contiguous() for p in plans]
        if lib is not None:  # one compiled call per layer and sequence for RoPE, the cache write and attention
            table = self._q4_table(x.dtype) if taps is None else None
            if table is not None:
                own = x.contiguous() if len(xs) > 1 or segments[0].inputs_embeds is None else x.clone()
                if self._q4_layers(own, segments, plans, keys, table, lib):  # updated in place: our own tensor
                    out = rms_norm(own, self.norm, self.eps)
                    return [out[:, a:b] for a, b in bounds] if len(bounds) > 1 else [out]
        for i, w in enumerate(self.layers):
            qkv = fused_linear(x, w.qkv, w.qkv_bias, norm=w.in_norm, eps=self.eps)  # [1, sum T_s, (Hq + 2 Hkv) D]
            parts = [self._attend(i, w, qkv[:, a:b], seg, plan, key, lib)
                     for (a, b), seg, plan, key in zip(bounds, segments, plans, keys)]  # [1, T_s, Hq D] each
            attn = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
            x = fused_linear(attn, w.o, w.o_bias, residual=x)
            gate_up = fused_linear(x, w.gate_up, w.gate_up_bias, norm=w.post_norm, eps=self.eps)  # [1, T, 2 I]
            x = fused_linear(gate_up, w.down, w.down_bias, glu=True, residual=x)
            if taps is not None and i in taps:
                taps[i] = x
        out = rms_norm(x, self.norm, self.eps)
        return [out[:, a:b] for a, b in bounds] if len(bounds) > 1 else [out]

    def _plan(self, seg: Segment, x: torch.Tensor) -> _Plan:
        """How ``seg`` (new rows ``x [1, T, H]``) attends: positions, row-by-row or SDPA, its mask."""
        t = x.shape[1]
        past = seg.cache.get_seq_length()
        positions = seg.positions
        if positions is None:  # a chain: the last position is known without reading the tensor back
            positions, last = torch.arange(past, past + t, device=x.device)[None], past + t
        else:
            last = int(positions.max()) + 1
        # row-independent attention (speculant.core.attention): exact speculation; a forward with a mask (a tree,
        # probe rows) is a verification, never a long prefill, so it attends row by row at any size
        rowwise = t <= attention.MAX_ROWS or seg.mask is not None
        allowed = attention.allowed_keys(seg.mask) if rowwise else None  # [T, L + T] bool, None: causal
        mask, causal = seg.mask, False
        if mask is None and t > 1 and not rowwise:
            if past == 0:
                causal = True
            else:  # causal over [cache ; new tokens]
                mask = torch.ones((t, past + t), dtype=torch.bool, device=x.device).tril(past)[None, None]
        if self.attention_dtype != x.dtype and not rowwise and mask is not None and mask.dtype != torch.bool:
            mask = mask.to(self.attention_dtype)
        return _Plan(t, past, positions, last, rowwise, allowed, mask, causal)

    def _attend(self, i: int, w: _Layer, qkv: torch.Tensor, seg: Segment, plan: _Plan, keys: torch.Tensor | None,
                lib) -> torch.Tensor:
        """Layer ``i``'s attention for one segment after its q/k/v projection ``qkv [1, T, (Hq + 2 Hkv) D]``:
        RoPE, the cache write, attention -> ``[1, T, Hq D]``."""
        hq, hkv, d, t = self.heads, self.kv_heads, self.head_dim, plan.t
        dtype = qkv.dtype
        if lib is not None:
            k_buf, v_buf, start = seg.cache.layers[i].extend(t, hkv, d, d, dtype, qkv.device)  # [1, Hkv, C, D]
            return kernels.rope_attend(qkv[0].contiguous(), hq, hkv, plan.positions[0].contiguous(), self._cos,
                                       self._sin, k_buf[0], v_buf[0], start, keys, self.scaling, lib)[None]
        pos = plan.positions[0]
        cos, sin = self._cos[pos][None, None], self._sin[pos][None, None]  # [1, 1, T, R]
        qk, v = qkv.reshape(1, t, hq + 2 * hkv, d).split([hq + hkv, hkv], dim=2)  # [1, T, Hq + Hkv | Hkv, D]
        if w.qk_norm is not None:
            qk = rms_norm(qk, w.qk_norm, self.eps)
        q, k = self._rope(qk.transpose(1, 2), cos, sin).split([hq, hkv], dim=1)  # [1, Hq|Hkv, T, D]
        if seg.capture is not None:
            seg.capture.record(i, q)
        k_all, v_all = seg.cache.layers[i].update(k, v.transpose(1, 2))  # [1, Hkv, L + T, D]
        if plan.rowwise:
            return attention.attend(q, k_all, v_all, plan.allowed, self.scaling)  # [1, T, Hq D]
        if self.attention_dtype != dtype:
            a = self.attention_dtype
            q, k_all, v_all = q.to(a), k_all.to(a), v_all.to(a)
        attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=plan.mask, is_causal=plan.causal,
                                              scale=self.scaling, enable_gqa=hq != hkv)  # [1, Hq, T, D]
        return attn.to(dtype).transpose(1, 2).reshape(1, t, hq * d)
