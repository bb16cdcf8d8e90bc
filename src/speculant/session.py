"""One way in: resolve target, draft and method once, load the models once, build a fresh drafter per generation.

>>> session = speculant.load("smollm2-135m-instruct")          # its shipped drafter and measured method
>>> gen = session.generate("Name three prime numbers.", max_new_tokens=64)
>>> session.tokenizer.decode(gen.token_ids), gen.stats.acceptance_length

Every front-end builds through here (``speculant generate``, ``serve``, ``bench``, ``kv-eval`` and the demo), so
they resolve the same defaults and agree on the same rules:

* **method** None: the method measured fastest for a packaged target with the drafter speculant ships for it
  (:func:`speculant.models.loading.default_method_for`), else :data:`speculant.drafters.registry.DEFAULT_METHOD`.
* **draft** None, for a method that drafts with a model: the drafter speculant ships for the target
  (:func:`speculant.models.loading.default_draft_for`). When there is none, :func:`resolve` raises a one-line
  ValueError naming the fix (pass a draft, or choose a method without one such as ``ar``): no front-end falls
  back to plain decoding silently. A draft given to a method that drafts without a model (``ar``, ``lookup``,
  ``mask-probe`` ...) is not loaded, and loading warns once that it is not used.
* **dtype** None: float32 (the only dtype in which greedy speculative output is guaranteed token-identical to a
  separately run plain decode); **device** None: the best available (:func:`speculant.core.checks.resolve_device`).
* **quantization** None: a packaged target's own format
  (:attr:`speculant.models.sources.PackagedModel.default_quantization`: ``file`` for Qwen2.5-Coder-1.5B: its GGUF
  file's 4-bit tensors in q4, its 6-bit ones as they are (q6), within 0.99 top-1 agreement of the float32 file), else
  ``"none"`` (:data:`speculant.core.quant.QUANTIZATIONS`); the models loaded by name are quantized as they load
  (:func:`speculant.models.loading.load_model_dir`: a GGUF file's own codes are kept where the kind holds them,
  :func:`speculant.models.loading.quantize_loaded`). **draft_quantization** None: the target's kind, in its
  fastest form (:data:`speculant.core.quant.DRAFT_KIND`: q4 under a ``file`` target), because the draft only proposes
  (its numerics never change what is emitted) and a quantized target usually wants a draft as cheap as itself;
  give ``"none"`` to keep a float draft. A loaded module is never quantized here: quantization None takes it as it
  is, any other kind must be the one it already has (:func:`speculant.core.quant.quantization_of`).

Two phases, because a server checks its settings before it listens and loads afterwards: :func:`resolve` checks
everything cheap and resolves names to model directories (:class:`SessionPlan`, nothing loaded), and
:meth:`SessionPlan.load` loads the models (:class:`Session`). :func:`load` does both.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .core.modes import normal_tensors

if TYPE_CHECKING:
    from .core.types import Generation
    from .drafters.base import Drafter
    from .kv.policies import ScorePolicy

__all__ = ["Session", "SessionPlan", "default_method", "load", "resolve"]

log = logging.getLogger(__name__)

Model = str | Path | torch.nn.Module
"""A model as the session takes it: a name or directory (anything :func:`speculant.models.loading.resolve_model`
takes) or a loaded module."""


@functools.cache
def generate_defaults() -> dict[str, Any]:
    """``speculant.core.engine.generate``'s defaults (max_new_tokens, temperature, top_k, top_p, seed, kv_block):
    their one definition, read by the session and the command-line help."""
    from .core.engine import generate

    return {name: p.default for name, p in inspect.signature(generate).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _describe(model: Model | None) -> str | None:
    if model is None:
        return None
    return f"<in-process {type(model).__name__}>" if isinstance(model, torch.nn.Module) else str(model)


@dataclass(frozen=True)
class ParsedMethod:
    """A method spec parsed once: ``name``, the drafter's ``options`` and the ``engine`` options (``forward=``,
    passed to ``generate``) split apart (:func:`speculant.drafters.registry.engine_options`)."""

    spec: str
    name: str
    options: Mapping[str, Any]
    engine: Mapping[str, Any]
    needs_draft: bool

    @classmethod
    def parse(cls, spec: str) -> ParsedMethod:
        """Parse ``NAME[:key=value...]``; a one-line ValueError for anything wrong (unknown method or option)."""
        from .drafters.registry import engine_options, get_method, parse_method

        name, options = parse_method(spec)
        drafter_options, engine = engine_options(options)
        parsed = cls(spec, name, drafter_options, engine, get_method(name).needs_draft)
        parsed._check_values()
        return parsed

    def _check_values(self) -> None:
        """Raise the drafter's own one-line ValueError for an option value it refuses (``chain:k=0``), before any
        model is loaded: the registry converts types only, the drafter classes check ranges, so the drafter is
        built once over a stand-in (an empty module for methods that need a draft, else none). Drafter
        constructors only store and check their options (the models are read at ``begin``), so this is cheap;
        anything but a ValueError from the stand-in is left to the real build at load."""
        from .drafters.registry import NeedsContext, build_drafter

        stand_in = torch.nn.Module() if self.needs_draft else None
        try:
            build_drafter((self.name, dict(self.options)), stand_in)
        except NeedsContext:  # what the loaded models provide (e.g. both tokenizers): checked at load
            pass
        except ValueError as exc:
            raise ValueError(f"method {self.spec!r}: {exc}") from None
        except Exception:  # noqa: BLE001: the stand-in is no model; the real build reports real problems
            log.debug("checking method %s on a stand-in", self.spec, exc_info=True)

    def with_options(self, **options: Any) -> ParsedMethod:
        """This method with ``options`` set (e.g. ``k=`` from ``generate --k``), checked like a spec's."""
        merged = {**self.options, **self.engine, **options}
        spec = self.name + "".join(
            f":{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in merged.items())
        return ParsedMethod.parse(spec)


@dataclass(frozen=True)
class SessionPlan:
    """What a session loads, checked and resolved, before anything is loaded (:func:`resolve` makes it).

    ``target``: a checked model directory (str) or the module as given; ``draft``: the same, or None when nothing
    drafts with a model; ``target_name``/``draft_name``: the same as text (for reports); ``method``: the parsed
    method; ``kv_policy``: the parsed policy (None: no eviction), ``kv_spec`` its spec as given."""

    target: str | torch.nn.Module
    method: ParsedMethod
    draft: str | torch.nn.Module | None = None
    tokenizer: Any = None
    dtype: torch.dtype | str = torch.float32
    quantization: str = "none"
    draft_quantization: str = "none"
    device: torch.device | None = None
    threads: int | str | None = None
    kv_policy: ScorePolicy | None = None
    kv_spec: str | None = None
    kv_budget: int | None = None
    kv_block: int | None = None
    target_name: str = ""
    draft_name: str | None = None
    unused_draft: str | None = None  # a draft given to a method that drafts without one (not loaded)

    @normal_tensors
    def load(self) -> Session:
        """Load the target (and its tokenizer) and the draft, on the device; build one drafter now, so that a
        method that cannot be built fails here rather than at the first generation."""
        from .core.checks import resolve_device, warn_once
        from .core.quant import quantization_of
        from .core.threads import apply_threads
        from .models.loading import draft_context, load_draft, load_model_dir, quantize_loaded
        from .models.sources import gguf_backing

        apply_threads(self.threads)
        tokenizer = self.tokenizer
        attached = self.draft is not None and not isinstance(self.draft, torch.nn.Module) and _attached(self.draft)
        if isinstance(self.target, torch.nn.Module):
            target = self.target.eval()  # a loaded module stays where it is
        else:
            # in its kind as it loads (a GGUF model's matrices then come from its cache, and no float copy of them
            # is ever made), except beside an attached drafter: quantized below, after the drafter loads
            target, tok = load_model_dir(self.target, self.dtype, "none" if attached else self.quantization)
            tokenizer = tokenizer if tokenizer is not None else tok
        draft, context = None, {}
        if isinstance(self.draft, torch.nn.Module):
            draft = self.draft.eval()
        elif self.draft is not None:
            # an attached drafter: next to the float target (it checks the float embedding it was made for), in the
            # target's kind (it shares the head); another draft model: in its own kind as it loads
            draft = load_draft(self.draft, target, self.dtype,
                               quantization_of(target) if attached else self.draft_quantization)
            if tokenizer is not None or attached:
                context = draft_context(self.draft, tokenizer)
        # then the kinds: the target first (an attached drafter's shared head is then the target's matrix, kept)
        for model, name, kind in ((target, self.target, self.quantization),
                                  (draft, self.draft, self.draft_quantization)):
            if isinstance(name, str) and kind != quantization_of(model):
                quantize_loaded(model, kind, gguf_backing(name))
        if isinstance(self.target, str):
            target.to(self.device if self.device is not None else resolve_device(None))
            vlm = target.__dict__.get("vlm")  # a vision-language target: its vision tower goes along
            if vlm is not None:
                vlm.to(target.device)
        if isinstance(self.draft, str):
            draft.to(target.device)
        session = Session(plan=self, target=target, tokenizer=tokenizer, draft=draft, context=context)
        session.drafter()  # fails now (e.g. a tree the draft cannot build) rather than per generation
        if self.unused_draft is not None:  # one rule for every method without a draft model, ar included
            warn_once(log, f"method {self.method.name!r} drafts without a model: --draft is not used")
        log.info("loaded %s%s (method %s)", self.target_name,
                 f" with draft {self.draft_name}" if draft is not None else "", self.method.spec)
        return session


def _attached_name(draft: Model | None) -> bool:
    """Whether ``draft`` names (by path or name) an attached drafter directory."""
    if not isinstance(draft, (str, Path)):
        return False
    from .models.loading import resolve_model

    try:
        return _attached(str(resolve_model(draft)))
    except ValueError:
        return False


def _attached(path: str) -> bool:
    from .models.attached import is_attached

    return is_attached(Path(path))


def default_method(target: Model, draft: Model | None = None) -> tuple[str, str]:
    """The method a session runs when none is given, and where it comes from: ``(spec, "packaged")`` for a
    packaged target (by name) with the drafter speculant ships for it
    (:func:`speculant.models.loading.default_method_for`), else ``(DEFAULT_METHOD, "registry")``
    (:data:`speculant.drafters.registry.DEFAULT_METHOD`)."""
    from .drafters.registry import DEFAULT_METHOD
    from .models.loading import default_method_for

    if isinstance(target, (str, Path)) and not isinstance(draft, torch.nn.Module):
        spec = default_method_for(target, draft)
        if spec:
            return spec, "packaged"
    return DEFAULT_METHOD, "registry"


def resolve(
    target: Model = "default-target",
    draft: Model | None = None,
    method: str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    quantization: str | None = None,
    draft_quantization: str | None = None,
    device: str | torch.device | None = None,
    threads: int | str | None = "auto",
    kv_policy: str | ScorePolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int | None = None,
    tokenizer: Any = None,
    draft_for: Sequence[str] = (),
) -> SessionPlan:
    """Resolve and check what a session loads, loading nothing: packaged defaults, the method spec, the KV
    policy, the device, model names to checked directories (a ``.gguf`` target is converted once into a cache).

    Args:
        target, draft: a model name or directory (a packaged or bundled name, a directory, a ``.gguf`` file, a
            Hub id in the local cache), or a loaded module (kept where it is; pass its ``tokenizer`` for text).
        method: a registry spec ``NAME[:key=value...]``; None: see the module docstring.
        dtype: load dtype of the models loaded by name (None: float32); device: where the models loaded by name
            go (None: the best available; a loaded target stays where it is, a draft follows the target);
            threads: ``torch.set_num_threads`` when loading: an int, ``"auto"`` (the cores free at the first load,
            see :mod:`speculant.core.threads`) or None (left to torch).
        quantization, draft_quantization: the weight quantization of the target and of the draft (one of
            :data:`speculant.core.quant.QUANTIZATIONS`; see the module docstring for None).
        kv_policy, kv_budget, kv_block: KV-cache eviction of the target (a spec such as ``"caote:h2o"`` or a
            policy object; policy and budget go together; ``kv_block`` None: ``generate``'s default).
        draft_for: other users of the draft (e.g. ``["hf-assisted"]`` in a benchmark): the draft is then
            resolved and loaded even if ``method`` drafts without a model.

    Raises:
        ValueError: one line, for a bad method, KV option, dtype, quantization, device or model, and for a method (or a
            ``draft_for`` user) that needs a draft model when none is given and speculant ships none for the
            target.
    """
    from .core.checks import resolve_device
    from .core.threads import check_threads
    from .models.loading import DTYPES, check_model_dir, check_quantization, default_draft_for, resolve_model

    by_name = isinstance(target, (str, Path))
    if isinstance(target, torch.nn.Module):
        from .models.vlm import is_vision_language, text_view

        if is_vision_language(target):  # its text part is the target; the whole model reads image prompts
            target = text_view(target)
            if tokenizer is not None and hasattr(tokenizer, "image_processor"):  # a processor
                target.__dict__["processor"] = tokenizer
                tokenizer = tokenizer.tokenizer
    if method is None:
        method, _ = default_method(target, draft)
        log.info("method %s (pass a method to choose another)", method)
    parsed = ParsedMethod.parse(method)
    policy, kv_spec = _resolve_kv(kv_policy, kv_budget, kv_block)
    dtype = torch.float32 if dtype is None else dtype
    if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(DTYPES)}")
    check_threads(threads)
    quantization, draft_quantization = _resolve_quantization(target, draft, quantization, draft_quantization)
    dev = resolve_device(device) if device is not None or by_name else None  # checked before anything loads
    if not by_name:
        dev = None  # a loaded target stays where it is

    target_dir = target if isinstance(target, torch.nn.Module) else str(check_model_dir(resolve_model(target)))
    users = ([f"method {parsed.name!r}"] if parsed.needs_draft else []) + list(draft_for)
    if users and draft is None and by_name:
        draft = default_draft_for(target, parsed.name)
        if draft is not None:
            log.info("draft: %s (the drafter speculant ships for %s)", draft, target)
    if users and draft is None:
        raise ValueError(
            f"{', '.join(users)} need{'s' if len(users) == 1 else ''} a draft model and speculant ships none for "
            f"{_describe(target)!r}: pass one (--draft MODEL), or choose a method without one (--method ar: plain "
            "decoding)")

    draft_dir = None
    if users:
        draft_dir = draft if isinstance(draft, torch.nn.Module) else str(check_model_dir(resolve_model(draft)))
    return SessionPlan(target=target_dir, method=parsed, draft=draft_dir, tokenizer=tokenizer, dtype=dtype,
                       quantization=quantization, draft_quantization=draft_quantization, device=dev, threads=threads, kv_policy=policy, kv_spec=kv_spec, kv_budget=kv_budget,
                       kv_block=kv_block, target_name=_describe(target_dir), draft_name=_describe(draft_dir),
                       unused_draft=_describe(draft) if draft is not None and not users else None)


