"""The JSON Schema subset validator of the structured workloads, checked against ``jsonschema`` (draft 2020-12)
where it is installed, and on its own negative controls."""

from __future__ import annotations

import pytest

from speculant.data.json_schema import check_schema, is_valid, json_equal, parse_json, schema_errors

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8, "pattern": "^[a-z]+$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 10},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
        "opt": {"type": ["string", "null"]},
        "either": {"anyOf": [{"type": "boolean"}, {"const": 3}]},
        "inner": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
                  "additionalProperties": False},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}

GOOD = [
    {"name": "ab", "n": 3},
    {"name": "ab", "n": 3.0, "kind": "b", "tags": ["x"], "opt": None, "either": True, "inner": {"x": 1.5}},
    {"name": "z", "n": 10, "either": 3, "opt": "s"},
]
BAD = [
    [],                                            # not an object
    {"name": "ab"},                                # missing n
    {"name": "ab", "n": 3, "extra": 1},            # unexpected property
    {"name": "AB", "n": 3},                        # pattern
    {"name": "", "n": 3},                          # minLength
    {"name": "abcdefghij", "n": 3},                # maxLength
    {"name": "ab", "n": 11},                       # maximum
    {"name": "ab", "n": -1},                       # minimum
    {"name": "ab", "n": 1.5},                      # not an integer
    {"name": "ab", "n": True},                     # a boolean is not an integer
    {"name": "ab", "n": 1, "kind": "c"},           # enum
    {"name": "ab", "n": 1, "tags": []},            # minItems
    {"name": "ab", "n": 1, "tags": ["a", "b", "c"]},  # maxItems
    {"name": "ab", "n": 1, "tags": [1]},           # item type
    {"name": "ab", "n": 1, "opt": 2},              # type list
    {"name": "ab", "n": 1, "either": 4},           # anyOf
    {"name": "ab", "n": 1, "inner": {}},           # nested required
    {"name": "ab", "n": 1, "inner": {"x": 1, "y": 2}},  # nested additionalProperties
]


@pytest.mark.parametrize("value", GOOD)
def test_valid_values_have_no_errors(value):
    assert schema_errors(value, SCHEMA) == []


@pytest.mark.parametrize("value", BAD)
def test_every_violation_is_caught(value):
    errors = schema_errors(value, SCHEMA)
    assert errors and all(e.startswith("$") for e in errors)


def test_agrees_with_jsonschema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for value in GOOD + BAD:
        assert validator.is_valid(value) == (not schema_errors(value, SCHEMA)), value


def test_check_schema_refuses_what_it_does_not_support():
    check_schema(SCHEMA)
    for bad, needle in [({"type": "object", "oneOf": []}, "unsupported keyword"), ({"type": "str"}, "type"),
                        ({"required": "x"}, "required"), ({"enum": []}, "enum"), ({"pattern": "("}, "pattern"),
                        ({"properties": {"a": {"$ref": "#"}}}, "properties/a"), ([], "JSON object"),
                        ({"minItems": -1}, "minItems")]:
        with pytest.raises(ValueError, match=needle):
            check_schema(bad)


def test_parse_json_and_is_valid():
    assert parse_json(' {"a": 1} \n') == ({"a": 1}, None)
    for text in ("", "{", '{"a": 1} trailing', "NaN", '{"a": Infinity}', "'single'"):
        value, why = parse_json(text)
        assert value is None and why.startswith("not JSON")
    assert is_valid('{"name": "ab", "n": 3}', SCHEMA)
    assert not is_valid('{"name": "ab", "n": 3', SCHEMA)
    assert not is_valid('{"name": "ab"}', SCHEMA)


def test_json_equal():
    assert json_equal({"a": [1, 2.0]}, {"a": [1.0, 2]})
    assert not json_equal(1, True) and not json_equal(0, False)
    assert not json_equal({"a": 1}, {"a": 1, "b": 2}) and not json_equal([1], [1, 1])
    assert not json_equal("1", 1) and json_equal(None, None)
