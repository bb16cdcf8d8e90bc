"""``speculant bench --prompts builtin:fim`` end to end on a tiny pair whose tokenizer has FIM tokens: prompts in
the model's FIM tokens, every method identical to ``ar`` at temperature 0, stops at the FIM end tokens; a target
without FIM tokens is a one-line error."""

from __future__ import annotations

import json

import pytest

from helpers import chat_model_pair, cli_error_line
from speculant import cli
from speculant.models.fim import fim_ids, fim_stop_ids
from speculant.models.loading import load_model_dir
from speculant.tiny_models import FIM_TOKENS


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def fim_dirs(tmp_path_factory) -> tuple[str, str]:
    return chat_model_pair(tmp_path_factory.mktemp("fim-bench"), layers=2, context=1024, special_tokens=FIM_TOKENS)


def test_bench_builtin_fim_end_to_end(fim_dirs, capsys, tmp_path):
    target, draft = fim_dirs
    code = cli.main(["bench", "--prompts", "builtin:fim", "--num-prompts", "3", "--methods", "chain:k=3,lookup",
                     "--baselines", "none", "--target", target, "--draft", draft, "--max-new-tokens", "8",
                     "--warmup", "0", "--out", str(tmp_path / "res"), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    obj = json.loads(stdout.strip().splitlines()[-1])
    assert obj["settings"]["prompts"] == "builtin:fim" and obj["settings"]["fim_prompts"] == 3
    for spec in ("chain:k=3", "lookup"):
        assert obj["methods"][spec]["identical_to_ar"] == 1.0, spec  # the share of identical runs
    _, tok = load_model_dir(target)
    assert set(fim_stop_ids(tok)) <= set(obj["settings"]["eos_token_id"])
    results = json.loads((tmp_path / "res" / "results.json").read_text())
    for p in results["prompts"]:  # built in the model's FIM tokens
        assert p["tokens"] == len(fim_ids(tok, p["prefix"], p["suffix"])) and p["middle"]


def test_bench_fim_on_a_model_without_fim_tokens_is_one_line(chat_models, capsys):
    target, draft = chat_models
    cli_error_line(capsys, ["bench", "--prompts", "builtin:fim", "--num-prompts", "1", "--methods", "chain:k=3",
                            "--baselines", "none", "--target", target, "--draft", draft, "--max-new-tokens", "4",
                            "--warmup", "0"], "no fill-in-the-middle tokens")
