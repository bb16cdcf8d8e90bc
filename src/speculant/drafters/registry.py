"""The one registry from method names to drafter factories, shared by the CLI, ``speculant bench`` and Python code.

A method *spec* is ``NAME`` or ``NAME:key=value[:key=value...]``; list values are separated by ``/``::

    chain            chain:k=8            rsd-c:branching=2/1/1            specinfer:width=4:depth=3

>>> drafter = build_drafter("chain:k=8", draft_model, tokenizers_match=True)

Each method declares its keys with a type (``int``, ``float``, ``str``, ``bool`` or ``list[int]`` and the like)
and a doc line; values are converted with the declared type. Defaults are not restated here: a key left out of
the spec is not passed, so the drafter class's own default applies (:func:`default_of` reads it for help texts).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.attached import is_feature_drafter
from ..models.confu_contemplation import is_confu_drafter
from ..core.specs import NO_DEFAULT, Key, split_spec
from ..core.target_forward import FORWARDS
from .base import Drafter
from .feature import feature_variant
from .model import DraftModelDrafter
from .trees import (
    DynamicTreeDrafter,
    RSDCDrafter,
    RSDSDrafter,
    SpecInferDrafter,
    SpecTrDrafter,
)

__all__ = [
    "DEFAULT_METHOD",
    "ENGINE_KEYS",
    "NO_DEFAULT",
    "Key",
    "Method",
    "NeedsContext",
    "Sizing",
    "build_drafter",
    "default_of",
    "describe_methods",
    "get_method",
    "methods",
    "parse_method",
    "register",
    "resolve_drafter",
    "split_spec",
]

DEFAULT_METHOD = "chain"
"""The method a bare draft model gets (``generate(target, ids, drafter=draft_model)``, ``--method``'s default)."""

_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]*$")


def default_of(func: Callable, name: str) -> Any:
    """The default of parameter ``name`` in ``func``'s signature (a class: its ``__init__``), or
    :data:`NO_DEFAULT`. Lets a registration show a drafter's default without restating it."""
    param = inspect.signature(func).parameters.get(name)
    return NO_DEFAULT if param is None else param.default


@dataclass(frozen=True)
class Sizing:
    """Which of a method's keys set the size of its draft tree, so that ``speculant.bench.matched_specs`` can size it
    to a number of tree tokens per target call (a *budget*) or of draft levels per step (a *depth*).

    ``depth``: the key holding the draft levels per step. A list key (``rsd-c``'s ``branching``) is a branching
    prefix: its length is the depth, and sizing continues it with 1s (each added level gives every leaf one
    child). ``budget``: the key holding the tree tokens per call (``chain``'s ``k`` is both, ``tree``'s ``budget``
    is its own); None when the tree tokens are ``width x depth`` for the key named ``width`` (i.i.d. trees), which
    a budget then sizes through the depth (a budget the width does not divide has no configuration).
    """

    depth: str
    budget: str | None = None
    width: str | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.width is not None:
            raise ValueError("Sizing takes a budget key or a width key, not both")


@dataclass(frozen=True)
class Method:
    """A registered method: ``factory(draft_model, **options, **context)`` returns a Drafter or None (plain
    decoding). Context entries the factory does not name as parameters are not passed to it. ``sizing``: the
    keys that size its tree (:class:`Sizing`), or None for a method without a fixed tree size."""

    name: str
    factory: Callable[..., Drafter | None]
    needs_draft: bool
    keys: Mapping[str, Key] = field(default_factory=dict)
    doc: str = ""
    sizing: Sizing | None = None


_REGISTRY: dict[str, Method] = {}

ENGINE_KEYS: dict[str, Key] = {
    "forward": Key(str, "the target forward: auto (the lean forward where it reproduces the model), lean, or model "
                        "(transformers' own); see speculant.core.target_forward", "auto"),
}
"""Keys every method spec accepts; they set the decoding loop (``generate``), not the drafter:
:func:`engine_options` splits them off."""


