"""Command-line edges of issue 32 item 13: a draft given to a method that drafts without one warns once, ``train
draft`` without prompts is a one-line error that leaves no run directory, and every default shows once in the
``train`` help."""

from __future__ import annotations

import json
import re

import pytest

import speculant.core.checks
from speculant import cli

from helpers import chat_model_pair

PROMPT = "def add(a, b):\n    return a + b\n\n"


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = chat_model_pair(tmp_path_factory.mktemp("edges"), layers=2)
    return str(target), str(draft)


@pytest.mark.parametrize("method", ["ar", "lookup", "mask-probe"])
def test_a_draft_unused_by_the_method_warns_once(pair, capsys, monkeypatch, method):
    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    argv = ["generate", PROMPT, "--target", pair[0], "--draft", pair[1], "--method", method, "--max-new-tokens",
            "2", "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["token_ids"]
    assert err.splitlines() == [f"speculant: WARNING: method {method!r} drafts without a model: --draft is not used"]


def test_a_draft_the_method_uses_does_not_warn(pair, capsys, monkeypatch):
    monkeypatch.setattr(speculant.core.checks, "_WARNED", set())
    argv = ["generate", PROMPT, "--target", pair[0], "--draft", pair[1], "--method", "chain:k=2",
            "--max-new-tokens", "2", "--json"]
    assert cli.main(argv) == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("extra, message", [
    (["--num-prompts", "0"], "--num-prompts 0: no prompts to answer; give --num-prompts N (N >= 1), a --prompts "
     "file, or --self-prompts N"),
    (["--num-prompts", "-3"], "--num-prompts must be >= 0, got -3"),
    (["--prompts", "EMPTY"], "--prompts: no prompts in "),
    (["--prompts", "BLANK"], "--prompts: no prompts in "),
])
def test_train_draft_without_prompts_is_refused_before_the_run_directory(pair, capsys, tmp_path, extra, message):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    extra = [str(tmp_path / f"{e.lower()}.jsonl") if e in ("EMPTY", "BLANK") else e for e in extra]
    out = tmp_path / "run"
    code = cli.main(["train", "draft", "--target", pair[0], "--out", str(out), "--steps", "1", *extra])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"speculant: error: {message}"), err
    assert "prompt '1'" not in err
    assert not out.exists()


@pytest.mark.parametrize("action", ["draft", "model", "distill-data", "calibrate", "prepare"])
def test_train_help_shows_each_default_once(capsys, action):
    assert cli.main(["train", action, "--help"]) == 0
    text = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    assert len(options) > 3
    for option in options:
        assert len(re.findall(r"default:", option)) <= 1, option
    flat = " ".join(text.split())
    if action == "draft":  # said in words by the help text, not restated by the formatter
        assert "default: the built-in instruction prompts --num-prompts" in flat and "(default: None)" not in flat
