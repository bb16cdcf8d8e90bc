"""Decoding at long context under a KV budget: what eviction costs and saves once the prompt is read.

Each prompt is one of the longest held-out standard-library modules (:func:`speculant.bench.kv_fidelity.
default_texts`), cut on a line boundary to fill ``length`` tokens with the chat frame, then a request to rewrite one
of its functions (picked with a seed among those the cut keeps) with type hints: the answer copies from the
context, as an edit request to a code assistant does, so it needs the function's keys and values to survive
eviction, and a drafter has something to draft.

Every method decodes every prompt twice, with the full cache and under the budget (the prompt prefilled block-wise
evicting to ``budget``, committed tokens evicted after every verification step, :func:`speculant.generate`'s
``kv_policy``), all (method, cache) runs of one prompt one after the other (interleaved), after an untimed
warm-up. A row records the whole request (``wall_s``), its prefill, decoding tokens/s (new tokens over the time
after the prefill), τ and the peak KV bytes; the summary compares each method's budgeted output with its
full-cache output (first difference) and each budgeted method's with plain decoding's under the same budget.
Under eviction a method's output is exact given its own evicted cache, and caches evicted after steps of
different lengths differ: budgeted outputs of two methods can part where full-cache ones cannot.
"""

from __future__ import annotations

import ast
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .kv_fidelity import default_texts
from .speed import first_difference

__all__ = ["LongPrompt", "long_code_prompts", "run_kv_decode"]

REQUEST = ("Rewrite the function `{name}` from the module above with type hints on every parameter and on its "
           "return value. Reply with the function only, in a Python code block.")
"""The user's request after the module; ``{name}`` is the function's qualified name."""

WARMUP_TOKENS = 1024
"""Prompt tokens of the untimed warm-up runs (the start of the first prompt)."""


@dataclass(frozen=True)
class LongPrompt:
    """One long-context request: chat ``input_ids`` of about ``length`` tokens over ``module``'s first
    ``lines`` lines, asking for ``function`` (defined at ``depth``: its first line's share of the kept lines)."""

    module: str
    function: str
    depth: float
    lines: int
    input_ids: list[int]


