"""Names of KV eviction policies, as used on the command line: ``keydiff``, ``caote:h2o``, ``protect:tova``...

A spec is ``[wrapper:]*base[:key=value]*``; wrappers apply right to left (``caote:protect:snapkv`` = CAOTE over
protected SnapKV); options set the base policy's numeric and boolean fields (``snapkv:window=32``,
``caote:speckv:passes=2``). Defaults live in the policy dataclasses; this module maps names to constructors and
resolves a name or a policy to what the engine evicts with (:func:`resolve_eviction`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..core.eviction import EvictionPolicy
from ..core.specs import Key, split_spec
from .budget import Eviction
from .caote import CAOTE, warn_nesting
from .speckv import SpecKV
from .policies import (
    H2O,
    TOVA,
    KeyDiff,
    KeyNorm,
    Protect,
    RandomScore,
    ScorePolicy,
    SnapKV,
    Streaming,
)

__all__ = ["POLICIES", "WRAPPERS", "parse_policy", "policy_names", "policy_options", "resolve_eviction"]

POLICIES: dict[str, Callable[[], ScorePolicy]] = {
    "keydiff": KeyDiff,
    "keydiff-raw": lambda: KeyDiff(raw_mean=True),
    "streaming": Streaming,
    "h2o": H2O,  # heavy hitters + a recent window of half the budget (the paper's split)
    "h2o-acc": lambda: H2O(recent_fraction=0.0),  # accumulated attention alone, no recent window
    "tova": TOVA,
    "snapkv": SnapKV,
    "knorm": KeyNorm,
    "random": RandomScore,
    "speckv": SpecKV,  # SnapKV scored by a draft's provisional answer at the end of the prompt (needs a draft)
}

WRAPPERS: dict[str, Callable[[ScorePolicy], ScorePolicy]] = {
    "caote": lambda inner: CAOTE(inner),
    "fastcaote": lambda inner: CAOTE(inner, fast=True),
    "protect": lambda inner: Protect(inner),
}


def policy_names() -> list[str]:
    """Base policy names followed by ``wrapper:`` prefixes."""
    return [*POLICIES, *(f"{w}:" for w in WRAPPERS)]


def policy_options(policy: ScorePolicy) -> dict[str, Key]:
    """The options a spec may set on ``policy``: its int, float and bool dataclass fields."""
    if not dataclasses.is_dataclass(policy):
        return {}
    return {f.name: Key(type(getattr(policy, f.name)), f.name) for f in dataclasses.fields(policy)
            if type(getattr(policy, f.name)) in (int, float, bool)}


def parse_policy(spec: str) -> ScorePolicy:
    """``"caote:h2o"`` -> ``CAOTE(inner=H2O())``; ``"speckv:passes=2"`` -> ``SpecKV(passes=2)``. Raises ValueError
    naming the known names (or options)."""
    parts = [p.strip().lower() for p in spec.split(":")]
    names = [p for p in parts if "=" not in p]
    if not names or parts[: len(names)] != names:
        raise ValueError(f"bad KV policy {spec!r}: expected [wrapper:]*policy[:key=value]*")
    base = names[-1]
    if base not in POLICIES:
        raise ValueError(f"unknown KV policy {base!r} in {spec!r}; known: {', '.join(POLICIES)}")
    policy = POLICIES[base]()
    _, raw = split_spec(":".join([base, *parts[len(names):]]), "KV policy", list(POLICIES))
    if raw:
        known = policy_options(policy)
        values = {}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"unknown option {key!r} of KV policy {base!r} in {spec!r}; its options: "
                                 f"{', '.join(known) or 'none'}")
            values[key] = known[key].convert(base, key, value, kind="KV policy")
        try:
            policy = dataclasses.replace(policy, **values)
        except ValueError as e:
            raise ValueError(f"KV policy {spec!r}: {e}") from None
    for wrapper in reversed(names[:-1]):
        if wrapper not in WRAPPERS:
            raise ValueError(f"unknown KV policy wrapper {wrapper!r} in {spec!r}; known: {', '.join(WRAPPERS)}")
        policy = WRAPPERS[wrapper](policy)
    return policy


def resolve_eviction(policy: str | ScorePolicy | EvictionPolicy) -> EvictionPolicy:
    """What the engine evicts with: a policy name (:func:`parse_policy`) or a :class:`ScorePolicy`, paired with
    the budgeted cache (:class:`speculant.kv.budget.Eviction`), after warning once about a policy nesting CAOTE
    in CAOTE; an object that already is an eviction policy, as it is."""
    if isinstance(policy, str):
        policy = parse_policy(policy)
    if isinstance(policy, ScorePolicy):
        warn_nesting(policy)
        return Eviction(policy)
    return policy
