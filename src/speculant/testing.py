"""Tiny, randomly initialised transformers models of several architectures, built in-process (no download).

Used by the test suite and by the demo until bundled models exist. ``perturbed`` makes a draft that partially
agrees with its target (the target's weights plus noise).
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
)

__all__ = ["ARCHITECTURES", "tiny_config", "tiny_model", "perturbed"]

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2", "gpt_neox", "phi")


def tiny_config(arch: str, vocab_size: int = 96, hidden: int = 32, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, context: int = 512):
    """A small config of ``arch`` (one of :data:`ARCHITECTURES`)."""
    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
    if arch in ("llama", "qwen2", "qwen3", "mistral"):
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
        extra = {"head_dim": hidden // heads} if arch == "qwen3" else {}
        if arch == "mistral":
            extra["sliding_window"] = None
        return cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                   **extra, **common)
    if arch == "phi3":  # fused qkv / gate-up projections, partial rotary (as in Phi-4-mini)
        return Phi3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                          partial_rotary_factor=0.5, sliding_window=None, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, max_position_embeddings=context, **common)
    if arch == "phi":
        return PhiConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=context,
                         **common)
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
               init_std: float = 0.5, **config_kwargs) -> torch.nn.Module:
    """A randomly initialised model in eval mode. A large ``init_std`` gives peaked, well-separated logits
    (few near-ties), so greedy equality tests compare decisions, not float noise."""
    cfg = tiny_config(arch, **config_kwargs)
    if hasattr(cfg, "initializer_range"):
        cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return model.eval()


def perturbed(model: torch.nn.Module, scale: float = 0.3, seed: int = 1) -> torch.nn.Module:
    """A copy of ``model`` with every weight multiplied by ``1 + scale * N(0, 1)`` noise: a draft that agrees
    with its target often but not always."""
    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=gen).to(p.dtype))
    return out.eval()