def _functions(tree: ast.Module) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, last line)`` (1-based) of every function and method of ``tree``."""
    found: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child.lineno, child.end_lineno or child.lineno))
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(tree, "")
    return found


def long_code_prompts(tokenizer, length: int, n: int, seed: int = 0, min_lines: int = 3,
                      max_lines: int = 40) -> list[LongPrompt]:
    """``n`` requests of at most ``length`` tokens each, one per held-out module (the longest first).

    The module's source is cut to whole lines so that the chat (module in a code block, then :data:`REQUEST`)
    fits ``length`` tokens; the function asked for is picked with ``random.Random(seed)`` among those of
    ``min_lines``..``max_lines`` lines inside the cut. A module shorter than ``length`` or without such a function
    is passed over for the next longest; a ValueError when fewer than ``n`` of the ``max(4 n, 32)`` longest
    qualify."""
    from ..models.chat import chat_ids

    rng = random.Random(seed)
    prompts = []
    frame = len(chat_ids(tokenizer, "```python\n```\n" + REQUEST.format(name="a.b_c"))) + 16  # names vary
    for module, source in default_texts(max(4 * n, 32)).items():
        if len(prompts) == n:
            break
        lines = source.splitlines(keepends=True)
        kept, total = 0, 0
        while kept < len(lines):
            width = len(tokenizer(lines[kept], add_special_tokens=False)["input_ids"])
            if total + width > length - frame:
                break
            total += width
            kept += 1
        fits = [f for f in _functions(ast.parse(source)) if f[2] <= kept and min_lines <= f[2] - f[1] + 1 <= max_lines]
        if kept == len(lines) or not fits:
            continue
        name, first, last = fits[rng.randrange(len(fits))]
        code = "".join(lines[:kept])
        ids = chat_ids(tokenizer, f"```python\n{code}```\n" + REQUEST.format(name=name))
        while len(ids) > length and kept > 1:  # the frame was an estimate: cut a line more
            kept -= 1
            code = "".join(lines[:kept])
            ids = chat_ids(tokenizer, f"```python\n{code}```\n" + REQUEST.format(name=name))
        if last > kept:  # the cut no longer holds the whole function asked for
            continue
        prompts.append(LongPrompt(module, name, (first - 1) / kept, kept, ids))
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} held-out modules are longer than {length} tokens with a function of "
                         f"{min_lines}-{max_lines} lines in their first {length} tokens; ask for fewer prompts")
    return prompts


def _row(gen, method: str, cache: str, prompt: int) -> dict:
    s = gen.stats
    decode_s = s.wall_s - s.prefill_s
    return {"method": method, "cache": cache, "prompt": prompt, "token_ids": list(gen.token_ids),
            "new_tokens": s.new_tokens, "wall_s": s.wall_s, "prefill_s": s.prefill_s, "decode_s": decode_s,
            "decode_tokens_per_s": s.new_tokens / decode_s if decode_s > 0 else 0.0,
            "acceptance_length": s.acceptance_length, "kv_peak_bytes": s.kv_peak_bytes}


def _agreement(a: Sequence[int], b: Sequence[int]) -> dict:
    """Whether two outputs are the same, and where they part (None: the same tokens)."""
    first = first_difference(a, b)
    return {"identical": first is None, "first_difference": first}


@torch.no_grad()
def run_kv_decode(session, prompts: Sequence[LongPrompt], methods: Sequence[str], policy: str, budget_fraction: float,
                  block: int, max_new_tokens: int, warmup: int = 1,
                  progress: Callable[[dict], None] | None = None) -> dict:
    """Every method with the full cache and under ``policy`` at ``budget_fraction`` of each prompt, interleaved.

    ``session``: a loaded :class:`speculant.Session` (its target, draft and tokenizer; its own KV settings are not
    used). Returns ``{"rows": [...], "summary": {"METHOD/CACHE": {...}}, "agreement": [...]}``: medians over the
    prompts of whole-request seconds, prefill seconds, decoding tokens/s and τ, the largest peak KV, and ratios
    against plain decoding with the full cache (``ar/full``); ``agreement`` per prompt and method."""
    from ..core import engine
    from ..kv.budget import fraction_budget
    from ..kv.registry import resolve_eviction
    from ..models.chat import stop_ids

    stops = stop_ids(session.tokenizer, session.target)
    parsed = {m: session.parse(m) for m in methods}
    evict = resolve_eviction(policy)
    evict.bind_draft(session.draft)  # SpecKV drafts with the session's draft; the others ignore it

    def one(method: str, ids: list[int], budget: int | None, new_tokens: int):
        kv = {} if budget is None else {"kv_policy": evict, "kv_budget": budget, "kv_block": block}
        return engine.generate(session.target, ids, drafter=session.drafter(parsed[method]),
                               max_new_tokens=new_tokens, eos_token_id=stops, **kv, **parsed[method].engine)

    runs = [(m, c) for m in methods for c in ("full", "budget")]
    short = prompts[0].input_ids[:WARMUP_TOKENS]  # warm-up: every code path once, not a long prefill
    for _ in range(warmup):
        for m, c in runs:
            one(m, short, None if c == "full" else fraction_budget(budget_fraction, len(short)), 8)
    rows: list[dict] = []
    for i, p in enumerate(prompts):
        budget = fraction_budget(budget_fraction, len(p.input_ids))
        for m, c in runs:
            row = {**_row(one(m, p.input_ids, None if c == "full" else budget, max_new_tokens), m, c, i),
                   "budget": None if c == "full" else budget, "prompt_tokens": len(p.input_ids)}
            rows.append(row)
            if progress is not None:
                progress(row)
    return {"rows": rows, "summary": summarise(rows), "agreement": agreement(rows)}


def summarise(rows: Sequence[dict]) -> dict:
    """Medians per ``METHOD/CACHE`` and ratios against ``ar/full`` (see :func:`run_kv_decode`)."""
    keys = list(dict.fromkeys(f"{r['method']}/{r['cache']}" for r in rows))
    out: dict[str, dict] = {}
    for key in keys:
        mine = [r for r in rows if f"{r['method']}/{r['cache']}" == key]
        out[key] = {name: statistics.median(r[name] for r in mine)
                    for name in ("wall_s", "prefill_s", "decode_s", "decode_tokens_per_s", "acceptance_length",
                                 "new_tokens")}
        out[key]["kv_peak_bytes"] = max(r["kv_peak_bytes"] for r in mine)
        out[key]["prompts"] = len(mine)
    base = out.get("ar/full")
    for key, s in out.items():
        if base:
            s["wall_ratio_vs_ar_full"] = base["wall_s"] / s["wall_s"] if s["wall_s"] else None
            s["decode_speedup_vs_ar_full"] = (s["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                                              if base["decode_tokens_per_s"] else None)
        method, cache = key.rsplit("/", 1)
        full = out.get(f"{method}/full")
        if cache == "budget" and full:
            s["decode_speedup_vs_own_full"] = (s["decode_tokens_per_s"] / full["decode_tokens_per_s"]
                                               if full["decode_tokens_per_s"] else None)
            s["wall_ratio_vs_own_full"] = full["wall_s"] / s["wall_s"] if s["wall_s"] else None
    return out


def agreement(rows: Sequence[dict]) -> list[dict]:
    """Per prompt and method: the budgeted output against the method's full-cache output, the full-cache output
    against plain decoding's (exactness: always identical in float32), and the budgeted output against plain
    decoding's under the same budget."""
    by = {(r["prompt"], r["method"], r["cache"]): r["token_ids"] for r in rows}
    out = []
    for (prompt, method, cache), ids in by.items():
        if cache != "budget":
            continue
        entry = {"prompt": prompt, "method": method,
                 "budget_vs_full": _agreement(ids, by[(prompt, method, "full")])}
        if method != "ar" and (prompt, "ar", "full") in by:
            entry["full_vs_ar_full"] = _agreement(by[(prompt, method, "full")], by[(prompt, "ar", "full")])
            entry["budget_vs_ar_budget"] = _agreement(ids, by[(prompt, "ar", "budget")])
        out.append(entry)
    return out