def _resolve_quantization(target: Model, draft: Model | None, quantization: str | None,
                          draft_quantization: str | None) -> tuple[str, str]:
    """The target's and the draft's kinds (see the module docstring); one-line errors for an unknown kind and for a
    loaded module asked for a kind it does not have."""
    from .core.quant import DRAFT_KIND, quantization_of
    from .models.loading import check_quantization, default_quantization_for

    def kind_of(role: str, model: Model | None, kind: str | None) -> str:
        kind = check_quantization(kind) if kind is not None else None
        if isinstance(model, torch.nn.Module):
            has = quantization_of(model)
            if kind is not None and kind != has:
                raise ValueError(f"the loaded {role} is quantized to {has}, not {kind}: quantize it yourself "
                                 "(speculant.core.quant.quantize_model) or pass it by name")
            return has
        return kind or "none"

    if quantization is None and isinstance(target, (str, Path)):
        quantization = default_quantization_for(target)  # a packaged model's own format (q4 for the Qwen pair)
    target_kind = kind_of("target", target, quantization)
    # a draft module given with no kind is taken as it is; a draft by name follows the target unless told
    draft_default = None if isinstance(draft, torch.nn.Module) else DRAFT_KIND.get(target_kind, target_kind)
    if _attached_name(draft):  # it shares the target's head: the target's kind
        draft_default = target_kind
    return target_kind, kind_of("draft", draft, draft_quantization if draft_quantization is not None
                                else draft_default)


