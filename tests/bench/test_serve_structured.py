"""``speculant bench serve`` with the structured workloads: records go with their ``response_format`` or ``tools``,
streamed tool calls are put together, and every answer is checked (valid and exact shares per level)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from speculant.bench.serve_load import LoadSettings, _body, _request, _summary
from speculant.bench.serve_report import render_markdown, structured_table
from speculant.data.answers import check_answer, is_structured
from speculant.data.json_extract import json_extract_prompts
from speculant.data.tools import tools_prompts

SETTINGS = LoadSettings(url="http://127.0.0.1:1")


@pytest.fixture(scope="module")
def json_record():
    return json_extract_prompts(1)[0]


@pytest.fixture(scope="module")
def tool_record():
    return tools_prompts(2)[1]


def test_body_carries_the_constraint(json_record, tool_record):
    path, body = _body(json_record, "m", SETTINGS)
    assert path == "/v1/chat/completions" and body["response_format"] == json_record["response_format"]
    assert "tools" not in body
    path, body = _body(tool_record, "m", SETTINGS)
    assert body["tools"] == tool_record["tools"] and body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is False
    assert "response_format" not in body
    _, plain = _body({"id": "p", "messages": [{"role": "user", "content": "hi"}]}, "m", SETTINGS)
    assert not {"tools", "tool_choice", "parallel_tool_calls", "response_format"} & set(plain)


def sse(chunks: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def content_chunks(text: str) -> list[dict]:
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    return [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces] + [
        {"choices": [], "usage": {"completion_tokens": len(pieces)}}]


def tool_chunks(name: str, arguments: str) -> list[dict]:
    head = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": name, "arguments": ""}}]}}]}
    parts = [arguments[i:i + 5] for i in range(0, len(arguments), 5)]
    rest = [{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}}]}
            for p in parts]
    return [head, *rest, {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"completion_tokens": len(parts) + 1}}]


def answered(record: dict, chunks: list[dict]):
    def handler(request):
        return httpx.Response(200, content=sse(chunks), headers={"content-type": "text/event-stream"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _request(client, "http://127.0.0.1:1", record, "m", SETTINGS, {})

    return asyncio.run(run())


def test_a_json_answer_is_checked(json_record):
    good = answered(json_record, content_chunks(json.dumps(json_record["reference"])))
    assert (good.error, good.valid, good.exact) == (None, True, True) and good.ttft_s is not None
    wrong = dict(json_record["reference"])
    key = next(k for k, v in wrong.items() if isinstance(v, str))
    wrong[key] += "!"
    assert (answered(json_record, content_chunks(json.dumps(wrong))).valid,
            answered(json_record, content_chunks(json.dumps(wrong))).exact) == (True, False)
    broken = answered(json_record, content_chunks(json.dumps(json_record["reference"])[:-1]))
    assert (broken.valid, broken.exact) == (False, False)


def test_streamed_tool_calls_are_put_together_and_checked(tool_record):
    expected = tool_record["expected"]
    good = answered(tool_record, tool_chunks(expected["name"], json.dumps(expected["arguments"])))
    assert (good.error, good.valid, good.exact) == (None, True, True)
    assert good.ttft_s is not None and good.completion_tokens > 1
    other = next(t["function"]["name"] for t in tool_record["tools"] if t["function"]["name"] != expected["name"])
    wrong_tool = answered(tool_record, tool_chunks(other, json.dumps(expected["arguments"])))
    assert wrong_tool.exact is False
    text_only = answered(tool_record, content_chunks("I would call a tool."))
    assert (text_only.valid, text_only.exact) == (False, False)
    assert answered(tool_record, tool_chunks(expected["name"], "{\"broken\"")).valid is False


def test_level_summary_and_report(json_record, tool_record):
    expected = tool_record["expected"]
    results = [answered(json_record, content_chunks(json.dumps(json_record["reference"]))),
               answered(json_record, content_chunks("{}")),
               answered(tool_record, tool_chunks(expected["name"], json.dumps(expected["arguments"]))),
               answered({"id": "plain", "messages": [{"role": "user", "content": "hi"}]}, content_chunks("hello"))]
    level = _summary(1, results, 1.0, None)
    assert level["structured"] == {"checked": 3, "valid_share": 2 / 3, "exact_share": 2 / 3}
    assert _summary(1, results[3:], 1.0, None)["structured"] is None
    results_doc = {"levels": [level], "settings": {**SETTINGS.__dict__, "prompts": "builtin:json-extract"},
                   "num_prompts": 2, "model": "m", "client": {"platform": "x"}}
    table = structured_table(results_doc)
    assert "| 1 | 3 | 66.7% | 66.7% |" in table
    assert "## Structured answers" in render_markdown(results_doc)
    assert structured_table({"levels": [_summary(1, results[3:], 1.0, None)]}) == ""


def test_check_answer_dispatches(json_record, tool_record):
    assert is_structured(json_record) and is_structured(tool_record)
    assert not is_structured({"messages": []}) and check_answer({"messages": []}, "x") is None
    assert not is_structured({"response_format": {"type": "text"}})
    call = {"id": "c", "type": "function", "function": {"name": tool_record["expected"]["name"],
                                                        "arguments": json.dumps(tool_record["expected"]["arguments"])}}
    assert check_answer(tool_record, "", [call])["exact"] is True  # whole tool calls or their functions
    assert check_answer({"response_format": {"type": "json_object"}}, '{"a": 1}')["valid"] is True
