"""Budget-matched specs: one drafting family sized to equal tree tokens per target call, or to equal draft depth.

../shared/ALGORITHMS.md asks trees to be compared both ways. A *family* is a registry spec without its size, e.g.
``chain``, ``specinfer:width=2``, ``rsd-c:branching=2`` (a branching prefix, continued with 1s),
``rsd-s:width=4`` or ``tree:topk=2:depth=8``; :func:`at_budget` and :func:`at_depth` size it:

====================================  ==============================  ==========================
family                                at budget B (tree tokens)       at depth D (draft levels)
====================================  ==============================  ==========================
``chain``, ``lookup``                 ``k=B``                         ``k=D``
``specinfer``, ``spectr``, ``rsd-s``  ``depth=B/W`` (W divides B)     ``depth=D``
``rsd-c:branching=b1/..``             the prefix then 1s, B nodes     the prefix then 1s, D levels
``tree``                              ``budget=B``                    ``depth=D``
====================================  ==============================  ==========================

A family with no configuration of exactly that size gives None (the comparison skips it). A family that already
sets the key the sizing sets (``chain:k=4`` at a budget, ``tree:depth=5`` at a depth) is refused with a ValueError
rather than silently resized. :func:`shape` gives the ``(nodes, depth)`` of a fully specified spec: the most tree
tokens one target call verifies and the draft levels per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..core.checks import check_positive_int
from ..drafters.registry import NO_DEFAULT, get_method, parse_method

__all__ = ["at_budget", "at_depth", "format_spec", "matched_specs", "shape"]


def _option(name: str, options: dict[str, Any], key: str) -> Any:
    if key in options:
        return options[key]
    default = get_method(name).keys[key].default
    if default is NO_DEFAULT:
        raise ValueError(f"{name} needs {key}= to be sized")
    return [int(x) for x in str(default).split("/")] if key == "branching" else default


def format_spec(name: str, options: dict[str, Any]) -> str:
    """``("rsd-c", {"branching": [2, 1]})`` -> ``"rsd-c:branching=2/1"`` (lists written as specs write them)."""
    parts = [name]
    for key, value in options.items():
        if isinstance(value, (list, tuple)):
            value = "/".join(map(str, value))
        elif isinstance(value, bool):
            value = int(value)
        parts.append(f"{key}={value}")
    return ":".join(parts)


def shape(spec: str) -> tuple[int, int] | None:
    """``(nodes, depth)`` of a registry spec: the most tree tokens one target call verifies (the root excluded)
    and the draft levels per step; None for methods without a fixed tree (``ar``, ``mask-probe``)."""
    name, options = parse_method(spec)
    if name in ("chain", "lookup"):
        k = _option(name, options, "k")
        return k, k
    if name in ("specinfer", "spectr", "rsd-s"):
        width, depth = _option(name, options, "width"), _option(name, options, "depth")
        return width * depth, depth
    if name == "rsd-c":
        b = _option(name, options, "branching")
        return sum(math.prod(b[: i + 1]) for i in range(len(b))), len(b)
    if name == "tree":
        return _option(name, options, "budget"), _option(name, options, "depth")
    return None


_SIZE_KEYS = {  # family: (the key sizing to a budget sets, the key sizing to a depth sets)
    "chain": ("k", "k"),
    "lookup": ("k", "k"),
    "specinfer": ("depth", "depth"),
    "spectr": ("depth", "depth"),
    "rsd-s": ("depth", "depth"),
    "tree": ("budget", "depth"),
}  # rsd-c: its branching is a prefix that sizing continues with 1s, not overwritten


def _check_unsized(name: str, options: dict[str, Any], family: str, budget: int | None) -> None:
    """A family must not set the key that sizing sets: ``chain:k=4`` at budget 8 would silently run ``k=8``."""
    keys = _SIZE_KEYS.get(name)
    key = None if keys is None else keys[0 if budget is not None else 1]
    if key in options:
        axis = "--budgets" if budget is not None else "--depths"
        bare = format_spec(name, {k: v for k, v in options.items() if k != key})
        raise ValueError(f"{family!r} already sets {key}, the size that {axis} sets: give the family without it "
                         f"({bare!r})")


def _sized(family: str, budget: int | None, depth: int | None) -> str | None:
    name, options = parse_method(family)
    options = dict(options)
    _check_unsized(name, options, family, budget)
    if name in ("chain", "lookup"):
        options["k"] = budget if budget is not None else depth
    elif name in ("specinfer", "spectr", "rsd-s"):
        if budget is not None:
            width = _option(name, options, "width")
            if budget % width:
                return None
            options["depth"] = budget // width
        else:
            options["depth"] = depth
    elif name == "rsd-c":
        b = list(_option(name, options, "branching"))
        if budget is not None:
            nodes, width = shape(format_spec(name, {"branching": b}))[0], math.prod(b)
            if budget < nodes or (budget - nodes) % width:
                return None
            b += [1] * ((budget - nodes) // width)
        else:
            if depth < len(b):
                return None
            b += [1] * (depth - len(b))
        options["branching"] = b
    elif name == "tree":
        options["budget" if budget is not None else "depth"] = budget if budget is not None else depth
    else:
        raise ValueError(f"{family!r}: {name} has no tree size to match (families: chain, lookup, specinfer, "
                         "spectr, rsd-c, rsd-s, tree)")
    return format_spec(name, options)


def at_budget(family: str, budget: int) -> str | None:
    """``family`` sized to exactly ``budget`` tree tokens per target call, or None if it has no such size."""
    return _sized(family, budget, None)


def at_depth(family: str, depth: int) -> str | None:
    """``family`` sized to ``depth`` draft levels per step, or None if it has no such size."""
    return _sized(family, None, depth)


def matched_specs(families: Sequence[str], budgets: Sequence[int], depths: Sequence[int],
                  skip: Sequence[str] = ()) -> tuple[list[str], dict]:
    """Every family (but those in ``skip``, e.g. the reference) sized to each budget and each depth: the sized
    specs to run (each once, in order) and ``{"families", "budgets": {B: {family: spec | None}}, "depths":
    {D: {...}}}``. A one-line ValueError for a size < 1, a family that sets its size already or has none, or
    when no family has a configuration of any of the sizes."""
    for axis, values in (("budgets", budgets), ("depths", depths)):
        for v in values:
            check_positive_int(axis[:-1], v)
    specs: list[str] = []
    matched: dict = {"families": [f for f in families if f not in skip], "budgets": {}, "depths": {}}
    for axis, values, size in (("budgets", budgets, at_budget), ("depths", depths, at_depth)):
        for v in values:
            row = matched[axis][str(v)] = {}
            for family in matched["families"]:
                spec = row[family] = size(family, int(v))
                if spec is not None and spec not in specs:
                    specs.append(spec)
    if not specs:
        raise ValueError(f"no method family has a configuration at budgets {list(budgets)} / depths {list(depths)}")
    return specs, matched
