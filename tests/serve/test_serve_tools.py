"""Tools and structured outputs on the server: the official ``openai`` client reads tool calls (whole and streamed,
``finish_reason: "tool_calls"``, ``content: null``), the chat template renders the tools and a conversation's calls
and results, ``tool_choice: "none"`` renders no tools, text that is no call stays content, and every bad tool, tool
choice or ``response_format`` is an OpenAI-style 400 after which the server goes on serving. With constrained
decoding installed (``speculant.structured.compile_response_format``), ``tool_choice`` ``required`` or a named
function makes even a random tiny model call the tool, and ``response_format`` makes it write JSON.

In-process apps (FastAPI's TestClient, which is an ``httpx.Client``, so the ``openai`` client runs over it) serve a
tiny model whose template has a tool format (:func:`helpers.tool_model_pair`); scripted replies (the worker's
``submit`` replaced) stand for a model that writes calls by itself."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from helpers import serve_settings, tool_model_pair, until_loaded  # noqa: E402
from speculant.serve import create_app  # noqa: E402
from speculant.serve.worker import Result  # noqa: E402

MODEL = "tiny-chat"
LOCAL = "http://127.0.0.1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _constrained() -> bool:
    try:
        from speculant.structured import compile_response_format  # noqa: F401
    except ImportError:
        return False
    return True


needs_constraints = pytest.mark.skipif(not _constrained(), reason="constrained decoding "
                                       "(speculant.structured.compile_response_format) is not installed")


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory) -> dict:
    target, draft = tool_model_pair(tmp_path_factory.mktemp("tool-models"))
    return {"target": target, "draft": draft}


@pytest.fixture(scope="module")
def app_client(tool_models):
    with TestClient(create_app(serve_settings(tool_models)), base_url=LOCAL) as client:
        until_loaded(client)
        yield client


@pytest.fixture
def client(app_client):
    return openai.OpenAI(base_url=LOCAL + "/v1", api_key="none", http_client=app_client, max_retries=0)


@pytest.fixture
def scripted(app_client, monkeypatch):
    """``scripted(pieces)``: the next requests' replies are these text pieces, then ``finish_reason`` ``stop``."""
    worker = app_client.app.state.worker

    def script(pieces: list[str]) -> None:
        def submit(job):
            for piece in pieces:
                if job.sources:
                    job.emit("sources", {"sources": [[len(piece), "draft"]], "tokens": 2, "accepted": 1})
                job.emit("text", piece)
            job.emit("done", Result("stop", len(job.ids), len(pieces), {"method": "chain:k=4"}))

        monkeypatch.setattr(worker, "submit", submit)

    return script


def _still_serves(app_client) -> None:
    r = app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 3})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------- replies


def test_the_client_reads_a_tool_call(client, scripted):
    scripted(["I will look. ", CALL[:20], CALL[20:], "\n"])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look."
    call, = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    scripted([CALL, "\n", CALL.replace("get_weather", "now").replace('{"city": "Paris"}', "{}")])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], tool_choice="auto")
    assert r.choices[0].message.content is None
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "now"]


def test_the_client_reads_streamed_tool_calls(client, scripted):
    pieces = ["Checking", " now. <tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "\n</tool_call>\n<tool_call>\n", '{"name": "now", "arguments": {}}\n</tool_call>']
    scripted(pieces)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "Checking now."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "now"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and calls[1]["id"].startswith("call_")
    # the openai client's own accumulation of a stream
    scripted(pieces)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, NOW]) as s:
        final = s.get_final_completion()
    assert [c.function.name for c in final.choices[0].message.tool_calls] == ["get_weather", "now"]


def test_streamed_calls_keep_the_step_counts_of_speculant_sources(app_client, scripted):
    """``speculant_sources``: text the parser holds back still counts its steps (in a later chunk); a plain answer
    keeps its spans."""
    pieces = ["Hi", " <tool_", "call>\n", '{"name": "now", "arguments": {}}', "\n</tool_call>"]
    scripted(pieces)
    body = {"model": MODEL, "messages": ASK, "tools": [NOW], "stream": True, "speculant_sources": True}
    with app_client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    marks = [c["speculant"] for c in chunks if "sources" in c.get("speculant", {})]
    assert sum(m["tokens"] for m in marks) == 2 * len(pieces)
    assert marks[0]["sources"] == [[2, "draft"]] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_text_that_is_no_call_stays_content(client, scripted):
    for text in ("<tool_call>\nnot json\n</tool_call>", CALL.replace("get_weather", "unknown"), "just text"):
        scripted([text])
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
    scripted([CALL])  # tool_choice none: a call is just text
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


# ---------------------------------------------------------------------------------------------- prompts


