"""ConFu's learned parts (Qin, Goel, Gagrani et al. 2026, "ConFu: Contemplate the Future for Better Speculative
Sampling"): soft-prompt entries in the frozen target's cache, the contemplate token, and the future input of the
drafter.

The target is never changed. During its verification forward a *contemplate token* ``[con]`` rides after a
verified row (the root, or every tree node): an input embedding, no token id, that attends to the context up to
its anchor and to ``S`` learned key/value entries per layer (the *soft prompt*, 16 by default) that nothing else
sees; no other row attends to it (:class:`speculant.core.types.Probes`). Its final-normed hidden state is the
*future vector* ``f``: what the target, having read the context, "contemplates" about what comes next. The drafter
(an EAGLE-3 feature drafter, :mod:`speculant.drafters.feature`) adds ``future_fc(f)`` to the input of each row.

The contemplate embedding is a small mixture (``mixture`` > 1: the paper's dynamic contemplate token with MoE):
``e = sum_m softmax(router(h))_m E_m``, routed by ``h``, the target's last final state known before the forward
(the state of the token before the root), so that ``[con]`` depends on the context.

Everything learned here lives in one module, :class:`Contemplation`, held by the drafter as ``contemplation``
(saved with its own weights; ``attached.json`` records ``"contemplate": {"soft": S, "mixture": M}``).
``future_fc`` starts at zero, so a ConFu drafter made from an EAGLE-3 drafter drafts exactly as it did until
training moves it.
"""

from __future__ import annotations

import torch

__all__ = ["Contemplation", "add_contemplation", "contemplation_of", "is_confu_drafter", "kv_shape"]


class Contemplation(torch.nn.Module):
    """ConFu's parameters (module docstring) for a target of ``layers`` layers with ``kv_heads`` key/value heads of
    ``head_dim`` and hidden size ``hidden``: ``soft`` soft-prompt entries per layer and ``mixture`` contemplate
    embeddings."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, hidden: int, soft: int = 16,
                 mixture: int = 1) -> None:
        super().__init__()
        if soft < 1 or mixture < 1:
            raise ValueError(f"ConFu needs at least one soft-prompt entry and one contemplate embedding, got "
                             f"soft={soft}, mixture={mixture}")
        self.soft = soft
        self.mixture = mixture
        self.soft_keys = torch.nn.Parameter(torch.randn(layers, kv_heads, soft, head_dim) * 0.02)  # after RoPE
        self.soft_values = torch.nn.Parameter(torch.randn(layers, kv_heads, soft, head_dim) * 0.02)
        self.embeds = torch.nn.Parameter(torch.randn(mixture, hidden) * 0.02)  # [M, H]
        self.router = torch.nn.Linear(hidden, mixture) if mixture > 1 else None
        self.future_fc = torch.nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():
            self.future_fc.weight.zero_()  # starts as the EAGLE-3 drafter it is made from

    def token_embeds(self, h: torch.Tensor | None, n: int = 1) -> torch.Tensor:
        """Contemplate embeddings ``[N, H]`` routed by the target states ``h [N, H]`` (with one embedding, or
        ``h`` None, the mixture's mean weight: ``n`` copies)."""
        if self.router is None or h is None:
            e = self.embeds.mean(0) if self.router is not None else self.embeds[0]
            return e.expand(n if h is None else h.shape[0], -1)
        weights = torch.softmax(self.router(h.to(self.embeds.dtype)).float(), -1).to(self.embeds.dtype)  # [N, M]
        return weights @ self.embeds  # [N, H]

    def future_input(self, f: torch.Tensor) -> torch.Tensor:
        """The drafter rows' extra input ``[..., H]`` from future vectors ``f [..., H]``."""
        return self.future_fc(f.to(self.future_fc.weight.dtype))

    @torch.no_grad()
    def init_from(self, target: torch.nn.Module, ids: torch.Tensor, embeds: torch.Tensor | None = None) -> None:
        """Start the soft prompt from the target's own cache over ``ids [S]`` (real keys and values, at their
        scale) and the contemplate embeddings from ``embeds [M, H]`` (default: the mean input embedding of
        ``ids``), each mixture entry slightly perturbed."""
        from transformers import DynamicCache

        from ..core.cache import cache_kwarg

        ids = ids[: self.soft].to(target.device)
        if ids.numel() < self.soft:
            raise ValueError(f"init_from needs {self.soft} token ids, got {ids.numel()}")
        base = target.base_model
        cache = DynamicCache(config=target.config)
        base(input_ids=ids[None], **cache_kwarg(base, cache), use_cache=True)
        for i, layer in enumerate(cache.layers):
            self.soft_keys[i].copy_(layer.keys[0])
            self.soft_values[i].copy_(layer.values[0])
        if embeds is None:
            embeds = target.get_input_embeddings()(ids).mean(0, keepdim=True)  # [1, H]
        noise = torch.randn_like(self.embeds) * 0.02 * embeds.float().pow(2).mean().sqrt()
        self.embeds.copy_(embeds.to(self.embeds.dtype).expand_as(self.embeds) + noise.to(self.embeds.dtype))


def kv_shape(config) -> tuple[int, int, int]:
    """``(layers, key/value heads, head dim)`` of a target with ``config``: the soft prompt's shape but its length."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim)


def add_contemplation(draft: torch.nn.Module, target_config, soft: int = 16, mixture: int = 1) -> Contemplation:
    """Give the feature drafter ``draft`` ConFu's parameters for a target of ``target_config`` (its
    ``contemplation`` module, in the drafter's dtype and device); returns it."""
    module = Contemplation(*kv_shape(target_config), target_config.hidden_size, soft=soft, mixture=mixture)
    draft.contemplation = module.to(device=draft.device, dtype=draft.dtype)
    return draft.contemplation


def contemplation_of(model: torch.nn.Module) -> Contemplation | None:
    """The drafter's ConFu parameters, None for any other model."""
    found = getattr(model, "contemplation", None)
    return found if isinstance(found, Contemplation) else None


def is_confu_drafter(model: torch.nn.Module) -> bool:
    """True for a ConFu drafter: a feature drafter with :class:`Contemplation`."""
    return contemplation_of(model) is not None and isinstance(getattr(model, "feature_fc", None), torch.nn.Linear)
