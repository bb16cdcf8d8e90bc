"""Budget-matched specs: one drafting family sized to equal tree tokens per target call, or to equal draft depth.

Trees are compared both ways. A *family* is a registry spec without its size, e.g.
``chain``, ``specinfer:width=2``, ``rsd-c:branching=2`` (a branching prefix, continued with 1s),
``rsd-s:width=4`` or ``tree:topk=2:depth=8``; :func:`at_budget` and :func:`at_depth` size it by the keys its
registration declares (:class:`speculant.drafters.registry.Sizing`), so a newly registered method is sized too:

====================================  ==============================  ==========================
sizing declared (in-tree methods)     at budget B (tree tokens)       at depth D (draft levels)
====================================  ==============================  ==========================
budget = depth key (``chain``,        ``k=B``                         ``k=D``
``lookup``: ``k``)
width x depth (``specinfer``,         ``depth=B/W`` (W divides B)     ``depth=D``
``spectr``, ``rsd-s``)
a list depth key (``rsd-c``'s         the prefix then 1s, B nodes     the prefix then 1s, D levels
``branching``)
own budget key (``tree``)             ``budget=B``                    ``depth=D``
====================================  ==============================  ==========================

A family with no configuration of exactly that size gives None (the comparison skips it). A family that already
sets the key the sizing sets (``chain:k=4`` at a budget, ``tree:depth=5`` at a depth) is refused with a ValueError
rather than silently resized. :func:`shape` gives the ``(nodes, depth)`` of a fully specified spec: the most tree
tokens one target call verifies and the draft levels per step.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from typing import Any

from ..core.checks import check_positive_int
from ..drafters.registry import NO_DEFAULT, Method, Sizing, get_method, methods, parse_method

__all__ = ["at_budget", "at_depth", "format_spec", "matched_specs", "shape"]


def _option(method: Method, options: dict[str, Any], key: str) -> Any:
    """The value of ``key``: from the spec, else the declared default (a list key's default as a list)."""
    if key in options:
        return options[key]
    spec = method.keys[key]
    if spec.default is NO_DEFAULT:
        raise ValueError(f"{method.name} needs {key}= to be sized")
    if _is_list(method, key):
        return [int(x) for x in str(spec.default).split("/")]
    return spec.default


def _is_list(method: Method, key: str) -> bool:
    return typing.get_origin(method.keys[key].type) is list


def _branching_nodes(b: Sequence[int]) -> int:
    """Tree tokens of a constant-branching tree ``b1/b2/...``: level i has ``b1 * ... * bi`` nodes."""
    return sum(math.prod(b[: i + 1]) for i in range(len(b)))


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
    and the draft levels per step; None for methods that declare no sizing (``ar``, ``mask-probe``)."""
    name, options = parse_method(spec)
    method = get_method(name)
    sizing = method.sizing
    if sizing is None:
        return None
    if _is_list(method, sizing.depth):
        b = _option(method, options, sizing.depth)
        return _branching_nodes(b), len(b)
    depth = _option(method, options, sizing.depth)
    if sizing.budget is not None:
        return _option(method, options, sizing.budget), depth
    return _option(method, options, sizing.width) * depth, depth


def _sets(method: Method, budget: int | None) -> str | None:
    """The key sizing sets on the budget axis (``budget`` given) or the depth axis; None for a list depth key
    (a branching prefix is continued, not overwritten)."""
    sizing = method.sizing
    if _is_list(method, sizing.depth):
        return None
    if budget is not None and sizing.budget is not None:
        return sizing.budget
    return sizing.depth


def _check_unsized(method: Method, options: dict[str, Any], family: str, budget: int | None) -> None:
    """A family must not set the key that sizing sets: ``chain:k=4`` at budget 8 would silently run ``k=8``."""
    key = _sets(method, budget)
    if key in options:
        axis = "--budgets" if budget is not None else "--depths"
        bare = format_spec(method.name, {k: v for k, v in options.items() if k != key})
        raise ValueError(f"{family!r} already sets {key}, the size that {axis} sets: give the family without it "
                         f"({bare!r})")


def _sized(family: str, budget: int | None, depth: int | None) -> str | None:
    name, options = parse_method(family)
    method = get_method(name)
    sizing: Sizing | None = method.sizing
    if sizing is None:
        sized = ", ".join(sorted(n for n, m in methods().items() if m.sizing is not None))
        raise ValueError(f"{family!r}: {name} has no tree size to match (families: {sized})")
    options = dict(options)
    _check_unsized(method, options, family, budget)
    if _is_list(method, sizing.depth):  # a branching prefix continued with 1s
        b = list(_option(method, options, sizing.depth))
        if budget is not None:
            nodes, width = _branching_nodes(b), math.prod(b)
            if budget < nodes or (budget - nodes) % width:
                return None
            b += [1] * ((budget - nodes) // width)
        else:
            if depth < len(b):
                return None
            b += [1] * (depth - len(b))
        options[sizing.depth] = b
    elif budget is None:
        options[sizing.depth] = depth
    elif sizing.budget is not None:
        options[sizing.budget] = budget
    else:  # width x depth tree tokens
        width = _option(method, options, sizing.width)
        if budget % width:
            return None
        options[sizing.depth] = budget // width
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
