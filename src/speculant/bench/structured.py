"""Structured workloads in ``speculant bench``: each answer checked, and the constraint's cost per method.

A structured prompt record carries a ``response_format`` (``builtin:json-extract``) or ``tools`` and
``tool_choice`` (``builtin:tools``); every method (plain and speculative) decodes it under that constraint. Each
run's row gets ``valid`` and ``exact`` (:func:`speculant.data.answers.check_answer`) beside the engine's
``forced_tokens`` (tokens the constraint allowed alone, emitted without a choice) and ``constraint_mask_s``
(seconds spent building the allowed-token masks); :func:`summarise_structured` pools a method's runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..data.answers import check_answer, structured_kind

__all__ = ["DEFINITIONS", "StructuredPrompt", "check_run", "prepare", "structured_table", "summarise_structured"]

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


@dataclass
class StructuredPrompt:
    """A structured prompt ready to run: its ``record``, the keyword arguments of
    :meth:`speculant.session.Session.generate` that put its constraint on decoding (``kwargs``: a
    ``response_format``, or none for ``tool_choice`` ``auto``), and for a tools prompt the target's tool-call
    format (``tool_format``), which reads the calls back out of the text."""

    record: Mapping
    kwargs: dict
    tool_format: Any = None


def prepare(record: Mapping, tokenizer: Any) -> StructuredPrompt:
    """``record``'s constraint for the target's ``tokenizer``: a JSON record's own ``response_format``; a tools
    record's ``tool_choice`` as a grammar in the model's tool-call format
    (:func:`speculant.structured.tool_calls.tool_constraint`: ``required`` forces a call of one of the tools, or
    several unless ``parallel_tool_calls`` is false; ``auto`` leaves the model free), the record's
    ``response_format`` being the answer's schema when it has one.

    Raises:
        ValueError: one line naming the prompt: bad tools or tool_choice, or a target whose chat template has no
            tool-call format.
    """
    if structured_kind(record) == "json":
        return StructuredPrompt(record, {"response_format": dict(record["response_format"])})
    from ..structured.tool_calls import check_tool_choice, check_tools, tool_constraint, tool_format

    try:
        tools = check_tools(list(record["tools"]))
        choice = check_tool_choice(record.get("tool_choice", "auto"), tools)
        fmt = tool_format(tokenizer)
        answer = (record.get("response_format") or {}).get("json_schema", {}).get("schema")
        parallel = record.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ValueError(f"'parallel_tool_calls' must be a boolean, got {parallel!r:.40}")
        constraint = tool_constraint(fmt, tools, choice, parallel, answer_schema=answer)
    except ValueError as exc:
        raise ValueError(f"prompt {record.get('id', '?')!r}: {exc}") from None
    return StructuredPrompt(record, {} if constraint is None else {"response_format": constraint}, fmt)


def check_run(prompt: StructuredPrompt, token_ids: Sequence[int], tokenizer: Any) -> dict:
    """A run's ``valid``, ``exact`` and first error (``answer_error``, or None), and for a tools prompt how many
    calls it made (``tool_calls``): its new tokens decoded (special tokens skipped), a tools prompt's calls read
    back in the model's format
    (:func:`speculant.structured.tool_calls.parse_tool_calls`), checked by
    :func:`speculant.data.answers.check_answer`."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    calls = None
    if prompt.tool_format is not None:
        from ..structured.tool_calls import parse_tool_calls

        parsed = parse_tool_calls(text, prompt.tool_format)
        text, calls = parsed.content or "", parsed.tool_calls
    report = check_answer(prompt.record, text, calls)
    return {"valid": report["valid"], "exact": report["exact"],
            "answer_error": report["errors"][0] if report["errors"] else None,
            **({} if calls is None else {"tool_calls": len(calls)})}


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
