"""Names of KV eviction policies, as used on the command line: ``keydiff``, ``caote:h2o``, ``protect:tova``...

A spec is ``[wrapper:]*base``; wrappers apply right to left (``caote:protect:snapkv`` = CAOTE over protected
SnapKV). Defaults live in the policy dataclasses; this module only maps names to constructors.
"""

from __future__ import annotations

from collections.abc import Callable

from .caote import CAOTE
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

__all__ = ["POLICIES", "WRAPPERS", "parse_policy", "policy_names"]

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


def parse_policy(spec: str) -> ScorePolicy:
    """``"caote:h2o"`` -> ``CAOTE(inner=H2O())``. Raises ValueError naming the known names."""
    parts = [p.strip().lower() for p in spec.split(":")]
    base = parts[-1]
    if base not in POLICIES:
        raise ValueError(f"unknown KV policy {base!r} in {spec!r}; known: {', '.join(POLICIES)}")
    policy = POLICIES[base]()
    for wrapper in reversed(parts[:-1]):
        if wrapper not in WRAPPERS:
            raise ValueError(f"unknown KV policy wrapper {wrapper!r} in {spec!r}; known: {', '.join(WRAPPERS)}")
        policy = WRAPPERS[wrapper](policy)
    return policy
