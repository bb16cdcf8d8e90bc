"""Tiny, randomly initialised transformers models of several architectures, built in-process (no download).

Used by the test suite and by the demo's ``--tiny`` mode. ``perturbed`` makes a draft that partially agrees with
its target (the target's weights plus noise); :func:`tiny_tokenizer` trains a small byte-level BPE on a few
standard-library files and :func:`save_model_pair` writes a target and its perturbed draft as model directories.
"""

from __future__ import annotations

import copy
import sysconfig
from collections.abc import Iterable
from pathlib import Path

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

__all__ = ["ARCHITECTURES", "FIM_TOKENS", "tiny_config", "tiny_model", "perturbed", "stdlib_texts", "tiny_tokenizer",
           "save_model_pair", "VLM_ARCHITECTURES", "VLM_CHAT_TEMPLATE", "qwen2_vl_inputs", "save_tiny_llava",
           "tiny_vlm"]

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2", "gpt_neox", "phi")
BOS, EOS = "<s>", "</s>"  # ids 0 and 1, the bos/eos ids of tiny_config
_STDLIB_FILES = ("textwrap.py", "string.py", "functools.py", "bisect.py", "heapq.py")
_FALLBACK_TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 50  # stdlib sources not installed


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


def stdlib_texts(names: Iterable[str] = _STDLIB_FILES) -> list[str]:
    """The sources of a few modules of the running interpreter's standard library (a fixed snippet if absent)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / n).read_text(encoding="utf-8") for n in names if (root / n).is_file()]
    return texts or [_FALLBACK_TEXT]


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
              "<|endoftext|>")
"""Qwen2.5-Coder's fill-in-the-middle and repository tokens (:mod:`speculant.models.fim`), for a tiny tokenizer
that infills: ``tiny_tokenizer(special_tokens=FIM_TOKENS)``."""


def tiny_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 1024, special_tokens: Iterable[str] = ()):
    """A byte-level BPE tokenizer trained on ``texts`` (default: :func:`stdlib_texts`), as a
    ``transformers.PreTrainedTokenizerFast`` with ``<s>`` = 0 (bos) and ``</s>`` = 1 (eos), the ids of
    :func:`tiny_config`, and ``special_tokens`` added after its ``vocab_size`` tokens (e.g. :data:`FIM_TOKENS`).
    It adds no special tokens when encoding."""
    from .train.bundled.tokenizer import train_tokenizer

    tok = train_tokenizer(list(texts) if texts is not None else stdlib_texts(), vocab_size=vocab_size,
                          min_frequency=0, bos=BOS, eos=EOS, pad=None)
    extra = list(special_tokens)
    if extra:
        tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def save_model_pair(
    out_dir: str | Path,
    tokenizer,
    hidden: int = 128,
    layers: int = 4,
    context: int = 1024,
    init_std: float = 0.1,
    draft_scale: float = 0.02,
    seed: int = 0,
    draft_tokenizer=None,
) -> tuple[Path, Path]:
    """Save a random Llama target (vocab = tokenizer size) and its perturbed copy as the draft, each with a
    tokenizer (``draft_tokenizer`` defaults to ``tokenizer``), as HF directories ``out_dir/target`` and
    ``out_dir/draft``. Returns both paths."""
    target = tiny_model(
        "llama", seed=seed, vocab_size=len(tokenizer), hidden=hidden, layers=layers, heads=4, kv_heads=2,
        context=context, init_std=init_std,
    )
    draft = perturbed(target, scale=draft_scale, seed=seed + 1)
    paths = []
    for name, model, tok in (("target", target, tokenizer), ("draft", draft, draft_tokenizer or tokenizer)):
        path = Path(out_dir) / name
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


VLM_ARCHITECTURES = ("llava", "idefics3", "qwen2_vl", "qwen2_5_vl")
"""The vision-language families :func:`tiny_vlm` builds."""


def tiny_vlm(kind: str = "llava", vocab_size: int = 96, image_token: int = 95, seed: int = 0,
             init_std: float = 0.2, hidden: int = 32, image_size: int = 32, patch: int = 8) -> torch.nn.Module:
    """A randomly initialised vision-language model in eval mode: a tiny vision tower and projector in front of
    a 2-layer Llama (``kind``: ``llava``, a CLIP tower with 16 image tokens per 32x32 image; ``idefics3``, a
    SigLIP-like tower with pixel shuffle, 4 image tokens), or ``qwen2_vl``: Qwen2-VL's tower (2x2 patch merging,
    4 image tokens per 32x32 image, :func:`qwen2_vl_inputs`) in front of a 2-layer Qwen2 with M-RoPE (the
    vision start/end tokens are ``image_token - 2`` and ``image_token - 1``), or ``qwen2_5_vl``: the same with
    Qwen2.5-VL's windowed tower."""
    from transformers import (CLIPVisionConfig, Idefics3Config, Idefics3ForConditionalGeneration, LlavaConfig,
                              LlavaForConditionalGeneration)
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    text = tiny_config("llama", vocab_size=vocab_size, hidden=hidden)
    text.initializer_range = init_std
    vision = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
                  image_size=image_size, patch_size=patch)
    torch.manual_seed(seed)
    if kind == "llava":
        cfg = LlavaConfig(vision_config=CLIPVisionConfig(**vision, projection_dim=hidden), text_config=text,
                          image_token_index=image_token, vision_feature_select_strategy="default",
                          vision_feature_layer=-1)
        model = LlavaForConditionalGeneration(cfg)
    elif kind in ("qwen2_vl", "qwen2_5_vl"):
        from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                                  Qwen2VLForConditionalGeneration)

        text = tiny_config("qwen2", vocab_size=vocab_size, hidden=hidden).to_dict()
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": _mrope_section(hidden // 4)}
        text["initializer_range"] = init_std
        for key in ("model_type", "architectures", "transformers_version"):
            text.pop(key, None)
        tokens = dict(image_token_id=image_token, video_token_id=image_token - 3,
                      vision_start_token_id=image_token - 2, vision_end_token_id=image_token - 1)
        tower = dict(depth=1, num_heads=4, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2,
                     in_channels=3)
        if kind == "qwen2_vl":
            cfg = Qwen2VLConfig(text_config=text, vision_config=dict(**tower, embed_dim=hidden, hidden_size=hidden,
                                                                      mlp_ratio=2), **tokens)
            model = Qwen2VLForConditionalGeneration(cfg)
        else:
            cfg = Qwen2_5_VLConfig(text_config=text, vision_config=dict(
                **tower, hidden_size=hidden, out_hidden_size=hidden, intermediate_size=2 * hidden,
                window_size=2 * patch, fullatt_block_indexes=[0]), **tokens)
            model = Qwen2_5_VLForConditionalGeneration(cfg)
    elif kind == "idefics3":
        cfg = Idefics3Config(vision_config=Idefics3VisionConfig(**vision).to_dict(), text_config=text.to_dict(),
                             image_token_id=image_token, scale_factor=2)
        model = Idefics3ForConditionalGeneration(cfg)
    else:
        raise ValueError(f"unknown vision-language family {kind!r}; known: {', '.join(VLM_ARCHITECTURES)}")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, init_std)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = 1
    return model.eval()


