"""Structured workloads in ``speculant bench``: each answer checked, and the constraint's cost per method.

A structured prompt record carries a ``response_format`` (``builtin:json-extract``) or ``tools`` and
``tool_choice`` (``builtin:tools``); every method (plain and speculative) decodes it under that constraint. Each
run's row gets ``valid`` and ``exact`` (:func:`speculant.data.answers.check_answer`) beside the engine's
``forced_tokens`` (tokens the constraint allowed alone, emitted without a choice) and ``constraint_mask_s``
(seconds spent building the allowed-token masks); :func:`summarise_structured` pools a method's runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["DEFINITIONS", "structured_table", "summarise_structured"]

DEFINITIONS = {
    "structured": "prompts with a response_format or tools, decoded under that constraint: checked = runs "
    "checked; valid_share = share of runs whose answer parses and matches the schema (json) or makes at least one "
    "tool call, every call naming an offered tool with arguments that match its parameters (tools); exact_share "
    "= share, of the runs whose prompt has a reference answer or expected call, equal to it; mask_s_per_step = "
    "seconds building the constraint's token masks per target call (step), pooled; mask_share = those seconds / "
    "decoding time (wall minus prefill), pooled; forced_token_share = tokens the constraint allowed alone / new "
    "tokens, pooled",
}


def summarise_structured(rows: Sequence[Mapping]) -> dict | None:
    """One method's structured figures (:data:`DEFINITIONS`) over its ``rows`` that were checked (a ``valid``
    that is not None); None when none were."""
    checked = [r for r in rows if r.get("valid") is not None]
    if not checked:
        return None
    refs = [r for r in checked if r.get("exact") is not None]
    steps = sum(r.get("target_calls", 0) for r in checked)
    decode = sum(r.get("wall_s", 0.0) - r.get("prefill_s", 0.0) for r in checked)
    mask = sum(r.get("constraint_mask_s", 0.0) for r in checked)
    new = sum(r.get("new_tokens", 0) for r in checked)
    return {
        "checked": len(checked),
        "valid_share": sum(bool(r["valid"]) for r in checked) / len(checked),
        "exact_share": sum(bool(r["exact"]) for r in refs) / len(refs) if refs else None,
        "mask_s_per_step": mask / steps if steps else None,
        "mask_share": mask / decode if decode > 0 else None,
        "forced_token_share": sum(r.get("forced_tokens", 0) for r in checked) / new if new else None,
    }


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def structured_table(results: Mapping) -> str:
    """One Markdown row per method with structured figures: τ, tokens/s, valid, exact, mask time per step (ms)
    and as a share of decoding, forced tokens; "" when no method has any."""
    methods = {name: s for name, s in results["methods"].items() if s.get("structured")}
    if not methods:
        return ""
    lines = ["| method | τ | tokens/s | valid | exact | mask ms/step | mask share | forced tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in methods.items():
        st = s["structured"]
        per_step = "–" if st["mask_s_per_step"] is None else f"{1000 * st['mask_s_per_step']:.2f}"
        lines.append(f"| `{name}` | {s['acceptance_length']:.2f} | {s['tokens_per_second']:.1f} | "
                     f"{_pct(st['valid_share'])} ({st['checked']}) | {_pct(st['exact_share'])} | {per_step} | "
                     f"{_pct(st['mask_share'])} | {_pct(st['forced_token_share'])} |")
    return "\n".join(lines)
