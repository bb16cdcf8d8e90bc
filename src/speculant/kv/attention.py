"""Attention probabilities for the few queries an eviction policy reads, without switching the model to eager.

The model keeps SDPA. :class:`QueryCapture` adds a forward pre-hook to every attention module that recomputes the
query vectors of the latest ``last`` tokens from the module's own input (``q_proj``, the optional per-head
``q_norm`` of Qwen3, then the module's RoPE with the ``position_embeddings`` the decoder passes in), a cost of
``last / T`` of one q projection. :func:`attention_probs` then scores them against the cached keys.

Supported: attention modules with ``q_proj``, ``head_dim``, ``scaling``, ``layer_idx`` whose modelling module
defines ``apply_rotary_pos_emb`` (Llama, Qwen2, Qwen3, Mistral and other Llama-family models). GPT-2, GPT-NeoX
and Phi (fused or partial-rotary projections) raise ValueError; attention-free policies work for every model.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["QueryCapture", "attention_probs"]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    if not mods:
        raise ValueError(
            f"{type(model).__name__}: attention-based KV policies need Llama-family attention modules "
            "(q_proj + rotary embeddings); use an attention-free policy (keydiff, streaming, knorm, random)"
        )
    return mods


class QueryCapture:
    """Context manager: while active, ``queries[layer]`` is the ``[B, H_q, w, D]`` post-RoPE queries of the last
    ``w = min(last, T)`` tokens of the latest forward (``last=0``: all of them)."""

    def __init__(self, model: torch.nn.Module, last: int = 0) -> None:
        self.last = last
        self.modules = {m.layer_idx: m for m in _attention_modules(model)}
        self.queries: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)  # [B, T, hidden]
        cos, sin = kwargs["position_embeddings"]  # [B, T, D] each
        if self.last:
            hidden, cos, sin = hidden[:, -self.last :], cos[:, -self.last :], sin[:, -self.last :]
        b, w, _ = hidden.shape
        q = module.q_proj(hidden).view(b, w, -1, module.head_dim)
        if hasattr(module, "q_norm"):
            q = module.q_norm(q)
        q = q.transpose(1, 2)  # [B, H_q, w, D]
        rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
        self.queries[module.layer_idx] = rope(q, q, cos, sin)[0]

    def __enter__(self):
        for m in self.modules.values():
            if not hasattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb"):
                raise ValueError(f"{type(m).__name__} has no rotary embedding helper: attention policies unsupported")
            self._handles.append(m.register_forward_pre_hook(self._hook, with_kwargs=True))
        self.queries.clear()
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def record(self, layer: int, queries: torch.Tensor) -> None:
        """Store ``queries [B, H_q, T, D]`` (post-RoPE) of ``layer``: how a forward that bypasses the modules
        (:class:`speculant.core.llama_forward.LlamaForward`) reports them; no hooks need to be active."""
        self.queries[layer] = queries[:, :, -self.last :] if self.last else queries

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the captured queries of input rows ``rows`` (e.g. the root + accepted path of a draft tree,
        which :meth:`SpecCache.keep` leaves as the last cache slots)."""
        for layer, q in self.queries.items():
            self.queries[layer] = q[:, :, torch.as_tensor(rows, device=q.device)]

    def scaling(self, layer: int) -> float:
        return float(self.modules[layer].scaling)


def attention_probs(queries: torch.Tensor, keys: torch.Tensor, scaling: float, causal: bool = True) -> torch.Tensor:
    """Softmax attention of ``queries [B, H_q, Q, D]`` over ``keys [B, H_kv, T, D]`` -> ``[B, H_q, Q, T]``.

    ``causal``: the queries belong to the tokens in the last ``Q`` cache slots (query ``i`` sees slots
    ``<= T - Q + i``); otherwise they belong to later positions and see every key.
    """
    hq, q = queries.shape[1], queries.shape[2]
    hkv, t = keys.shape[1], keys.shape[2]
    k = keys.float().repeat_interleave(hq // hkv, dim=1)  # [B, H_q, T, D]
    logits = torch.matmul(queries.float(), k.transpose(-1, -2)) * scaling  # [B, H_q, Q, T]
    if not causal:
        return logits.softmax(-1)
    future = torch.arange(t, device=keys.device)[None, :] > (t - q + torch.arange(q, device=keys.device))[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(-1)