def _mrope_section(head_dim: int) -> list[int]:
    """An M-RoPE split of ``head_dim // 2`` rotary frequencies into time, height and width (Qwen2-VL's 16/24/24 of
    64, scaled)."""
    half = head_dim // 2
    time = max(1, half // 4)
    height = (half - time) // 2
    return [time, height, half - time - height]


def qwen2_vl_inputs(ids_before: list[int], ids_after: list[int], image_token: int = 95, seed: int = 0,
                    image_size: int = 32, patch: int = 8) -> dict[str, torch.Tensor]:
    """The processor's outputs for a :func:`tiny_vlm` ``qwen2_vl`` prompt: ``ids_before``, the vision start token,
    one image's tokens (its ``image_size / patch`` squared patches merged 2x2), the vision end token, ``ids_after``;
    random pixels in Qwen2-VL's flattened patch layout, the grid and the token types M-RoPE needs."""
    g = torch.Generator().manual_seed(seed)
    side = image_size // patch
    tokens = side * side // 4
    ids = [*ids_before, image_token - 2, *[image_token] * tokens, image_token - 1, *ids_after]
    pixels = torch.randn(side * side, 3 * 2 * patch * patch, generator=g)  # [patches, C * temporal * P * P]
    return {"input_ids": torch.tensor([ids]), "pixel_values": pixels,
            "image_grid_thw": torch.tensor([[1, side, side]]),
            "mm_token_type_ids": torch.tensor([[int(i == image_token) for i in ids]])}


VLM_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                     "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
                     "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}"
                     "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
"""The tiny chat template with image parts (``<image>``, expanded by the processor into the image's tokens)."""


def save_tiny_llava(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny LLaVA (:func:`tiny_vlm`) with a real processor (CLIP image processor, a BPE tokenizer with an
    ``<image>`` token and :data:`VLM_CHAT_TEMPLATE`), saved to ``out_dir``: loadable by name like any model."""
    from transformers import LlavaProcessor

    try:  # the PIL image processor: no torchvision needed (and no warning that it is missing)
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:  # older transformers
        from transformers import CLIPImageProcessor

    tok = tiny_tokenizer(vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    image_token = tok.convert_tokens_to_ids("<image>")
    model = tiny_vlm("llava", vocab_size=len(tok), image_token=image_token, seed=seed)
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                  crop_size={"height": 32, "width": 32}),
                               tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                               image_token="<image>", num_additional_image_tokens=1,
                               chat_template=VLM_CHAT_TEMPLATE)
    out = Path(out_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return out
