"""``builtin:fim`` (:mod:`speculant.data.fim`): deterministic fill-in-the-middle records cut from the held-out
standard-library modules, never an empty span, the prefix ending and the suffix starting at the cut; FIM records
in JSONL files and their checks."""

from __future__ import annotations

import json

import pytest

from speculant.data.fim import fim_prompts
from speculant.data.prompts import check_record, is_fim, load_prompts, prompt_ids
from speculant.data.stdlib_functions import split_docs
from speculant.tiny_models import FIM_TOKENS, tiny_tokenizer


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_prompts("builtin:fim")


def test_records_are_deterministic_and_independent_of_how_many(records):
    assert len(records) == 24 and len({r["id"] for r in records}) == 24
    assert load_prompts("builtin:fim") == records
    assert load_prompts("builtin:fim", n=5) == records[:5]
    other = fim_prompts(24, seed=1)  # another seed: the same functions, other spans
    assert [r["id"] for r in other] == [r["id"] for r in records]
    assert any(a["middle"] != b["middle"] for a, b in zip(other, records))


def test_spans_are_whole_nonempty_lines_of_a_body_between_prefix_and_suffix(records):
    modules = {doc.module: doc.text for doc in split_docs("test")}
    for r in records:
        middle = r["middle"]
        assert middle.strip() and middle.endswith("\n") and 1 <= middle.count("\n") <= 8, r["id"]
        assert r["category"] == ("single-line" if middle.count("\n") == 1 else "multi-line")
        assert r["prefix"].endswith("\n") and 0 < len(r["prefix"]) <= 1200 and len(r["suffix"]) <= 800
        assert r["prefix"] + middle + r["suffix"] in modules[r["id"].rsplit(".", 1)[0]], r["id"]
        assert is_fim(r) and check_record(r, "x") is r
    assert {r["category"] for r in records} == {"single-line", "multi-line"}


def test_fim_records_need_fim_tokens(records):
    fim_tok = tiny_tokenizer(vocab_size=300, special_tokens=FIM_TOKENS)
    ids = prompt_ids(records[0], fim_tok)
    assert ids[0] == fim_tok.convert_tokens_to_ids("<|fim_prefix|>")
    assert ids[-1] == fim_tok.convert_tokens_to_ids("<|fim_middle|>")
    with pytest.raises(ValueError, match=f"prompt {records[0]['id']!r}: .*no fill-in-the-middle tokens"):
        prompt_ids(records[0], tiny_tokenizer(vocab_size=300))


@pytest.mark.parametrize("row, needle", [
    ({"prefix": "a"}, "needs 'prefix' and 'suffix' strings"),
    ({"prefix": 1, "suffix": ""}, "needs 'prefix' and 'suffix' strings"),
    ({"prefix": "", "suffix": ""}, "both empty"),
    ({"prefix": "a", "suffix": "b", "extra": "c"}, "extra must be a list"),
    ({"prefix": "a", "suffix": "b", "prompt": "c"}, "give one of"),
])
def test_bad_fim_rows_are_one_line_errors(tmp_path, row, needle):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=needle):
        load_prompts(f)


def test_jsonl_fim_rows_keep_their_files(tmp_path):
    f = tmp_path / "p.jsonl"
    row = {"prefix": "def f():\n", "suffix": "\n", "extra": [{"filename": "a.py", "text": "x = 1\n"}]}
    f.write_text(json.dumps(row) + "\n")
    (got,) = load_prompts(f)
    fim_tok = tiny_tokenizer(vocab_size=300, special_tokens=FIM_TOKENS)
    assert fim_tok.decode(prompt_ids(got, fim_tok)).startswith("<|repo_name|>")
