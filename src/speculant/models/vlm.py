"""Vision-language targets: a model that reads images is, after its prompt, a causal language model.

Gagrani et al. 2024 ("On Speculative Decoding for Multimodal Large Language Models"): a vision-language model's
language backbone is memory-bound like any LLM's, and a text-only drafter that never sees the image still pays.
speculant runs such a target as two pieces that share its weights:

* :func:`text_view`: the target's language model and LM head as an ordinary causal LM (``...ForCausalLM`` of its
  text config, holding the very same modules): the engine, the lean forward, quantization, the cache and the
  verifier work on it unchanged;
* :func:`prompt_embeds`: the prompt's input embeddings as the model's own forward builds them (its vision tower and
  projector, the image features written over the image placeholder tokens), taken from the call the model makes
  into its language model (a pre-hook that stops the call there): one code path for every architecture that
  merges embeddings before its decoder (LLaVA, Idefics3 / SmolVLM, ...). The engine prefills the prompt with them
  (:meth:`speculant.core.batch.Batch.add`'s ``prompt_embeds``); decoding after the prompt is text only.

Qwen2-VL and Qwen2.5-VL give each token three positions (M-RoPE: time, height, width), an image's tokens those of
its grid: :func:`prompt_embeds` then also takes the positions the model computed for the prompt
(:class:`~speculant.core.types.PromptEmbeds`), the engine prefills the prompt at them (the model's own forward), and
every later token, text, has three equal positions, the last prompt token's plus one onwards, which is ordinary
RoPE at the token index plus a fixed offset: decoding after the prompt runs like any Qwen2's (the lean forward,
trees, the batch). Other architectures whose decoder needs more than the merged embeddings (Qwen3-VL's deepstack
features, GLM-4V) or attends both ways among image tokens (Gemma 3, PaliGemma) are refused with a one-line reason.
The drafter never sees image tokens: :class:`speculant.drafters.text_only.TextOnlyDrafter`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..core.types import PromptEmbeds

__all__ = ["check_vlm", "image_inputs", "image_token_ids", "is_vision_language", "load_image", "prompt_embeds",
           "text_view", "user_messages", "vision_parts"]

_MROPE = ("qwen2_vl", "qwen2_5_vl")
"""Model types whose language model takes M-RoPE positions and reads nothing but the merged embeddings: supported,
their text part run as a Qwen2 (:func:`text_view`)."""
_UNSUPPORTED_MROPE = ("qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe")
"""M-RoPE model types whose language model reads more than the merged embeddings (visual features injected into
its layers, Qwen3-VL's deepstack) or differs from Qwen2's: not supported."""
_BIDIRECTIONAL = ("gemma3", "paligemma")
"""Model types whose image tokens attend to each other both ways at prefill (the engine's prefill is causal)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Larger images are refused before they are decoded (a few-KB PNG can decode to hundreds of MB)."""


def is_vision_language(model_or_config: Any) -> bool:
    """Whether a model (or its config) reads images: its config has a vision part and a text config."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None


def check_vlm(vlm: torch.nn.Module) -> None:
    """A one-line ValueError when ``vlm`` cannot run as a target here."""
    kind = getattr(vlm.config, "model_type", "?")
    if kind in _UNSUPPORTED_MROPE:
        raise ValueError(f"vision-language model type {kind!r} is not supported: its language model reads more "
                         "than the prompt's embeddings and M-RoPE positions (supported: Qwen2-VL, Qwen2.5-VL)")
    if kind in _BIDIRECTIONAL:
        raise ValueError(f"vision-language model type {kind!r} is not supported: its image tokens attend to each "
                         "other both ways at prefill, the engine's prefill is causal")
    if vlm.get_output_embeddings() is None or not hasattr(vlm, "get_decoder"):
        raise ValueError(f"vision-language model {type(vlm).__name__} has no LM head or decoder to run as a target")
    image_token_ids(vlm)


def image_token_ids(vlm: torch.nn.Module) -> list[int]:
    """The id(s) of the placeholder token(s) a prompt carries where an image's features go."""
    config = vlm.config
    ids = [getattr(config, name, None) for name in ("image_token_id", "image_token_index")]
    ids = sorted({int(i) for i in ids if i is not None})
    if not ids:
        raise ValueError(f"vision-language model {type(vlm).__name__} names no image token in its config")
    return ids


def text_view(vlm: torch.nn.Module) -> torch.nn.Module:
    """``vlm``'s language model and LM head as a causal LM of its text config (the same modules, nothing copied):
    what the engine runs as the target after the prompt."""
    from transformers import AutoModelForCausalLM

    check_vlm(vlm)
    config = vlm.config.text_config
    if vlm.config.model_type in _MROPE:  # a Qwen2 but for M-RoPE, which after the prompt is ordinary RoPE
        from transformers import Qwen2Config

        skip = ("model_type", "architectures", "transformers_version", "base_config_key")
        fields = {k: v for k, v in config.to_dict().items() if k not in skip}
        if isinstance(fields.get("rope_parameters"), dict):  # the M-RoPE split means nothing to ordinary RoPE
            fields["rope_parameters"] = {k: v for k, v in fields["rope_parameters"].items() if k != "mrope_section"}
        config = Qwen2Config(**fields)
    with torch.device("meta"):
        view = AutoModelForCausalLM.from_config(config)
    decoder = vlm.get_decoder()
    view.model = decoder  # e.g. LlamaModel: the base model of a LlamaForCausalLM
    view.lm_head = vlm.get_output_embeddings()
    for name, p in view.named_parameters():
        if p.is_meta:
            raise ValueError(f"vision-language model {type(vlm).__name__}: its text part has no {name}")
    view.generation_config = vlm.generation_config
    view.eval()
    view.__dict__["vlm"] = vlm  # not a submodule: no second copy in state_dict, parameters() lists the text part
    return view


class _Stop(Exception):
    """Raised by the pre-hook once the language model's input embeddings are taken."""


@torch.inference_mode()
def prompt_embeds(vlm: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor | PromptEmbeds:
    """The prompt's input embeddings ``[1, T, H]`` as ``vlm``'s forward builds them for its language model, from
    a processor's ``inputs`` (``input_ids [1, T]``, ``pixel_values`` and whatever else the model takes); for an
    M-RoPE model (Qwen2-VL) a :class:`~speculant.core.types.PromptEmbeds` with the positions ``[3, 1, T]`` the
    model gave them."""
    decoder = vlm.get_decoder()
    taken: dict[str, torch.Tensor] = {}
    caller = threading.get_ident()

    def hook(module, args, kwargs):
        if threading.get_ident() != caller:  # the decoder is the target's too: another thread decoding with it
            return None
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise ValueError(f"{type(vlm).__name__} calls its language model without inputs_embeds")
        taken["embeds"], taken["positions"] = embeds, kwargs.get("position_ids")
        raise _Stop

    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        vlm.model(**inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if "embeds" not in taken:
        raise ValueError(f"{type(vlm).__name__}'s forward never called its language model")
    if vlm.config.model_type not in _MROPE:
        return taken["embeds"]
    positions = taken["positions"]
    if positions is None or positions.dim() != 3:
        raise ValueError(f"{type(vlm).__name__} gave its language model no M-RoPE positions (its processor's "
                         "mm_token_type_ids and image_grid_thw are needed)")
    return PromptEmbeds(taken["embeds"], positions[-3:])  # [3, 1, T] (a 4th leading row: text positions, dropped)


def vision_parts(target: torch.nn.Module) -> tuple[torch.nn.Module, Any] | None:
    """``(vision-language model, its processor or None)`` behind a :func:`text_view` target; None for a text
    model."""
    vlm = target.__dict__.get("vlm")
    return None if vlm is None else (vlm, target.__dict__.get("processor"))


def load_image(image: Any):
    """A PIL image (RGB) from a path, raw bytes (an encoded file) or a PIL image; a one-line ValueError else."""
    import io
    from pathlib import Path

    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError("images need Pillow: pip install 'speculant[vision]'") from None

    def checked(im):
        if im.size[0] * im.size[1] > MAX_IMAGE_PIXELS:
            raise ValueError(f"the image is {im.size[0]}x{im.size[1]} pixels: more than {MAX_IMAGE_PIXELS:,}")
        return im.convert("RGB")

    if isinstance(image, Image.Image):
        return checked(image)
    what = "the image data" if isinstance(image, (bytes, bytearray)) else f"image {str(image)!r}"
    try:
        if isinstance(image, (bytes, bytearray)):
            with Image.open(io.BytesIO(image)) as im:  # the header only, until checked() decodes
                return checked(im)
        if isinstance(image, (str, Path)):
            with Image.open(Path(image).expanduser()) as im:
                return checked(im)
    except FileNotFoundError:
        raise ValueError(f"image file {str(image)!r} does not exist") from None
    except Image.DecompressionBombError:
        raise ValueError(f"{what} is too large to decode (a decompression bomb?)") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{what} is not an image PIL can read ({type(e).__name__})") from None
    raise ValueError(f"an image is a path, encoded bytes or a PIL image, got {type(image).__name__}")


def image_inputs(processor: Any, messages: list[dict], images: list) -> dict[str, torch.Tensor]:
    """The processor's inputs (``input_ids [1, T]``, ``pixel_values``, ...) for chat ``messages`` whose contents
    are text or lists of parts ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` (one per image, in order),
    with the assistant's turn opened."""
    if processor is None:
        raise ValueError("image prompts need the target's processor (load the model from its directory)")
    wanted = sum(1 for m in messages if isinstance(m.get("content"), list)
                 for part in m["content"] if part.get("type") == "image")
    if wanted != len(images):
        raise ValueError(f"the messages hold {wanted} image part(s) for {len(images)} image(s)")
    pictures = [load_image(i) for i in images]
    # every content as parts: real templates (LLaVA's, SmolVLM's) loop over parts and drop a plain string
    messages = [m if not isinstance(m.get("content"), str) else
                {**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=pictures or None, return_tensors="pt")
    return dict(inputs)


def user_messages(prompt: str, n_images: int, system: str | None = None) -> list[dict]:
    """A chat of one user turn: ``n_images`` image parts, then the text ``prompt`` (and a system message)."""
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": prompt}]
    head = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    return [*head, {"role": "user", "content": content}]