def _resolve_kv(kv_policy, kv_budget, kv_block) -> tuple[Any, str | None]:
    """The parsed policy and its spec (None, None without eviction); one-line errors."""
    from .core.checks import check_positive_int

    if (kv_policy is None) != (kv_budget is None):
        raise ValueError("--kv-policy and --kv-budget go together (e.g. --kv-policy keydiff --kv-budget 256)")
    if kv_block is not None:
        check_positive_int("kv_block", kv_block)
    if kv_policy is None:
        if kv_block is not None:
            log.warning("--kv-block has no effect without eviction (--kv-policy and --kv-budget)")
        return None, None
    check_positive_int("kv_budget", kv_budget)
    if not isinstance(kv_policy, str):
        return kv_policy, type(kv_policy).__name__
    from .kv import parse_policy, warn_nesting

    policy = parse_policy(kv_policy)
    warn_nesting(policy)
    return policy, kv_policy


def load(
    target: Model = "default-target",
    draft: Model | None = None,
    method: str | None = None,
    **kwargs: Any,
) -> Session:
    """Resolve (:func:`resolve`, same arguments) and load: the one way to get a target, its draft and a method
    ready to generate. Raises a one-line ValueError for bad input before any model is loaded."""
    return resolve(target, draft, method, **kwargs).load()


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
        kind = None if _attached_name(draft) else self.plan.draft_quantization  # attached: the target's kind
        plan = resolve(self.target, draft, self.plan.method.spec, tokenizer=self.tokenizer, dtype=self.plan.dtype,
                       quantization=self.plan.quantization, draft_quantization=kind,
                       threads=None,  # threads: set by the first load
                       kv_policy=self.plan.kv_policy, kv_budget=self.plan.kv_budget, kv_block=self.plan.kv_block,
                       draft_for=("another draft",))
        plan = dataclasses.replace(plan, target_name=self.plan.target_name, kv_spec=self.plan.kv_spec)
        return plan.load()

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
    ) -> list[Generation]:
        """Several prompts decoded together with fresh drafters of the session's method, one verification
        forward per step for all of them (:func:`speculant.core.engine.generate_batch`); each prompt as in
        :meth:`generate` (text through the chat template unless ``raw``, or token ids; it stops at its own end of
        turn). ``seed``: one for all or one per prompt; ``speculation``: ``on``, ``off`` or ``auto``
        (:mod:`speculant.core.speculation`)."""
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
        return engine.generate_batch(self.target, [ids for ids, _ in encoded], [self.drafter() for _ in encoded],
                                     seed=seed, eos_token_id=encoded[0][1], logprobs=logprobs,
                                     speculation=speculation, **sampling, **options)

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

        Returns:
            the engine's :class:`speculant.core.types.Generation` (``token_ids``: the new tokens only).
        """
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
                               **sampling, **self.generate_options(parsed))

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