def register(
    name: str,
    factory: Callable[..., Drafter | None],
    needs_draft: bool,
    keys: Mapping[str, Key] | None = None,
    doc: str = "",
    replace: bool = False,
    sizing: Sizing | None = None,
) -> Method:
    """Register a drafting method under ``name`` (lowercase letters, digits, ``-``, ``_``).

    Args:
        factory: called as ``factory(draft_model, **options, **context)``; ``draft_model`` is None when the
            caller has none (only possible when ``needs_draft`` is False).
        needs_draft: the method needs a draft model (``--draft`` on the command line).
        keys: the options a spec may set, key -> :class:`Key` (type, doc, default shown in help).
        doc: one line for help texts, citing the method's paper.
        replace: allow replacing an existing registration.
        sizing: the keys that size the method's tree (:class:`Sizing`; what budget-matched benchmarks set), or
            None when it has no fixed tree size.
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"method name {name!r} must match {_NAME_RE.pattern}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"method {name!r} is already registered")
    keys = dict(keys or {})
    if sizing is not None:
        named = [k for k in (sizing.depth, sizing.budget, sizing.width) if k is not None]
        missing = [k for k in named if k not in keys]
        if missing:
            raise ValueError(f"method {name!r}: sizing names {', '.join(missing)}, which are not among its keys")
    method = Method(name=name, factory=factory, needs_draft=needs_draft, keys=keys, doc=doc, sizing=sizing)
    _REGISTRY[name] = method
    return method


def methods() -> dict[str, Method]:
    """All registered methods by name (a copy)."""
    return dict(_REGISTRY)


def get_method(name: str) -> Method:
    """The method registered as ``name``; an unknown name raises a ValueError listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(_REGISTRY))}") from None


