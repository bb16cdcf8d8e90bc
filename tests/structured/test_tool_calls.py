"""Tool calls in the model's own format (:mod:`speculant.structured.tool_calls`): the format read from a chat
template (and refused for one without tools), the checks of ``tools`` and ``tool_choice``, the forcing grammar
(llguidance accepts exactly the calls the template itself writes, by the markers' own tokens), and calls parsed
from text, streamed piece by piece exactly as whole."""

from __future__ import annotations

import json

import pytest

from helpers import CHAT_TEMPLATE, tool_model_pair
from speculant.structured.tool_calls import (NO_TOOL_FORMAT, ToolCallParser, ToolFormat, ToolSpecError,
                                             check_tool_choice, check_tools, parse_tool_calls, tool_constraint,
                                             tool_format)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
FMT = ToolFormat()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    target, _ = tool_model_pair(tmp_path_factory.mktemp("tools"))
    return AutoTokenizer.from_pretrained(target)


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


# ---------------------------------------------------------------------------------------------- the format


def test_format_is_read_from_the_template_with_the_markers_tokens(tok):
    fmt = tool_format(tok)
    assert (fmt.open, fmt.close) == ("<tool_call>", "</tool_call>")
    assert tok.convert_ids_to_tokens([fmt.open_id, fmt.close_id]) == ["<tool_call>", "</tool_call>"]
    assert fmt.marker("open") == f"<[{fmt.open_id}]>"


def test_a_template_without_tools_has_no_tool_format(tok):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match=NO_TOOL_FORMAT):
        tool_format(plain)
    mentions = copy.deepcopy(tok)  # says <tool_call> but never renders the tools
    mentions.chat_template = CHAT_TEMPLATE + "{# <tool_call> #}"
    with pytest.raises(ValueError, match=NO_TOOL_FORMAT):
        tool_format(mentions)


# ---------------------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("tools,param,needle", [
    ({"type": "function"}, "tools", "must be an array"),
    ([1], "tools[0]", "must be an object"),
    ([{"type": "retrieval"}], "tools[0].type", "'function'"),
    ([{"type": "function"}], "tools[0].function", "must be an object"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name", "letters"),
    ([NOW, NOW], "tools[1].function.name", "two tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters", "object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strnig"}}}}}], "tools[0].function.parameters", "strnig"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=x)a"}}}}}], "tools[0].function.parameters", "look-around"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], "tools[0].function.params", "not a field"),
])
def test_bad_tools_name_the_field(tools, param, needle):
    with pytest.raises(ToolSpecError, match=needle) as info:
        check_tools(tools)
    assert info.value.param == param


