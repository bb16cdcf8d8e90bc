"""``speculant bench serve`` against a running ``speculant serve`` with the structured sets: ``builtin:tools``
requests carry their tools and tool_choice, ``builtin:json-extract`` requests their response_format, and every
level reports the answers checked (the share valid and exact) beside the latencies."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from helpers import start_server, stop_server, tool_model_pair  # noqa: E402
from speculant import cli  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-serve")
    target, draft = tool_model_pair(root, context=2048)  # 4 tools: prompts of ~1,200 tokens
    proc, url = start_server(["--target", target, "--draft", draft, "--method", "chain:k=3", "--max-batch", "2"],
                             root / "stderr.txt", ready=True)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.mark.parametrize("name", ["tools", "json-extract"])
def test_bench_serve_checks_structured_answers(server, tmp_path, capsys, name):
    out = tmp_path / name
    code = cli.main(["bench", "serve", "--url", server, "--prompts", f"builtin:{name}", "--concurrency", "1,2",
                     "--requests", "4", "--max-tokens", "96", "--warmup", "0", "--out", str(out), "--json"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    for lv in results["levels"]:
        assert lv["completed"] == 4 and lv["failed"] == 0
        st = lv["structured"]
        assert st["checked"] == 4 and 0 <= st["valid_share"] <= 1 and 0 <= st["exact_share"] <= 1
        assert all(r["valid"] is not None for r in lv["per_request"])
    if name == "tools":  # tool_choice required forces a call (one finishes within 96 tokens), read back in full
        assert all(lv["structured"]["valid_share"] > 0 for lv in results["levels"])
    md = (out / "results.md").read_text()
    assert "## Structured answers" in md and "| 1 | 4 |" in md
