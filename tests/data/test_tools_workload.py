"""``builtin:tools``: tool-calling requests whose tools are standard-library functions, the right one among
distractors, with the expected call."""

from __future__ import annotations

import collections
import inspect
import json

import pytest

from speculant.data.json_schema import check_schema, schema_errors
from speculant.data.prompts import BUILTIN_SETS, check_record, load_prompts
from speculant.data.tools import CATEGORIES, call_matches, tool_call_errors, tool_calls_report, tool_catalogue
from speculant.data.tools import tools_prompts


@pytest.fixture(scope="module")
def records():
    return load_prompts("builtin:tools")


def test_registered_with_48_records(records):
    assert BUILTIN_SETS["tools"] is tools_prompts
    assert len(records) == 48 and len({r["id"] for r in records}) == 48
    assert collections.Counter(r["category"] for r in records) == {"auto": 24, "required": 24}
    assert [r["tool_choice"] for r in records[:4]] == list(CATEGORIES) * 2
    catalogue = tool_catalogue()
    assert {r["expected"]["name"] for r in records} == {t.name for t in catalogue}  # every tool asked for


def test_deterministic(records):
    assert tools_prompts() == records
    assert load_prompts("builtin:tools", 7) == records[:7]
    assert [r["id"] for r in tools_prompts(seed=1)] != [r["id"] for r in records]


def test_tools_are_real_functions_with_valid_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    for tool in tool_catalogue():
        spec = tool.spec
        assert spec["type"] == "function" and set(spec["function"]) == {"name", "description", "parameters"}
        assert spec["function"]["name"] == tool.dotted.replace(".", "_")
        assert spec["function"]["description"] and "\n" not in spec["function"]["description"]
        params = spec["function"]["parameters"]
        check_schema(params)
        jsonschema.Draft202012Validator.check_schema(params)
        assert set(params["required"]) <= set(params["properties"])
        module, _, name = tool.dotted.rpartition(".")
        func = __import__(module, fromlist=["_"]) if module != "datetime.date" else None
        func = getattr(func, name) if func is not None else __import__("datetime").date.fromisoformat
        assert callable(func)
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            continue  # a builtin without a text signature
        assert set(params["properties"]) <= set(signature.parameters), tool.dotted


def test_each_request_offers_the_expected_tool_among_distractors(records):
    for r in records:
        check_record(r, r["id"])
        assert [m["role"] for m in r["messages"]] == ["system", "user"]
        names = [t["function"]["name"] for t in r["tools"]]
        assert len(names) == 4 and len(set(names)) == 4 and r["expected"]["name"] in names
        assert r["id"].endswith(r["expected"]["name"]) and r["category"] == r["tool_choice"]
        assert r["parallel_tool_calls"] is False  # one call answers each request
        # the expected call is a valid call, and what the request states
        call = {"name": r["expected"]["name"], "arguments": json.dumps(r["expected"]["arguments"])}
        assert tool_call_errors(call, r["tools"]) == []
        assert tool_calls_report([call], r) == {"valid": True, "exact": True, "errors": []}
        for value in r["expected"]["arguments"].values():
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                assert str(value) in r["messages"][1]["content"], r["id"]
    positions = {[t["function"]["name"] for t in r["tools"]].index(r["expected"]["name"]) for r in records}
    assert len(positions) > 1  # the right tool is not always in the same place


def test_the_expected_call_runs_the_real_function(records):
    """Calling the real function with the expected arguments works (the tools are what they say)."""
    import math

    by_name = {t.name: t for t in tool_catalogue()}
    for r in records:
        tool = by_name[r["expected"]["name"]]
        if tool.dotted != "shutil.disk_usage":  # the path may not exist here
            tool.call(r["expected"]["arguments"])
    gcd = by_name["math_gcd"]
    assert gcd.call({"integers": [12, 18]}) == 6
    assert by_name["os_path_join"].call({"a": "x", "p": ["y", "z"]}) == "x/y/z"
    assert by_name["math_radians"].call({"x": 180}) == math.pi
    assert by_name["textwrap_wrap"].call({"text": "a b c", "width": 3}) == ["a b", "c"]
    assert by_name["math_perm"].call({"n": 5}) == 120
    assert str(by_name["datetime_date_fromisoformat"].call({"date_string": "2024-02-29"})) == "2024-02-29"


def test_validators_catch_bad_calls(records):
    r = next(r for r in records if r["expected"]["arguments"])
    name = r["expected"]["name"]
    other = next(t["function"]["name"] for t in r["tools"] if t["function"]["name"] != name)
    assert "no tool named" in tool_call_errors({"name": "nope", "arguments": "{}"}, r["tools"])[0]
    assert "not JSON" in tool_call_errors({"name": name, "arguments": "{"}, r["tools"])[0]
    assert tool_call_errors({"name": name, "arguments": "{}"}, r["tools"])  # required arguments missing
    assert tool_call_errors({"name": name, "arguments": {**r["expected"]["arguments"], "bogus": 1}}, r["tools"])
    assert tool_call_errors({"arguments": "{}"}, r["tools"]) and tool_call_errors("x", r["tools"])
    assert tool_calls_report([], r) == {"valid": False, "exact": False, "errors": ["no tool call"]}
    assert tool_calls_report(None, r)["valid"] is False
    good = {"name": name, "arguments": r["expected"]["arguments"]}
    assert call_matches(good, r["expected"])
    assert not call_matches({"name": other, "arguments": r["expected"]["arguments"]}, r["expected"])
    wrong_value = {k: (v + 1 if isinstance(v, int) and not isinstance(v, bool) else v)
                   for k, v in r["expected"]["arguments"].items()}
    if wrong_value != r["expected"]["arguments"]:
        assert not call_matches({"name": name, "arguments": wrong_value}, r["expected"])
    # a valid call of a distractor: valid, not exact
    distractor = next(t for t in tool_catalogue() if t.name == other)
    import random

    _, args = distractor.ask(random.Random(0))
    report = tool_calls_report([{"name": other, "arguments": json.dumps(args)}], r)
    assert report["valid"] and not report["exact"]


def test_schema_errors_on_expected_arguments(records):
    for r in records:
        params = next(t["function"]["parameters"] for t in r["tools"]
                      if t["function"]["name"] == r["expected"]["name"])
        assert schema_errors(r["expected"]["arguments"], params) == []


@pytest.mark.parametrize("kw, needle", [({"n": 0}, "integer >= 1"), ({"distractors": 99}, "distractors")])
def test_bad_arguments(kw, needle):
    with pytest.raises(ValueError, match=needle):
        tools_prompts(**kw)