def _prompt(app_client, **body) -> str:
    from transformers import AutoTokenizer

    r = app_client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "return_token_ids": True,
                                                      **body})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(app_client.app.state.worker.settings.target)
    return tok.decode(r.json()["prompt_token_ids"])


def test_the_template_renders_tools_calls_and_results(app_client):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    text = _prompt(app_client, messages=history, tools=[WEATHER])
    assert '"name": "get_weather"' in text.split("<s>user")[0]  # the tools, in the template's system turn
    assert CALL in text and "<s>tool\nsunny, 21 C</s>" in text  # arguments rendered as an object (tojson)
    assert "Tools:" not in _prompt(app_client, messages=ASK, tools=[WEATHER], tool_choice="none")


# ---------------------------------------------------------------------------------------------- 400s


BAD = [
    ("schema that does not parse", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}]}, "tools[0].function.parameters"),
    ("unsupported schema feature", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}]},
     "tools[0].function.parameters"),
    ("tool_choice naming a missing tool", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tools not an array", {"tools": {"type": "function"}}, "tools"),
    ("tool without a function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("tool of another type", {"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools[0].function.name"),
    ("parallel_tool_calls not a boolean", {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("response_format of unknown type", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("response_format not an object", {"response_format": "json"}, "response_format"),
    ("json_schema without its object", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("json_schema strict not a boolean", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ("response_format with a forced tool", {"tools": [WEATHER], "tool_choice": "required",
                                            "response_format": {"type": "json_object"}}, "response_format"),
    ("tool message without its call id", {"messages": [*ASK, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ("call arguments not JSON", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("tool_calls on a user message", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize("name,extra,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tools_and_formats_are_400s_and_the_server_goes_on(app_client, name, extra, param):
    r = app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 3, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"], err
    _still_serves(app_client)


def test_bad_schemas_are_400s_once_the_tokenizer_is_known(app_client):
    if not _constrained():
        pytest.skip("constrained decoding is not installed")
    body = {"model": MODEL, "messages": ASK, "max_tokens": 3}
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
                {"type": "regex", "pattern": "(?<=a)b"}, {"type": "grammar", "grammar": "start: nothing_here"}):
        r = app_client.post("/v1/chat/completions", json={**body, "response_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        _still_serves(app_client)


def test_tools_for_a_model_without_a_tool_format_are_400(models):
    """The plain tiny chat pair's template renders no tools: 400 naming 'tools'; tool_choice 'none' is fine."""
    with TestClient(create_app(serve_settings(models)), base_url=LOCAL) as c:
        until_loaded(c)
        body = {"model": MODEL, "messages": ASK, "max_tokens": 3, "tools": [WEATHER]}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools" and "model's chat template has no tool format" in err["message"]
        assert c.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
        assert c.post("/v1/chat/completions", json={**body, "tools": []}).status_code == 200


# ---------------------------------------------------------------------------------------------- constrained


@needs_constraints
@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_force_a_call(client, stream):
    """A random tiny model calls the tool when it must: the grammar leaves it nothing else to write (the arguments
    are bounded, so the call ends well within max_tokens, and then only the end of the turn may follow)."""
    city = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}
    for choice in ("required", {"type": "function", "function": {"name": "now"}},
                   {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model=MODEL, messages=ASK, tools=[city, {"type": "function", "function": {"name": "now"}}], tool_choice=choice, max_tokens=200,
                      temperature=0, parallel_tool_calls=False)
        if stream:
            with client.chat.completions.stream(**kwargs) as s:
                r = s.get_final_completion()
        else:
            r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls", r
        call, = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "now") and r.choices[0].message.content is None
        if isinstance(choice, dict):
            assert call.function.name == choice["function"]["name"]
        assert args == {} if call.function.name == "now" else args["city"] in ("Paris", "Oslo")


@needs_constraints
def test_response_format_json_makes_json(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "w", "strict": True, "schema": {
                                               "type": "object", "properties": {"n": {"type": "integer"}},
                                               "required": ["n"], "additionalProperties": False}}})
    if r.choices[0].finish_reason == "stop":
        assert set(json.loads(r.choices[0].message.content)) == {"n"}


@needs_constraints
def test_auto_with_a_json_format_is_a_call_or_that_json(client):
    """Tools with ``tool_choice: "auto"`` and a JSON ``response_format``: the reply is calls or an answer of the
    schema, nothing else."""
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[{"type": "function", "function": {
            "name": "now"}}], response_format=answer, max_tokens=100, temperature=1.0, seed=seed)
        message = r.choices[0].message
        if r.choices[0].finish_reason == "tool_calls":
            assert [c.function.name for c in message.tool_calls] == ["now"] * len(message.tool_calls)
        else:
            assert r.choices[0].finish_reason == "stop" and set(json.loads(message.content)) == {"ok"}
