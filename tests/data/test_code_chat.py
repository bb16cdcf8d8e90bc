"""``builtin:code-chat``: coding requests as chats made from the held-out standard library (no public benchmark
set), half "write a function", half "edit this code" with a planted bug where asked to fix one."""

from __future__ import annotations

import ast
import collections
import random
import re

import pytest

from speculant.data.code_chat import CATEGORIES, EDIT_TASKS, code_chat_prompts, plant_bug
from speculant.data.prompts import BUILTIN_SETS, check_record, load_prompts

FENCE = re.compile(r"```python\n(.*?)```", re.S)


@pytest.fixture(scope="module")
def records():
    return load_prompts("builtin:code-chat")


def test_registered_with_80_records_and_balanced_categories(records):
    assert BUILTIN_SETS["code-chat"] is code_chat_prompts
    assert len(records) >= 80 and len({r["id"] for r in records}) == len(records)
    counts = collections.Counter(r["category"] for r in records)
    assert set(counts) == set(CATEGORIES)
    assert counts["write"] == sum(counts[t] for t in EDIT_TASKS)  # half write, half edit
    assert len({counts[t] for t in EDIT_TASKS}) == 1  # the edit tasks equally often
    first = [r["category"] for r in records[:10]]  # any prefix is balanced: the categories alternate
    assert first == ["write", "rename", "write", "type-hints", "write", "class", "write", "fix", "write", "rename"]
    assert len({r["module"].split(".")[0] for r in records}) >= 5  # spread over modules


def test_deterministic(records):
    assert code_chat_prompts() == records
    assert load_prompts("builtin:code-chat", 6) == records[:6]
    other = code_chat_prompts(seed=1)
    assert [r["id"] for r in other] == [r["id"] for r in records]  # the seed only moves the planted bugs
    assert [r.get("bug") for r in other] != [r.get("bug") for r in records]


def test_records_are_chats_in_the_prompt_record_format(records):
    for r in records:
        check_record(r, r["id"])
        (message,) = r["messages"]
        assert message["role"] == "user" and message["content"].strip()
        assert "humaneval" not in repr(r).lower() and "mbpp" not in repr(r).lower()


def test_write_requests_name_a_signature_and_ask_for_a_docstring(records):
    for r in (r for r in records if r["category"] == "write"):
        content = r["messages"][0]["content"]
        assert re.match(r"Write a Python function `\w+\(.*\)` that ", content), content
        assert content.endswith("Include a docstring.") and "```" not in content
        assert 4 <= r["source"].count("\n") <= 60


def test_every_edit_prompt_holds_compilable_python(records):
    for r in (r for r in records if r["category"] != "write"):
        (code,) = FENCE.findall(r["messages"][0]["content"])
        compile(code, r["id"], "exec")
        assert 4 <= code.count("\n") <= 60, r["id"]
        defs = [n for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert len(defs) == (2 if r["category"] == "class" else 1), r["id"]
        if r["category"] != "fix":
            assert code == r["source"]


def test_every_planted_bug_changes_the_source(records):
    fixes = [r for r in records if r["category"] == "fix"]
    assert fixes and all(r["bug"]["kind"] in ("comparison", "off-by-one") for r in fixes)
    for r in fixes:
        (buggy,) = FENCE.findall(r["messages"][0]["content"])
        assert ast.dump(ast.parse(buggy)) != ast.dump(ast.parse(r["source"]))
        changed = [i + 1 for i, (a, b) in enumerate(zip(buggy.splitlines(), r["source"].splitlines())) if a != b]
        assert changed == [r["bug"]["line"]], r["id"]  # one line, the one the record names
        assert r["bug"]["now"] in buggy.splitlines()[r["bug"]["line"] - 1]


@pytest.mark.parametrize("source, kinds", [
    ("def f(xs, n):\n    if len(xs) < n:\n        return xs[1:]\n    return xs\n", {"comparison", "off-by-one"}),
    ("def f(a, b):\n    return a is not b\n", {"comparison"}),
    ("def f(a):\n    return a[0] + 2\n", {"off-by-one"}),
])
def test_plant_bug_flips_a_comparison_or_shifts_an_integer(source, kinds):
    seen = set()
    for seed in range(20):
        buggy, bug = plant_bug(source, random.Random(seed))
        assert buggy != source and bug["kind"] in kinds
        compile(buggy, "<bug>", "exec")
        seen.add(bug["kind"])
    assert seen == kinds
    assert plant_bug(source, random.Random(3)) == plant_bug(source, random.Random(3))


def test_plant_bug_needs_a_place():
    assert plant_bug("def f(a):\n    return a\n", random.Random(0)) is None


def test_bad_size():
    with pytest.raises(ValueError, match="the number of prompts must be an integer >= 1, got 0"):
        code_chat_prompts(0)
