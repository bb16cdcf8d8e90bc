"""A lean forward for small Llama-architecture DRAFT models: the same computation without the module machinery.

A draft model is small (the bundled one: 2 layers, hidden 192), so a transformers forward costs mostly Python:
module calls, kwargs plumbing, mask and RoPE helpers — about 1 ms per call on our CPUs, several times the
arithmetic. :class:`LeanLlama` runs the same layers as plain tensor ops on the model's own weights (q/k/v and
gate/up projections fused into one matmul each, a precomputed RoPE table) and appends to the same
:class:`~speculant.cache.SpecCache`, so the drafter's cache bookkeeping (crop, keep, commit) is unchanged.

It is used for drafts only, never for the target: a draft's numerics only shape proposals, and verification
keeps the output exact whatever they are (float rounding may differ from transformers' forward in the last bits).
Only configurations it reproduces are accepted (:meth:`LeanLlama.build` returns None otherwise, and the
drafter falls back to the model's own forward): ``LlamaForCausalLM``, eval mode, no attention/MLP bias,
``silu`` MLP, default RoPE, SDPA-compatible attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import SpecCache

__all__ = ["LeanLlama"]


class LeanLlama:
    """``hidden = lean(input_ids [1, T], cache, positions [1, T] | None, mask [1, 1, T, L + T] | None)``: the final
    normed hidden states ``[1, T, H]`` of a Llama model, appending the new keys/values to ``cache``.

    The fused q/k/v and gate/up weights are copies: rebuild after the model's weights change (the drafter keys
    its instance on the parameters' versions, :meth:`~speculant.drafters.model.DraftModelBase.begin`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        base = model.model
        self.model = model
        self.embed = base.embed_tokens.weight  # [V, H]
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight,
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),  # [(Hq + 2 Hkv) D, H]
                a.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),  # [2 I, H]
                m.down_proj.weight,
            ))
        self.norm = base.norm.weight
        rotary = base.rotary_emb
        positions = torch.arange(cfg.max_position_embeddings, device=self.embed.device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.float()[None]  # [P, D/2]
        emb = torch.cat([freqs, freqs], -1)  # [P, D]
        self.cos = (emb.cos() * rotary.attention_scaling).to(self.embed.dtype)
        self.sin = (emb.sin() * rotary.attention_scaling).to(self.embed.dtype)

    @classmethod
    def build(cls, model: torch.nn.Module) -> LeanLlama | None:
        """A lean forward for ``model``, or None if its configuration is not one this class reproduces."""
        cfg = getattr(model, "config", None)
        if type(model).__name__ != "LlamaForCausalLM" or cfg is None or model.training:
            return None
        rope = getattr(cfg, "rope_parameters", None) or {}
        if (getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)
                or getattr(cfg, "hidden_act", None) != "silu" or rope.get("rope_type", "default") != "default"
                or getattr(cfg, "pretraining_tp", 1) != 1
                or getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None)):
            return None
        return cls(model)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: SpecCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        past = cache.get_seq_length()
        if positions is None:
            positions = torch.arange(past, past + t, device=input_ids.device)[None]
        if mask is None and t > 1:  # causal over [cache ; new tokens]
            causal = torch.ones((t, past + t), dtype=torch.bool, device=input_ids.device).tril(past)
            mask = causal[None, None]
        cos, sin = self.cos[positions[0]][None, None], self.sin[positions[0]][None, None]  # [1, 1, T, D]
        x = F.embedding(input_ids, self.embed)  # [1, T, H]
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        for i, (w_in, w_qkv, w_o, w_post, w_gu, w_down) in enumerate(self.layers):
            qkv = F.linear(self._norm(x, w_in), w_qkv).view(1, t, hq + 2 * hkv, d).transpose(1, 2)
            q, k, v = qkv.split([hq, hkv, hkv], dim=1)  # [1, Hq|Hkv, T, D]
            k_all, v_all = cache.layers[i].update(self._rope(k, cos, sin), v.contiguous())
            attn = F.scaled_dot_product_attention(self._rope(q, cos, sin), k_all, v_all, attn_mask=mask,
                                                  scale=self.scaling, enable_gqa=hq != hkv)  # [1, Hq, T, D]
            x = x + F.linear(attn.transpose(1, 2).reshape(1, t, hq * d), w_o)
            gate, up = F.linear(self._norm(x, w_post), w_gu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w_down)
        return self._norm(x, self.norm)