def _check_options(method: Method, options: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in options.items():
        spec = method.keys.get(key) or ENGINE_KEYS.get(key)
        if spec is None:
            known = ", ".join(sorted(method.keys)) or "none"
            raise ValueError(f"unknown option {key!r} for method {method.name!r}; its options: {known} (every "
                             f"method also takes {', '.join(ENGINE_KEYS)})")
        out[key] = spec.convert(method.name, key, value)
    return out


def engine_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split parsed method options into ``(drafter options, engine options)`` (:data:`ENGINE_KEYS`, passed
    to :func:`speculant.generate`)."""
    drafter = {k: v for k, v in options.items() if k not in ENGINE_KEYS}
    engine = {k: v for k, v in options.items() if k in ENGINE_KEYS}
    if engine.get("forward", "auto") not in FORWARDS:
        raise ValueError(f"bad value {engine['forward']!r} for option 'forward': one of {', '.join(FORWARDS)}")
    return drafter, engine


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """Parse ``NAME[:key=value...]`` into ``(name, options)`` with values converted to the declared types.

    Raises:
        ValueError: empty spec, unknown method (the message lists the known ones), malformed ``key=value``,
            unknown or repeated key, or a value that does not convert.
    """
    name, raw = split_spec(spec, "method", sorted(_REGISTRY))
    return name, _check_options(get_method(name), raw)


def build_drafter(
    spec: str | tuple[str, Mapping[str, Any]], draft_model: torch.nn.Module | None = None, **context: Any
) -> Drafter | None:
    """Build the drafter for ``spec``: a spec string or a ``(name, options)`` pair from :func:`parse_method`.

    Args:
        draft_model: the draft LM, required by methods with ``needs_draft``.
        context: what the caller knows (e.g. ``tokenizers_match=True``); each factory takes the entries it names.

    Returns:
        a Drafter, or None for plain autoregressive decoding (``ar``).
    """
    if isinstance(spec, str):
        name, options = parse_method(spec)
    else:
        name, options = spec
        options = _check_options(get_method(name), options)
    options, _ = engine_options(options)  # engine keys set generate(), not the drafter
    method = get_method(name)
    if method.needs_draft and draft_model is None:
        raise ValueError(f"method {name!r} needs a draft model: pass a loaded one as draft_model (speculant."
                         "load_pretrained loads one), or --draft DIR on the command line")
    clash = set(options) & set(context)
    if clash:
        raise ValueError(f"{', '.join(sorted(clash))} given both as method options and as context")
    params = inspect.signature(method.factory).parameters
    taken = {k: v for k, v in context.items() if k in params and params[k].kind is not inspect.Parameter.VAR_KEYWORD}
    return method.factory(draft_model, **options, **taken)


def resolve_drafter(drafter: Drafter | torch.nn.Module | str | None) -> Drafter | None:
    """What ``generate(..., drafter=...)`` accepts, as a Drafter (or None for plain decoding).

    * a Drafter (anything with ``begin``/``propose``/``commit``) or None: as given;
    * a draft model (``torch.nn.Module``, what ``assistant_model=`` takes in transformers): the default method,
      a ``chain`` drafter over it;
    * a method spec string (``"lookup"``, ``"mask-probe:masks=3"``): that method, built by :func:`build_drafter`;
      a method that drafts with a model raises a ValueError saying to pass ``build_drafter(spec, draft_model)``.
    """
    if drafter is None or isinstance(drafter, Drafter):  # structural: begin/propose/commit
        return drafter
    if isinstance(drafter, torch.nn.Module):
        return build_drafter(DEFAULT_METHOD, drafter)
    if isinstance(drafter, str):
        name, _ = split_spec(drafter, "method", sorted(_REGISTRY))
        if name not in _REGISTRY:
            raise ValueError(f"drafter {drafter!r} is not a method spec (known methods: {', '.join(sorted(_REGISTRY))})"
                             "; to draft with a model, load it (speculant.load_pretrained) and pass the model")
        if get_method(name).needs_draft:
            raise ValueError(f"method {name!r} needs a draft model: pass speculant.build_drafter({drafter!r}, "
                             "draft_model) as the drafter (or the draft model itself for a chain)")
        return build_drafter(drafter)
    raise ValueError(f"drafter must be a Drafter, a draft model (torch.nn.Module), a method spec string or None, "
                     f"got {type(drafter).__name__}")


def describe_methods() -> str:
    """Help text: one line per method with its keys, types and defaults."""
    lines = []
    for method in sorted(_REGISTRY.values(), key=lambda m: m.name):
        line = f"  {method.name}: {method.doc}"
        if method.needs_draft:
            line += " [needs --draft]"
        for key, spec in method.keys.items():
            default = "" if spec.default is NO_DEFAULT else f", default {spec.default}"
            line += f"\n      {key} ({spec.type_name()}{default}): {spec.doc}"
        lines.append(line)
    lines.append("  every method also takes:")
    for key, spec in ENGINE_KEYS.items():
        lines.append(f"      {key} ({spec.type_name()}, default {spec.default}): {spec.doc}")
    return "\n".join(lines)


def _ar(draft_model: torch.nn.Module | None) -> None:
    return None


def _model_drafter(cls: type) -> Callable[..., Drafter]:
    """The factory of a draft-model drafter class: ``trim`` is its ``vocab_trim``; a feature (EAGLE) draft model
    is driven by the class's feature variant (:func:`speculant.drafters.feature.feature_variant`), a ConFu one by
    its ConFu variant (:func:`speculant.drafters.confu.confu_variant`)."""

    def factory(draft_model: torch.nn.Module, tokenizers_match: bool | None = None, trim: int | None = None,
                lookup: int = 0, window: int = 0, **options: Any) -> Drafter:
        from .confu import confu_variant

        use = confu_variant(cls) if is_confu_drafter(draft_model) else \
            feature_variant(cls) if is_feature_drafter(draft_model) else cls
        drafter = use(draft_model, tokenizers_match=tokenizers_match, vocab_trim=trim, **options)
        if window:
            if isinstance(window, bool) or not isinstance(window, int) or window < 0:
                raise ValueError(f"window must be a number of tokens >= 0 (0: the whole prompt), got {window!r}")
            if drafter.uses_target_hidden:
                raise ValueError(f"window: a feature (EAGLE) draft model's rows follow the target's states of the "
                                 "whole context; drop window=")
            drafter.context_window = window
        if lookup:
            from .model_lookup import ModelWithLookup

            return ModelWithLookup(drafter, k=lookup)
        return drafter

    return factory


_TRIM = Key(int, "VocabTrim: draft over the N most frequent tokens of the draft's calibration; 0 = full LM head; "
            "default: the size the draft ships with, if any")
_WINDOW = Key(int, "the draft model reads at most the prompt's last N tokens, as if the text began there (a short "
              "prefill and attention whatever the prompt's length; only acceptance can change); 0 = the whole prompt", 0)
_LOOKUP = Key(int, "also merge a prompt-lookup chain of up to N tokens into each draft, verified in the same "
              "forward as a deterministic draft (a sampled chain's tokens then count as point masses); 0 = none", 0)


def _keys(cls: type, **docs: tuple[Any, str]) -> dict[str, Key]:
    """Keys named like ``cls``'s parameters, their defaults read from its signature, plus ``trim``."""
    keys = {}
    for name, (typ, doc) in docs.items():
        default = default_of(cls, name)
        if isinstance(default, (list, tuple)):  # shown as a spec writes it
            default = "/".join(map(str, default))
        keys[name] = Key(typ, doc, default)
    keys["trim"] = _TRIM
    keys["window"] = _WINDOW
    return keys


register("ar", _ar, needs_draft=False, doc="plain autoregressive decoding, no draft (the baseline)")
register(
    "chain",
    _model_drafter(DraftModelDrafter),
    needs_draft=True,
    keys={**_keys(DraftModelDrafter, k=(int, "draft tokens per step (gamma); the most, with stop"),
             stop=(float, "end the chain after a token the draft gives less than this probability (it is still "
                          "proposed; transformers' assisted generation does the same); 0 = always k tokens")),
          "lookup": _LOOKUP},
    sizing=Sizing(depth="k", budget="k"),
    doc="draft-model chain, speculative sampling (Leviathan et al. 2023; Chen et al. 2023); with a feature "
        "draft model, an EAGLE chain drafted from the target's hidden states (Li et al. 2024)",
)
# SpecInfer and SpecTr draft the same tree of i.i.d. sequences (they differ in the verification rule only)
_IID_TREE = {"width": (int, "i.i.d. draft sequences W (nodes per level <= W)"),
             "depth": (int, "tokens per sequence L (draft forwards per step)")}
_IID_SIZING = Sizing(depth="depth", width="width")  # W x L tree tokens
register(
    "specinfer",
    _model_drafter(SpecInferDrafter),
    needs_draft=True,
    keys=_keys(SpecInferDrafter, **_IID_TREE),
    sizing=_IID_SIZING,
    doc="SpecInfer token tree: W i.i.d. drafts merged into a prefix tree, multi-draft rejection sampling with "
        "replacement (Miao et al. 2024); greedy: beam search",
)
register(
    "spectr",
    _model_drafter(SpecTrDrafter),
    needs_draft=True,
    keys=_keys(SpecTrDrafter, **_IID_TREE),
    sizing=_IID_SIZING,
    doc="SpecTr: SpecInfer's tree of W i.i.d. drafts verified by the K-SEQ coupling at each node (Sun et al. "
        "2023); greedy: beam search",
)
register(
    "rsd-c",
    _model_drafter(RSDCDrafter),
    needs_draft=True,
    keys=_keys(RSDCDrafter, branching=(list[int], ("children per node at each level, b1/b2/...: Gumbel-top-b "
                                                   "(without replacement); the depth is the list's length"))),
    sizing=Sizing(depth="branching"),
    doc="Recursive Speculative Decoding, constant branching: Gumbel-top-b children, recursive rejection without "
        "replacement (Jeon et al. 2024); greedy: top-b children",
)
register(
    "rsd-s",
    _model_drafter(RSDSDrafter),
    needs_draft=True,
    keys=_keys(RSDSDrafter, width=(int, "beam width W (nodes per level)"),
               depth=(int, "levels L (draft forwards per step)")),
    sizing=_IID_SIZING,
    doc="Recursive Speculative Decoding, stochastic beam search (Jeon et al. 2024; Kool et al. 2019); greedy: "
        "beam search",
)
_TREE_KEYS = _keys(DynamicTreeDrafter, budget=(int, "tree tokens per target call N (best cumulative log-prob)"),
                   topk=(int, "children per expanded node, and nodes expanded per level K"),
                   depth=(int, "levels L (draft forwards per step)"),
                   calibrate=(bool, "rank nodes by acceptance rates learned online from verification (0: by raw "
                                    "draft probability, as EAGLE-2)"))
register(
    "tree",
    _model_drafter(DynamicTreeDrafter),
    needs_draft=True,
    keys=_TREE_KEYS | {"lookup": _LOOKUP},
    sizing=Sizing(depth="depth", budget="budget"),
    doc="greedy dynamic draft tree (EAGLE-2 style, Li et al. 2024); deterministic: exact at any temperature "
        "(greedy / deterministic-draft verification)",
)


def _trained_tree(method: str, confu: bool) -> Callable[..., Drafter]:
    """The factory of a method that drafts EAGLE-2's dynamic tree from a trained feature drafter of its own kind:
    ``eagle3`` (an EAGLE-3 drafter) or ``confu`` (a ConFu drafter, with its ``contemplate`` option)."""

    def factory(draft_model: torch.nn.Module, tokenizers_match: bool | None = None, trim: int | None = None,
                **options: Any) -> Drafter:
        from .confu import ConFuTreeDrafter
        from .feature import FeatureTreeDrafter

        if not hasattr(draft_model, "config"):  # a stand-in (option checks before anything loads)
            raise NeedsContext(f"method {method!r} needs its draft model")
        kind = "confu" if is_confu_drafter(draft_model) else "eagle3" if is_feature_drafter(draft_model) else None
        if kind != method:
            wanted = "a ConFu drafter" if confu else "an EAGLE-3 feature drafter"
            found = {"confu": "a ConFu drafter: use confu for it", "eagle3": "an EAGLE-3 drafter without "
                     "contemplation: use eagle3 for it"}.get(kind, "a plain draft model: give one with draft=DIR / "
                                                                 "--draft DIR, or use chain or tree for it")
            raise ValueError(f"method {method!r} drafts with {wanted} (speculant train draft --kind {method}), not "
                             f"{found}")
        cls = ConFuTreeDrafter if confu else FeatureTreeDrafter
        return cls(draft_model, tokenizers_match=tokenizers_match, vocab_trim=trim, **options)

    return factory


register(
    "eagle3",
    _trained_tree("eagle3", confu=False),
    needs_draft=True,
    keys=_TREE_KEYS,
    sizing=Sizing(depth="depth", budget="budget"),
    doc="EAGLE-3 (Li et al. 2025): a feature drafter reading the target's low, middle and high layers, drafting "
        "EAGLE-2's dynamic tree; with no draft given, the EAGLE-3 drafter speculant ships for the target",
)


register(
    "confu",
    _trained_tree("confu", confu=True),
    needs_draft=True,
    keys=_TREE_KEYS | {"contemplate": Key(str, "where contemplate tokens ride in the verification forward: root "
                                                "(one extra row) or all (one per tree node, as the paper)", "root")},
    sizing=Sizing(depth="depth", budget="budget"),
    doc="ConFu (Qin, Goel, Gagrani et al. 2026): an EAGLE-3 drafter that also reads the target's contemplation of "
        "the future (a masked contemplate token with a learned soft prompt, riding in the verification forward), "
        "drafting EAGLE-2's dynamic tree; with no draft given, the ConFu drafter speculant ships for the target",
)


class NeedsContext(ValueError):
    """A method was built without context only its caller has (e.g. both tokenizers): raised by its factory; a
    check of option values on a stand-in model (:class:`speculant.plan.ParsedMethod`) lets it pass."""


def _cross_vocab(draft_model: torch.nn.Module, draft_tokenizer=None, target_tokenizer=None, trim: int | None = None,
                 **options: Any) -> Drafter:
    from .cross_vocab import CrossVocabDrafter

    if draft_tokenizer is None or target_tokenizer is None:
        raise NeedsContext("method 'cross-vocab' needs both tokenizers: on the command line they come with --draft "
                         "and the target; in Python: build_drafter('cross-vocab', draft, draft_tokenizer=..., "
                         "target_tokenizer=...)")
    return CrossVocabDrafter(draft_model, draft_tokenizer, target_tokenizer, vocab_trim=trim, **options)


register(
    "cross-vocab",
    _cross_vocab,
    needs_draft=True,
    keys={"k": Key(int, "draft tokens (the draft's own) per step", 6),
          "max_ngram": Key(int, "longest run of draft tokens the translation cache keys", 4), "trim": _TRIM},
    doc="cross-vocabulary drafting (OmniDraft style): a draft model with another tokenizer drafts text, an n-gram "
        "cache grown online translates it into the target's tokens; deterministic draft: exact at any temperature",
)


def _lookup(draft_model: torch.nn.Module | None = None, **options: Any) -> Drafter:
    from .lookup import PromptLookupDrafter

    return PromptLookupDrafter(**options)


def _mask_probe(draft_model: torch.nn.Module | None = None, **options: Any) -> Drafter:
    from .mask_probe import MaskProbeDrafter

    return MaskProbeDrafter(**options)


def _hybrid(draft_model: torch.nn.Module | None = None, **options: Any) -> Drafter:
    from .lookup_probe import LookupProbeDrafter

    return LookupProbeDrafter(**options)


_MASK_KEYS = {
    "masks": Key(int, "mask tokens after the root and after every tree node (tree depth)", default=2),
    "tree": Key(list[int], "static tree widths K1/K2/... per depth (default 4/2)"),
    "budget": Key(int, "dynamic tree instead: keep the best budget-i trajectories at depth i"),
    "init": Key(str, "mask embedding: mean (EMA of committed tokens), last or random", default="mean"),
    "ema": Key(float, "lambda of the mean embedding's moving average, in (0, 1]", default=0.1),
}
register(
    "lookup",
    _lookup,
    needs_draft=False,
    keys={"ngram": Key(int, "longest n-gram matched against earlier text", default=3),
          "k": Key(int, "tokens copied per step", default=8)},
    sizing=Sizing(depth="k", budget="k"),
    doc="prompt-lookup drafting: copy what followed the last n-gram's earlier occurrence (Saxena 2023); "
        "deterministic draft",
)
register(
    "mask-probe",
    _mask_probe,
    needs_draft=False,
    keys=_MASK_KEYS,
    doc="ESP: training-free drafting by probing the target with mask tokens in the same forward (Goel et al. "
        "2026); deterministic draft, no draft model",
)
register(
    "hybrid",
    _hybrid,
    needs_draft=False,
    keys={**_MASK_KEYS, "ngram": Key(int, "longest n-gram of the lookup branch", default=3),
          "k": Key(int, "tokens of the lookup branch", default=5)},
    doc="training-free hybrid: the prompt-lookup chain merged into the mask-probe tree, one forward; "
        "deterministic draft, no draft model",
)