def test_strict_false_skips_what_llguidance_does_not_implement(tok):
    params = {"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}
    with pytest.raises(ToolSpecError, match="weird"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
    tools = check_tools([{"type": "function", "function": {"name": "f", "parameters": params, "strict": False}}])
    _matcher(tok, tool_constraint(tool_format(tok), tools, "required")["grammar"])  # compiles


def test_tool_choice():
    tools = check_tools([WEATHER, NOW])
    assert check_tools([NOW])[0]["function"]["parameters"] == {"type": "object", "properties": {},
                                                                "additionalProperties": False}
    assert check_tool_choice(None, tools) == "auto" and check_tool_choice(None, []) == "none"
    assert check_tool_choice("required", tools) == "required"
    assert check_tool_choice({"type": "function", "function": {"name": "now"}}, tools) == "now"
    for bad, param in (({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
                       ("always", "tool_choice"), ({"type": "function"}, "tool_choice")):
        with pytest.raises(ToolSpecError) as info:
            check_tool_choice(bad, tools)
        assert info.value.param == param
    with pytest.raises(ToolSpecError, match="no 'tools'"):
        check_tool_choice("required", [])


# ---------------------------------------------------------------------------------------------- the grammar


def _matcher(tok, grammar: str):
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf

    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not m.is_error(), m.get_error()
    return m


def _accepts(m, ids: list[int]) -> bool:
    m = m.deep_copy()
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def _template_call_ids(tok, calls: list[tuple[str, dict]]) -> list[int]:
    """The ids of the calls exactly as the chat template writes them in an assistant turn."""
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    start, end = text.index("<tool_call>"), text.rindex("</tool_call>") + len("</tool_call>")
    ids = tok(text[start:end], add_special_tokens=False)["input_ids"]
    assert ids[0] == tool_format(tok).open_id  # the marker is its own token
    return ids


def test_required_accepts_the_templates_own_calls(tok):
    tools = check_tools([WEATHER, NOW])
    fmt = tool_format(tok)
    m = _matcher(tok, tool_constraint(fmt, tools, "required", parallel=True)["grammar"])
    one = [("get_weather", {"city": "Paris"})]
    two = [("get_weather", {"city": "Oslo", "days": 2}), ("now", {})]
    assert _accepts(m, _template_call_ids(tok, one)) and _accepts(m, _template_call_ids(tok, two))
    assert not _accepts(m, tok("hello", add_special_tokens=False)["input_ids"])
    assert not _accepts(m, _template_call_ids(tok, [("get_weather", {"town": "Paris"})]))  # city is required
    single = _matcher(tok, tool_constraint(fmt, tools, "required", parallel=False)["grammar"])
    assert _accepts(single, _template_call_ids(tok, one)) and not _accepts(single, _template_call_ids(tok, two))


def test_a_named_function_is_the_only_call(tok):
    tools = check_tools([WEATHER, NOW])
    m = _matcher(tok, tool_constraint(tool_format(tok), tools, "now")["grammar"])
    assert _accepts(m, _template_call_ids(tok, [("now", {})]))
    assert not _accepts(m, _template_call_ids(tok, [("get_weather", {"city": "Paris"})]))
    assert not _accepts(m, _template_call_ids(tok, [("now", {}), ("now", {})]))


def test_auto_is_free_unless_an_answer_format_is_given(tok):
    tools = check_tools([NOW])
    fmt = tool_format(tok)
    assert tool_constraint(fmt, tools, "auto") is None and tool_constraint(fmt, tools, "none") is None
    m = _matcher(tok, tool_constraint(fmt, tools, "auto", answer_schema={"type": "object"})["grammar"])
    assert _accepts(m, _template_call_ids(tok, [("now", {})]))
    assert _accepts(m, tok('{"a": 1}', add_special_tokens=False)["input_ids"])
    assert not _accepts(m, tok("[1]", add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------- parsing


def test_calls_are_parsed_and_other_text_stays_content():
    text = "Let me check.\n" + _call("get_weather", {"city": "Paris"}) + "\n" + _call("now", {}) + "\n"
    reply = parse_tool_calls(text, FMT, {"get_weather", "now"})
    assert reply.content == "Let me check."
    assert [c["function"]["name"] for c in reply.tool_calls] == ["get_weather", "now"]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function"
               for c in reply.tool_calls)
    assert len({c["id"] for c in reply.tool_calls}) == 2
    only = parse_tool_calls(_call("now", {}), FMT, {"now"})
    assert only.content is None and len(only.tool_calls) == 1
    for text in ("plain answer \n", "<tool_call>\n{not json}\n</tool_call>", _call("unknown", {}),
                 '<tool_call>\n{"name": "now", "arguments": [1]}\n</tool_call>', "<tool_call>\n{\"na", ""):
        reply = parse_tool_calls(text, FMT, {"now"})
        assert reply.content == text and reply.tool_calls == [], text
    unclosed = parse_tool_calls('<tool_call>\n{"name": "now", "arguments": {"x": 1}}\n', FMT, {"now"})
    assert unclosed.content is None and json.loads(unclosed.tool_calls[0]["function"]["arguments"]) == {"x": 1}
    as_string = parse_tool_calls('<tool_call>{"name": "now", "arguments": "{\\"x\\": 2}"}</tool_call>', FMT)
    assert json.loads(as_string.tool_calls[0]["function"]["arguments"]) == {"x": 2}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_give_what_the_whole_text_gives(size):
    text = ("Sure <tool_c> is a tag. " + _call("get_weather", {"city": "Zürich"}) + "\n"
            + "<tool_call>\nbroken\n</tool_call> then " + _call("now", {}) + "\n\n")
    parser = ToolCallParser(FMT, {"get_weather", "now"})
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    events += parser.finish()
    content = "".join(v for kind, v in events if kind == "content")
    calls = [v for kind, v in events if kind == "tool_call"]
    whole = parse_tool_calls(text, FMT, {"get_weather", "now"})
    assert content == whole.content == "Sure <tool_c> is a tag.\n<tool_call>\nbroken\n</tool_call> then"
    assert [c["index"] for c in calls] == [0, 1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_incremental_calls_stream_their_arguments_as_they_come(size):
    """A forced call (incremental): a first item with id and name once the name is written, then the arguments
    in pieces; put together, what the whole text gives."""
    text = (_call("get_weather", {"city": "Z\u00fcrich \\\"}{", "days": [1, {"a": 2}]}) + "\n"
            + _call("now", {}))
    parser = ToolCallParser(FMT, {"get_weather", "now"}, incremental=True)
    items = []
    for i in range(0, len(text), size):
        items += parser.feed(text[i:i + size])
    items += parser.finish()
    assert all(kind == "tool_call" for kind, _ in items)
    calls: dict[int, dict] = {}
    for _, item in items:
        if "id" in item:
            assert item["index"] not in calls and item["function"]["arguments"] == ""
            calls[item["index"]] = {"name": item["function"]["name"], "arguments": ""}
        calls[item["index"]]["arguments"] += item["function"]["arguments"]
    if size == 1:
        assert len(items) > 20  # piece by piece
    whole = parse_tool_calls(text, FMT, {"get_weather", "now"})
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    assert json.loads(calls[0]["arguments"]) == {"city": "Z\u00fcrich \\\"}{", "days": [1, {"a": 2}]}


@pytest.mark.slow
def test_qwen_tool_call_tokens():
    """The packaged Qwen2.5-Coder's tokenizer: ``<tool_call>`` is added token 151657, and the forcing grammar
    accepts the very tokens its template writes for a call."""
    from speculant.models.loading import load_tokenizer, resolve_model
    from speculant.models.sources import packaged_installed

    if not packaged_installed("qwen2.5-coder-0.5b-instruct"):
        pytest.skip("the packaged Qwen2.5-Coder models are not installed (make qwen-models)")
    qwen = load_tokenizer(resolve_model("qwen2.5-coder-0.5b-instruct"))
    fmt = tool_format(qwen)
    assert (fmt.open_id, fmt.close_id) == (151657, 151658)
    tools = check_tools([WEATHER, NOW])
    m = _matcher(qwen, tool_constraint(fmt, tools, "required")["grammar"])
    ids = _template_call_ids(qwen, [("get_weather", {"city": "Paris"}), ("now", {})])
    assert _accepts(m, ids + [qwen.convert_tokens_to_ids("<|im_end|>")])
