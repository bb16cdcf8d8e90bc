"""``speculant bench`` on the structured workloads (``builtin:json-extract``, ``builtin:tools``): the sets load
from the command line and run through the chat template on the tiny chat pair."""

from __future__ import annotations

import json

import pytest

from speculant import cli


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.mark.parametrize("name, categories", [("json-extract", {"package", "dependencies"}),
                                              ("tools", {"auto", "required"})])
def test_cli_runs_the_structured_sets(chat_models, capsys, tmp_path, name, categories):
    target, draft = chat_models
    code = cli.main(["bench", "--prompts", f"builtin:{name}", "--num-prompts", "2", "--methods", "chain:k=3",
                     "--baselines", "none", "--target", target, "--draft", draft, "--max-new-tokens", "4",
                     "--warmup", "0", "--out", str(tmp_path / "res"), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    obj = json.loads(stdout.strip().splitlines()[-1])
    assert obj["settings"]["prompts"] == f"builtin:{name}" and obj["settings"]["chat_prompts"] == 2
    assert set(obj["categories"]) == categories
    assert obj["methods"]["chain:k=3"]["identical_to_ar"] == 1.0
