"""``speculant bench`` on structured prompts (``builtin:json-extract``, ``builtin:tools``, or records with a
``response_format`` or ``tools``): every method decodes under the constraint, stays identical to ``ar``, and each
answer is checked; the constraint's mask time and forced tokens are reported per method."""

from __future__ import annotations

import json

import pytest

from helpers import cli_error_line, tool_model_pair
from speculant import cli
from speculant.bench import run_bench
from speculant.bench.report import structured_table
from speculant.bench.structured import summarise_structured

FLAG = {"type": "json_schema", "json_schema": {"name": "flag", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"], "additionalProperties": False,
    # llguidance's own option: no free whitespace (a random model would fill the budget with it)
    "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}}}
PICK = {"type": "function", "function": {"name": "pick", "description": "Pick a side.", "parameters": {
    "type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"],
    "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "stop", "description": "Stop.", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    return tool_model_pair(tmp_path_factory.mktemp("tool-models"), context=2048)  # 4 tools: ~1,200 tokens


def json_records() -> list[dict]:
    return [{"id": f"flag{i}", "messages": [{"role": "user", "content": f"Is it on? Case {i}."}],
             "response_format": FLAG, "reference": {"ok": True, "level": "low"}} for i in range(2)]


def test_json_prompts_decode_under_their_schema(chat_models, tmp_path):
    target, draft = chat_models
    results = run_bench(json_records(), methods=["chain:k=3"], baselines=[], target=target, draft=draft,
                        max_new_tokens=40, warmup=0, progress=False, out=tmp_path)
    assert results["settings"]["structured_prompts"] == 2 and "structured" in results["definitions"]
    for spec in ("ar", "chain:k=3"):
        s = results["methods"][spec]["structured"]
        assert s["checked"] == 2 and s["valid_share"] == 1.0  # short enough to finish: always valid
        assert s["exact_share"] in (0.0, 0.5, 1.0)
        assert 0 <= s["forced_token_share"] < 1 and s["mask_s_per_step"] > 0 and 0 < s["mask_share"] < 1
        for row in results["runs"][spec]:
            assert row["valid"] is True and row["answer_error"] is None and row["constraint_mask_s"] > 0
    assert results["methods"]["chain:k=3"]["identical_to_ar"] == 1.0  # lossless under the constraint too
    md = (tmp_path / "results.md").read_text()
    assert "## Structured output" in md and "| `chain:k=3` |" in md.split("## Structured output")[1]


def test_structured_prompts_refuse_baselines(chat_models):
    target, draft = chat_models
    with pytest.raises(ValueError, match="run our methods only, each under its constraint: pass --baselines none"):
        run_bench(json_records(), methods=["chain:k=3"], baselines=["hf-ar"], target=target, draft=draft,
                  progress=False)


def test_tool_prompts_call_a_tool(tool_models):
    target, draft = tool_models
    records = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"Go {i}."}], "tools": [OTHER, PICK],
                "tool_choice": "required", "expected": {"name": "pick", "arguments": {"side": "left"}}}
               for i in range(2)]
    records.append({**records[0], "id": "one", "parallel_tool_calls": False})
    records.append({"id": "auto", "messages": [{"role": "user", "content": "Go."}], "tools": [PICK],
                    "tool_choice": "auto", "expected": {"name": "pick", "arguments": {"side": "left"}}})
    results = run_bench(records, methods=["chain:k=3"], baselines=[], target=target, draft=draft,
                        max_new_tokens=40, warmup=0, progress=False)
    for spec in ("ar", "chain:k=3"):
        rows = results["runs"][spec]
        assert [r["valid"] for r in rows[:3]] == [True] * 3  # required: a call is forced
        assert rows[0]["forced_tokens"] >= 0 and rows[0]["constraint_mask_s"] > 0
        assert rows[2]["tool_calls"] == 1  # parallel_tool_calls false: exactly one call
        assert rows[3]["constraint_mask_s"] == 0  # auto: nothing forced, no masks
        assert results["methods"][spec]["structured"]["checked"] == 4
    assert results["methods"]["chain:k=3"]["identical_to_ar"] == 1.0


def test_cli_runs_the_structured_sets(chat_models, tool_models, capsys, tmp_path):
    for name, (target, draft), categories in (("json-extract", chat_models, {"package", "dependencies"}),
                                              ("tools", tool_models, {"auto", "required"})):
        code = cli.main(["bench", "--prompts", f"builtin:{name}", "--num-prompts", "2", "--methods", "chain:k=3",
                         "--baselines", "none", "--target", target, "--draft", draft, "--max-new-tokens", "6",
                         "--warmup", "0", "--out", str(tmp_path / name), "--json"])
        stdout, stderr = capsys.readouterr()
        assert code == 0, stderr
        obj = json.loads(stdout.strip().splitlines()[-1])
        assert obj["settings"]["prompts"] == f"builtin:{name}" and obj["settings"]["structured_prompts"] == 2
        assert set(obj["categories"]) == categories
        assert obj["methods"]["chain:k=3"]["identical_to_ar"] == 1.0
        assert obj["methods"]["chain:k=3"]["structured"]["checked"] == 2


def test_cli_errors_are_one_line(chat_models, capsys):
    target, draft = chat_models
    base = ["bench", "--num-prompts", "1", "--methods", "chain:k=3", "--target", target, "--draft", draft]
    cli_error_line(capsys, [*base, "--prompts", "builtin:json-extract"], "pass --baselines none")
    cli_error_line(capsys, [*base, "--prompts", "builtin:tools", "--baselines", "none"],
                   "prompt 'auto/000/", "no tool format")


def test_summarise_structured_pools_runs():
    rows = [{"valid": True, "exact": True, "target_calls": 4, "wall_s": 1.0, "prefill_s": 0.2,
             "constraint_mask_s": 0.04, "new_tokens": 10, "forced_tokens": 3},
            {"valid": False, "exact": None, "target_calls": 6, "wall_s": 1.2, "prefill_s": 0.2,
             "constraint_mask_s": 0.06, "new_tokens": 10, "forced_tokens": 1},
            {"tokens_per_second": 3.0}]  # not structured: left out
    s = summarise_structured(rows)
    assert s["checked"] == 2 and s["valid_share"] == 0.5 and s["exact_share"] == 1.0
    assert s["mask_s_per_step"] == pytest.approx(0.01) and s["mask_share"] == pytest.approx(0.1 / 1.8)
    assert s["forced_token_share"] == pytest.approx(0.2)
    assert summarise_structured(rows[2:]) is None
    results = {"methods": {"ar": {"acceptance_length": 1.0, "tokens_per_second": 2.0, "structured": s}}}
    assert "| `ar` | 1.00 | 2.0 | 50.0% (2) | 100.0% | 10.00 | 5.6% | 20.0% |" in structured_table(results)
