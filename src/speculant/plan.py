"""What a session loads, resolved and checked before anything is loaded: the method, the models, the KV policy.

>>> plan = speculant.resolve("smollm2-135m-instruct")   # names to checked directories, nothing loaded
>>> plan.method.spec, plan.draft_name
>>> session = speculant.load_plan(plan)                 # the models loaded (speculant.session)

Every front-end resolves through here (``speculant generate``, ``serve``, ``bench``, ``kv-eval`` and the demo), so
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
  (:attr:`speculant.models.sources.PackagedModel.default_quantization`, e.g. each matrix as precise as its GGUF
  file for Qwen2.5-Coder-1.5B), else ``"none"`` (:data:`speculant.core.quant.QUANTIZATIONS`); the models loaded by
  name are quantized as they load (:func:`speculant.models.loading.load_model_dir`: a GGUF file's own codes are
  kept where the kind holds them, :func:`speculant.models.loading.quantize_loaded`). **draft_quantization** None:
  the target's kind, in its fastest form (:data:`speculant.core.quant.DRAFT_KIND`), because the draft only
  proposes (its numerics never change what is emitted) and a quantized target usually wants a draft as cheap as
  itself; give ``"none"`` to keep a float draft. A loaded module is never quantized here: quantization None takes
  it as it is, any other kind must be the one it already has (:func:`speculant.core.quant.quantization_of`).
* **kv_policy** a name or a policy object: resolved to what the engine evicts with
  (:func:`speculant.kv.registry.resolve_eviction`).

Two phases, because a server checks its settings before it listens and loads afterwards: :func:`resolve` checks
everything cheap and resolves names to model directories (:class:`SessionPlan`, nothing loaded), and
:func:`speculant.session.load_plan` loads the models.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .core.eviction import EvictionPolicy
    from .kv.policies import ScorePolicy

__all__ = ["DEFAULT_PREFIX_CACHE_MB", "Model", "ParsedMethod", "SessionPlan", "check_prefix_cache_mb", "default_method",
           "generate_defaults", "is_attached_draft", "resolve"]

log = logging.getLogger(__name__)

Model = str | Path | torch.nn.Module
"""A model as a session takes it: a name or directory (anything :func:`speculant.models.loading.resolve_model`
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
    """What a session loads, checked and resolved, before anything is loaded (:func:`resolve` makes it;
    :func:`speculant.session.load_plan` loads it).

    ``target``: a checked model directory (str) or the module as given; ``draft``: the same, or None when nothing
    drafts with a model; ``target_name``/``draft_name``: the same as text (for reports); ``method``: the parsed
    method; ``kv_policy``: what the engine evicts with (None: no eviction), ``kv_spec`` its spec as given."""

    target: str | torch.nn.Module
    method: ParsedMethod
    draft: str | torch.nn.Module | None = None
    tokenizer: Any = None
    dtype: torch.dtype | str = torch.float32
    quantization: str = "none"
    draft_quantization: str = "none"
    device: torch.device | None = None
    threads: int | str | None = None
    kv_policy: EvictionPolicy | None = None
    kv_spec: str | None = None
    kv_budget: int | None = None
    kv_block: int | None = None
    target_name: str = ""
    draft_name: str | None = None
    unused_draft: str | None = None  # a draft given to a method that drafts without one (not loaded)
    prefix_cache_mb: float = 0.0  # the byte budget (MiB) of the keys/values kept for prompt-prefix reuse; 0: none


DEFAULT_PREFIX_CACHE_MB = 2048.0
"""The default budget of a session's prefix cache: 2 GiB holds about 36k tokens of the 1.5B Qwen target's float32
keys/values (56 KiB per token) with its draft's, a few long conversations, and leaves most of a 24 GB machine
to the models."""


def check_prefix_cache_mb(value: float | None) -> float:
    """The prefix cache's budget in MiB (None: :data:`DEFAULT_PREFIX_CACHE_MB`); a one-line ValueError unless a
    finite number >= 0."""
    if value is None:
        return DEFAULT_PREFIX_CACHE_MB
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"the prefix cache's budget must be a number of MiB >= 0 (0: no reuse), got {value!r}")
    return float(value)


def is_attached_draft(draft: Model | None) -> bool:
    """Whether ``draft`` names (by path or name) an attached drafter directory."""
    if not isinstance(draft, (str, Path)):
        return False
    from .models.attached import is_attached
    from .models.loading import resolve_model

    try:
        return is_attached(Path(resolve_model(draft)))
    except ValueError:
        return False


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
    kv_policy: str | ScorePolicy | EvictionPolicy | None = None,
    kv_budget: int | None = None,
    kv_block: int | None = None,
    tokenizer: Any = None,
    draft_for: Sequence[str] = (),
    prefix_cache_mb: float | None = None,
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
        prefix_cache_mb: MiB kept for the keys/values of prompt prefixes, which later generations of the session
            reuse instead of computing them again (:mod:`speculant.core.prefix_cache`); None:
            :data:`DEFAULT_PREFIX_CACHE_MB`; 0: no reuse.

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
    prefix_cache_mb = check_prefix_cache_mb(prefix_cache_mb)
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
                       quantization=quantization, draft_quantization=draft_quantization, device=dev, threads=threads,
                       kv_policy=policy, kv_spec=kv_spec, kv_budget=kv_budget, prefix_cache_mb=prefix_cache_mb,
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
    if is_attached_draft(draft):  # it shares the target's head: the target's kind
        draft_default = target_kind
    return target_kind, kind_of("draft", draft, draft_quantization if draft_quantization is not None
                                else draft_default)


def _resolve_kv(kv_policy, kv_budget, kv_block) -> tuple[EvictionPolicy | None, str | None]:
    """What the engine evicts with and the policy's spec (None, None without eviction); one-line errors."""
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
    from .kv import parse_policy, resolve_eviction

    if not isinstance(kv_policy, str):
        return resolve_eviction(kv_policy), type(kv_policy).__name__
    return resolve_eviction(parse_policy(kv_policy)), kv_policy
