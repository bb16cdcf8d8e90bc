"""One way in: a loaded target, its draft and a method, building a fresh drafter per generation.

>>> session = speculant.load("smollm2-135m-instruct")          # its shipped drafter and measured method
>>> gen = session.generate("Name three prime numbers.", max_new_tokens=64)
>>> session.tokenizer.decode(gen.token_ids), gen.stats.acceptance_length

:func:`load` resolves (:func:`speculant.plan.resolve`: the defaults and rules every front-end shares, nothing
loaded) and then loads (:func:`load_plan`); a server resolves before it listens and loads afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .core.modes import normal_tensors
from .core.prefix_cache import PrefixCache
from .plan import Model, ParsedMethod, SessionPlan, generate_defaults, is_attached_draft, resolve

if TYPE_CHECKING:
    from .core.types import Generation
    from .drafters.base import Drafter

__all__ = ["Session", "load", "load_plan"]

log = logging.getLogger(__name__)


def load(
    target: Model = "default-target",
    draft: Model | None = None,
    method: str | None = None,
    **kwargs: Any,
) -> Session:
    """Resolve (:func:`speculant.plan.resolve`, same arguments) and load: the one way to get a target, its draft
    and a method ready to generate. Raises a one-line ValueError for bad input before any model is loaded."""
    return load_plan(resolve(target, draft, method, **kwargs))


@normal_tensors
def load_plan(plan: SessionPlan) -> Session:
    """Load the models of a resolved plan (:func:`speculant.plan.resolve`): the target (and its tokenizer) and the
    draft, on the device; build one drafter now, so that a method that cannot be built fails here rather than at
    the first generation."""
    from .core.checks import resolve_device, warn_once
    from .core.quant import quantization_of
    from .core.threads import apply_threads
    from .models.attached import is_attached
    from .models.loading import draft_context, load_draft, load_model_dir, quantize_loaded
    from .models.sources import gguf_backing

    apply_threads(plan.threads)
    tokenizer = plan.tokenizer
    attached = (plan.draft is not None and not isinstance(plan.draft, torch.nn.Module)
                and is_attached(Path(plan.draft)))
    if isinstance(plan.target, torch.nn.Module):
        target = plan.target.eval()  # a loaded module stays where it is
    else:
        # in its kind as it loads (a GGUF model's matrices then come from its cache, and no float copy of them
        # is ever made), except beside an attached drafter: quantized below, after the drafter loads
        target, tok = load_model_dir(plan.target, plan.dtype, "none" if attached else plan.quantization)
        tokenizer = tokenizer if tokenizer is not None else tok
    draft, context = None, {}
    if isinstance(plan.draft, torch.nn.Module):
        draft = plan.draft.eval()
    elif plan.draft is not None:
        # an attached drafter: next to the float target (it checks the float embedding it was made for), in the
        # target's kind (it shares the head); another draft model: in its own kind as it loads
        draft = load_draft(plan.draft, target, plan.dtype,
                           quantization_of(target) if attached else plan.draft_quantization)
        if tokenizer is not None or attached:
            context = draft_context(plan.draft, tokenizer)
    # then the kinds: the target first (an attached drafter's shared head is then the target's matrix, kept)
    for model, name, kind in ((target, plan.target, plan.quantization),
                              (draft, plan.draft, plan.draft_quantization)):
        if isinstance(name, str) and kind != quantization_of(model):
            quantize_loaded(model, kind, gguf_backing(name))
    if isinstance(plan.target, str):
        target.to(plan.device if plan.device is not None else resolve_device(None))
        vlm = target.__dict__.get("vlm")  # a vision-language target: its vision tower goes along
        if vlm is not None:
            vlm.to(target.device)
    if isinstance(plan.draft, str):
        draft.to(target.device)
    session = Session(plan=plan, target=target, tokenizer=tokenizer, draft=draft, context=context)
    session.drafter()  # fails now (e.g. a tree the draft cannot build) rather than per generation
    if plan.unused_draft is not None:  # one rule for every method without a draft model, ar included
        warn_once(log, f"method {plan.method.name!r} drafts without a model: --draft is not used")
    log.info("loaded %s%s (method %s)", plan.target_name,
             f" with draft {plan.draft_name}" if draft is not None else "", plan.method.spec)
    return session


@dataclass(eq=False)
class Session:
    """A loaded target (``target``, ``tokenizer``), its draft (``draft``, None when the method drafts without a
    model) and the parsed method and KV policy of :attr:`plan`. :meth:`drafter` builds a fresh drafter (drafters
    hold per-generation state); :meth:`generate` runs one generation with it."""

    plan: SessionPlan
    target: torch.nn.Module
    tokenizer: Any = None
    draft: torch.nn.Module | None = None
    context: dict = field(default_factory=dict)  # drafter-building context, e.g. {"tokenizers_match": True}
    _parsed: dict = field(default_factory=dict, repr=False)
    prefix_cache: PrefixCache | None = field(default=None, repr=False)
    """The keys/values of prompt prefixes this session's generations computed (target and draft model), which
    later ones reuse (:mod:`speculant.core.prefix_cache`); made from :attr:`SessionPlan.prefix_cache_mb` (None when
    that is 0). Shared by every generation of the session, also from several threads."""

    def __post_init__(self) -> None:
        if self.prefix_cache is not None or self.plan.prefix_cache_mb <= 0:
            return
        if self.plan.kv_policy is not None:  # every generation keeps its own evicting cache
            log.info("prompt prefixes are not reused: a KV eviction policy (%s) keeps its own cache", self.plan.kv_spec)
            return
        self.prefix_cache = PrefixCache(int(self.plan.prefix_cache_mb * (1 << 20)))

    @property
    def method(self) -> ParsedMethod:
        """The session's method, parsed once."""
        return self.plan.method

    def parse(self, spec: str | None = None) -> ParsedMethod:
        """``spec`` parsed (once per spec and session); None: the session's method."""
        if spec is None or spec == self.plan.method.spec:
            return self.plan.method
        if spec not in self._parsed:
            self._parsed[spec] = ParsedMethod.parse(spec)
        return self._parsed[spec]

    def drafter(self, spec: str | ParsedMethod | None = None, draft: torch.nn.Module | None = None,
                context: Mapping[str, Any] | None = None) -> Drafter | None:
        """A fresh drafter of ``spec`` (None: the session's method) over the session's draft (or ``draft`` with
        its ``context``); None for plain decoding (``ar``)."""
        from .drafters.registry import build_drafter

        method = spec if isinstance(spec, ParsedMethod) else self.parse(spec)
        model = draft if draft is not None else self.draft
        ctx = dict(context) if context is not None else self.context
        return build_drafter((method.name, dict(method.options)), model, **ctx)

    def with_draft(self, draft: Model) -> Session:
        """A session over the same loaded target with another draft (loaded like the first; e.g. a benchmark
        that compares two drafters in one run)."""
        kind = None if is_attached_draft(draft) else self.plan.draft_quantization  # attached: the target's kind
        plan = resolve(self.target, draft, self.plan.method.spec, tokenizer=self.tokenizer, dtype=self.plan.dtype,
                       quantization=self.plan.quantization, draft_quantization=kind,
                       threads=None,  # threads: set by the first load
                       kv_policy=self.plan.kv_policy, kv_budget=self.plan.kv_budget, kv_block=self.plan.kv_block,
                       draft_for=("another draft",), prefix_cache_mb=self.plan.prefix_cache_mb)
        plan = dataclasses.replace(plan, target_name=self.plan.target_name, kv_spec=self.plan.kv_spec)
        return load_plan(plan)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int] | Any],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | list[int | None] | None = None,
        raw: bool = False,
        system: str | None = None,
        logprobs: int | None = None,
        speculation: str = "on",
        response_format: dict | None = None,
    ) -> list[Generation]:
        """Several prompts decoded together with fresh drafters of the session's method, one verification
        forward per step for all of them (:func:`speculant.core.engine.generate_batch`); each prompt as in
        :meth:`generate` (text through the chat template unless ``raw``, or token ids; it stops at its own end of
        turn). ``seed``: one for all or one per prompt; ``speculation``: ``on``, ``off`` or ``auto``
        (:mod:`speculant.core.speculation`); ``response_format``: one output format for every prompt, as
        :meth:`generate`."""
        from .api import constraint_for
        from .core import engine

        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        encoded = [self.encode(p, raw=raw, system=system) for p in prompts]
        stops = {tuple(s) if s is not None else None for _, s in encoded}
        if len(stops) > 1:
            raise ValueError("prompts of one batch must stop alike: all text (chat) or all token ids")
        d = generate_defaults()
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        sampling = {k: (d[k] if v is None else v) for k, v in sampling.items()}
        options = self.generate_options()
        constraints = [constraint_for(response_format, self.tokenizer) for _ in encoded]
        return engine.generate_batch(self.target, [ids for ids, _ in encoded], [self.drafter() for _ in encoded],
                                     seed=seed, eos_token_id=encoded[0][1], logprobs=logprobs,
                                     speculation=speculation, prefix_cache=self.prefix_cache,
                                     constraints=constraints, **sampling, **options)

    def encode(self, prompt: str | Sequence[int] | Any, raw: bool = False,
               system: str | None = None) -> tuple[list[int], list[int] | None]:
        """``(input ids, stop ids)`` of a prompt: text through the tokenizer's chat template when it has one
        (stopping at the end of the assistant's turn) unless ``raw``, else plain text with the tokenizer's
        defaults (stop ids None: the model's EOS); token ids as given, in any form
        :func:`speculant.core.checks.as_id_list` takes (a list, a tensor or numpy array, a ``BatchEncoding``)."""
        from .models.chat import chat_ids, has_chat_template, stop_ids

        from .core.checks import as_id_list

        if not isinstance(prompt, str):
            if system is not None:
                raise ValueError("system needs a text prompt (token ids are used as given)")
            return as_id_list(prompt), None
        if not prompt:
            raise ValueError("the prompt is empty: give some text")
        if self.tokenizer is None:
            raise ValueError("a text prompt needs the target's tokenizer: pass tokenizer= (or token ids)")
        if raw and system is not None:
            raise ValueError("--system needs the chat template: drop --raw")
        if raw or not has_chat_template(self.tokenizer):
            if system is not None:
                raise ValueError("--system: the target's tokenizer has no chat template")
            return self.tokenizer(prompt)["input_ids"], None
        return chat_ids(self.tokenizer, prompt, system=system), stop_ids(self.tokenizer, self.target)

    def generate_options(self, method: ParsedMethod | None = None) -> dict[str, Any]:
        """The keyword arguments of ``generate`` that the session fixes: KV eviction and the engine options of
        ``method`` (None: the session's)."""
        p = self.plan
        kv: dict[str, Any] = {}
        if p.kv_policy is not None:
            kv = {"kv_policy": p.kv_policy, "kv_budget": p.kv_budget,
                  **({} if p.kv_block is None else {"kv_block": p.kv_block})}
        return {**kv, **(method or p.method).engine}

    def generate(
        self,
        prompt: str | Sequence[int] | Any,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        stream: Callable[..., None] | None = None,
        raw: bool = False,
        system: str | None = None,
        method: str | ParsedMethod | None = None,
        drafter: Drafter | None | str = "new",
        logprobs: int | None = None,
        images: Sequence[Any] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        response_format: dict | None = None,
    ) -> Generation:
        """One generation with a fresh drafter of the session's method.

        Args:
            prompt: text (the chat template is applied when the tokenizer has one, unless ``raw``; ``system``
                is then a system message) or token ids ``[T]`` (used as given; a list, a tensor or numpy
                array, or a tokenizer's ``BatchEncoding``, as :func:`speculant.generate` takes them).
            max_new_tokens, temperature, top_k, top_p, seed, stream, logprobs: as :func:`speculant.generate`
                (None: its defaults).
            eos_token_id: stop token(s); None: the end of the assistant's turn for a chat, else the model's EOS.
            method: another method spec to run on the session's models (parsed once per session; its engine
                options apply); None: the session's method.
            drafter: ``"new"`` (default): a fresh drafter of the method; or a drafter built by the caller (e.g.
                from :meth:`drafter`, wrapped), or None for plain decoding.
            images: for a vision-language target, images (paths, encoded bytes or PIL images) the text prompt is
                about: they go before the text in the user's turn; the target reads them, the drafter sees the
                text only (:class:`speculant.drafters.text_only.TextOnlyDrafter`).
            prompt_embeds: token ids' prompt embeddings ``[1, T, H]`` already made by :meth:`encode_images` (a
                benchmark encodes each image prompt once); the drafter then sees the text only too.
            response_format: constrain the output to a format (:mod:`speculant.structured`; compiled with the
                session's tokenizer and cached): ``{"type": "json_object"}``, ``{"type": "json_schema",
                "json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "regex", "pattern": ...}``,
                ``{"type": "grammar", "grammar": <Lark>}`` or ``{"type": "text"}``; exact under speculation.

        Returns:
            the engine's :class:`speculant.core.types.Generation` (``token_ids``: the new tokens only).
        """
        from .api import constraint_for
        from .core import engine
        from .core.checks import check_stream

        embeds = prompt_embeds
        if images and prompt_embeds is not None:
            raise ValueError("give images or prompt_embeds, not both")
        if images:
            ids, stops, embeds = self.encode_images(prompt, images, system=system, raw=raw)
        else:
            ids, stops = self.encode(prompt, raw=raw, system=system)
        check_stream(stream)
        constraint = constraint_for(response_format, self.tokenizer)
        d = generate_defaults()
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                    "seed": seed}
        sampling = {k: (d[k] if v is None else v) for k, v in sampling.items()}
        parsed = method if isinstance(method, ParsedMethod) else self.parse(method)
        if isinstance(drafter, str):
            if drafter != "new":
                raise ValueError(f"drafter must be 'new', a Drafter or None, got {drafter!r}")
            drafter = self.drafter(parsed)
        if embeds is not None and drafter is not None:
            drafter = self.text_only(drafter)
        return engine.generate(self.target, ids, drafter=drafter, eos_token_id=eos_token_id if eos_token_id
                               is not None else stops, stream=stream, logprobs=logprobs, prompt_embeds=embeds,
                               prefix_cache=self.prefix_cache, constraint=constraint, **sampling,
                               **self.generate_options(parsed))

    def infill(self, prefix: str, suffix: str, extra: Sequence[Any] | None = None, *,
               repo_name: str | None = None, filename: str | None = None, **kwargs: Any) -> Generation:
        """Fill in the middle: what goes between ``prefix`` (the text before the cursor) and ``suffix`` (the text
        after it), written by the target in its own FIM tokens (:mod:`speculant.models.fim`), drafted by the
        session's method as any generation.

        Args:
            prefix, suffix: the text around the cursor.
            extra: other files of the repository as context: ``{"filename", "text"}`` mappings or
                ``(filename, text)`` pairs (:func:`speculant.models.fim.repo_files`); ``repo_name`` and
                ``filename`` (the file being edited) name them in the prompt (None: llama.cpp's placeholders).
            kwargs: as :meth:`generate` (``max_new_tokens``, ``temperature``, ``seed``, ``stream``, ``method``,
                ``drafter`` ...); ``eos_token_id`` None (default): the family's FIM end tokens and the model's
                EOS (:func:`speculant.models.fim.fim_stop_ids`).

        Returns:
            :meth:`generate`'s :class:`speculant.core.types.Generation` (``token_ids``: the middle, ending with the
            stop token when one ended it).

        Raises:
            ValueError: one line: a target whose tokenizer has no FIM tokens (naming them), a bad argument.
        """
        from .models.fim import FILENAME, REPO_NAME, fim_ids, fim_stop_ids

        for name in ("raw", "system", "images", "prompt_embeds"):
            if kwargs.get(name):
                raise ValueError(f"infill takes no {name}: the prompt is built in the model's FIM tokens")
        if self.tokenizer is None:
            raise ValueError("infill needs the target's tokenizer: pass tokenizer=")
        ids = fim_ids(self.tokenizer, prefix, suffix, extra, repo_name=REPO_NAME if repo_name is None else repo_name,
                      filename=FILENAME if filename is None else filename)
        if kwargs.get("eos_token_id") is None:
            kwargs["eos_token_id"] = fim_stop_ids(self.tokenizer, self.target)
        return self.generate(ids, **kwargs)

    def encode_images(self, prompt: str | list[dict], images: Sequence[Any], system: str | None = None,
                      raw: bool = False) -> tuple[list[int], list[int] | None, torch.Tensor]:
        """``(input ids, stop ids, prompt embeddings [1, T, H])`` of a text ``prompt`` (or chat messages with image
        parts) about ``images``, for a vision-language target: the processor's chat template and image tokens,
        the model's own image features in the embeddings."""
        from .models.chat import stop_ids
        from .models.vlm import image_inputs, prompt_embeds, user_messages, vision_parts

        parts = vision_parts(self.target)
        if parts is None:
            raise ValueError("images need a vision-language target; this one reads text only")
        if raw:
            raise ValueError("images go through the chat template: drop --raw")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text")
            messages = user_messages(prompt, len(images), system)
        elif not (isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt)):
            raise ValueError("images need a text prompt or chat messages, not token ids (the processor places the "
                             "image tokens)")
        else:
            if system is not None:
                raise ValueError("system needs a text prompt (put a system message in the messages)")
            messages = list(prompt)
        vlm, processor = parts
        inputs = image_inputs(processor, messages, list(images))
        ids = inputs["input_ids"][0].tolist()
        embeds = prompt_embeds(vlm, {k: v.to(vlm.device) if hasattr(v, "to") else v for k, v in inputs.items()})
        return ids, stop_ids(self.tokenizer, self.target), embeds

    def text_only(self, drafter: Drafter) -> Drafter:
        """``drafter`` drafting from the text of an image prompt only (the target's image tokens removed)."""
        from .drafters.text_only import TextOnlyDrafter
        from .models.vlm import image_token_ids, vision_parts

        parts = vision_parts(self.target)
        if parts is None or isinstance(drafter, TextOnlyDrafter):
            return drafter
        return TextOnlyDrafter(drafter, image_token_ids(parts[0]))
