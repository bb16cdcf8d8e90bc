"""``builtin:json-extract``: JSON-extraction requests from installed distributions' metadata and held-out
standard-library functions, each with a schema and a reference answer."""

from __future__ import annotations

import collections
import json

import pytest

from speculant.data.json_extract import CATEGORIES, SCHEMAS, STATUSES, answer_report, json_extract_prompts
from speculant.data.json_extract import distribution_headers
from speculant.data.json_schema import check_schema, schema_errors
from speculant.data.prompts import BUILTIN_SETS, check_record, load_prompts


@pytest.fixture(scope="module")
def records():
    return load_prompts("builtin:json-extract")


def schema_of(record: dict) -> dict:
    return record["response_format"]["json_schema"]["schema"]


def test_registered_with_40_records_over_four_shapes(records):
    assert BUILTIN_SETS["json-extract"] is json_extract_prompts
    assert len(records) == 40 and len({r["id"] for r in records}) == 40
    assert collections.Counter(r["category"] for r in records) == {c: 10 for c in CATEGORIES}
    assert [r["category"] for r in records[:8]] == list(CATEGORIES) * 2  # the shapes take turns
    packages = [r["reference"].get("package", r["reference"].get("name")) for r in records
                if r["category"] != "function"]
    assert len(set(packages)) == len(packages)  # each distribution used once


def test_deterministic(records):
    assert json_extract_prompts() == records
    assert load_prompts("builtin:json-extract", 5) == records[:5]
    assert [r["id"] for r in json_extract_prompts(seed=1)] != [r["id"] for r in records]
    assert len(json_extract_prompts(64)) == 64


def test_schemas_are_valid_and_references_match_them(records):
    jsonschema = pytest.importorskip("jsonschema")
    for schema in SCHEMAS.values():
        check_schema(schema)
        jsonschema.Draft202012Validator.check_schema(schema)
    for r in records:
        schema = schema_of(r)
        assert r["response_format"] == {"type": "json_schema", "json_schema": {
            "name": r["category"], "schema": SCHEMAS[r["category"]], "strict": True}}
        assert schema_errors(r["reference"], schema) == [], r["id"]
        jsonschema.validate(r["reference"], schema, cls=jsonschema.Draft202012Validator)
        assert answer_report(json.dumps(r["reference"]), r) == {"valid": True, "exact": True, "errors": []}


def test_records_are_chats_that_state_the_schema_and_hold_the_text(records):
    for r in records:
        check_record(r, r["id"])
        system, user = r["messages"]
        assert (system["role"], user["role"]) == ("system", "user")
        assert json.dumps(schema_of(r), separators=(",", ":")) in system["content"] and "JSON" in system["content"]
        assert r["source"] in user["content"]


def test_references_are_read_off_the_text(records):
    for r in records:
        ref, text = r["reference"], r["source"]
        if r["category"] == "package":
            assert f"Name: {ref['name']}\nVersion: {ref['version']['text']}\n" in text
            assert ref["version"]["text"].startswith(f"{ref['version']['major']}.{ref['version']['minor']}")
            assert f"Summary: {ref['summary']}\n" in text
            assert (f"Requires-Python: {ref['requires_python']}" in text) == (ref["requires_python"] is not None)
        elif r["category"] == "dependencies":
            lines = [line for line in text.splitlines() if line.startswith("Requires-Dist: ")]
            assert [d["name"] for d in ref["requires"]] == [line.split()[1].split(";")[0].split("[")[0]
                                                            .split("<")[0].split(">")[0].split("=")[0]
                                                            .split("!")[0].split("~")[0].split("(")[0]
                                                            for line in lines]
            assert [d["conditional"] for d in ref["requires"]] == [";" in line for line in lines]
        elif r["category"] == "classifiers":
            assert ref["development_status"] in STATUSES
            if ref["development_status"] != "not stated":
                assert f" - {ref['development_status']}" in text
            assert ref["audiences"] == [line.split("Intended Audience :: ", 1)[1] for line in text.splitlines()
                                        if "Intended Audience :: " in line]
        else:
            assert text.startswith(("def ", "@")) and f"def {ref['name']}(" in text
            assert ref["summary"].split()[0] in text and 1 <= len(ref["parameters"]) <= 6
            for p in ref["parameters"]:
                assert p["name"] in text and (p["default"] is None or f"={p['default']}" in text)


def test_distribution_headers_are_sorted_and_bounded():
    rows = distribution_headers()
    assert [r["name"].lower() for r in rows] == sorted(r["name"].lower() for r in rows)
    assert any(r["name"] == "torch" for r in rows)  # a dependency: always installed
    for r in rows:
        assert r["text"].startswith(f"Name: {r['name']}\nVersion: {r['version']}")
        assert r["text"].count("Classifier: ") <= 8 and r["text"].count("Requires-Dist: ") <= 10


@pytest.mark.parametrize("answer, valid, exact", [
    ("not json", False, False),
    ('{"name": "x"', False, False),
    ("[]", False, False),
    ("{}", False, False),
])
def test_answer_report_negative_controls(records, answer, valid, exact):
    for r in records[:4]:
        report = answer_report(answer, r)
        assert (report["valid"], report["exact"]) == (valid, exact) and report["errors"], r["id"]


def test_answer_report_tells_valid_from_exact(records):
    for r in records[:4]:
        wrong = json.loads(json.dumps(r["reference"]))
        key = next(iter(wrong))
        wrong[key] = wrong[key] + "?" if isinstance(wrong[key], str) else wrong[key]
        assert answer_report(json.dumps(wrong), r) == {"valid": True, "exact": False, "errors": []}
        extra = {**r["reference"], "unexpected": 1}
        report = answer_report(json.dumps(extra), r)
        assert not report["valid"] and "unexpected property" in report["errors"][0]
        missing = dict(r["reference"])
        missing.popitem()
        assert not answer_report(json.dumps(missing), r)["valid"]
    typed = answer_report('{"a": 1}', {"response_format": {"type": "json_object"}})
    assert typed == {"valid": True, "exact": None, "errors": []}
    assert not answer_report("[1]", {"response_format": {"type": "json_object"}})["valid"]


def test_bad_size():
    with pytest.raises(ValueError, match="the number of prompts must be an integer >= 1, got 0"):
        json_extract_prompts(0)
