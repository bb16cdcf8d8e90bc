"""``speculant generate`` with an output format: ``--json-schema FILE``, ``--json-object``, ``--regex PATTERN``,
``--grammar FILE``; the output follows it, chain and plain agree, and bad input is one line with exit 2."""

from __future__ import annotations

import json
import re

import pytest

from speculant import cli
from test_cli import assert_one_line_error

PROMPT = "def wrap(text, width):"


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


def run(capsys, *args):
    code = cli.main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def args(dirs, method, *extra):
    return [PROMPT, "--target", dirs["target"], "--draft", dirs["draft"], "--method", method, "--max-new-tokens",
            "40", "--json", *extra]


def test_regex_output_matches_and_methods_agree(code_models, capsys):
    texts = []
    for method in ("ar", "chain", "lookup"):
        code, out, err = run(capsys, *args(code_models, method, "--regex", r"(yes|no): [0-9]{2}"))
        assert code == 0, err
        texts.append(json.loads(out)["text"])
    assert texts[0] == texts[1] == texts[2] and re.fullmatch(r"(yes|no): [0-9]{2}", texts[0]), texts


def test_json_schema_and_grammar_files(code_models, capsys, tmp_path):
    schema = tmp_path / "item.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}))
    code, out, err = run(capsys, *args(code_models, "chain", "--json-schema", str(schema)))
    assert code == 0, err
    obj = json.loads(out)
    assert json.loads(obj["text"]) in ({"ok": True}, {"ok": False})
    assert obj["stats"]["forced_tokens"] > 0 and obj["stats"]["constraint_masks"] > 0
    grammar = tmp_path / "call.lark"
    grammar.write_text('start: "call(" NAME ")"\nNAME: /[a-z]{1,5}/\n')
    code, out, err = run(capsys, *args(code_models, "chain", "--grammar", str(grammar)))
    assert code == 0, err
    assert re.fullmatch(r"call\([a-z]{1,5}\)", json.loads(out)["text"])
    code, out, err = run(capsys, *args(code_models, "chain", "--json-object"))
    assert code == 0, err
    assert json.loads(out)["text"].startswith("{")


def test_bad_formats_one_line_exit_2(code_models, capsys, tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nope")
    unsupported = tmp_path / "unsupported.json"
    unsupported.write_text(json.dumps({"type": "object", "unevaluatedProperties": False}))
    bad_grammar = tmp_path / "bad.lark"
    bad_grammar.write_text("start: missing_rule\n")
    cases = [
        (["--regex", "("], ["response_format regex", "unclosed group"]),
        (["--json-schema", str(bad_json)], ["--json-schema", "is not JSON"]),
        (["--json-schema", str(tmp_path / "absent.json")], ["--json-schema: cannot read"]),
        (["--json-schema", str(unsupported)], ["Unimplemented keys", "unevaluatedProperties"]),
        (["--grammar", str(bad_grammar)], ["response_format grammar", "missing_rule"]),
    ]
    for extra, needles in cases:
        assert_one_line_error(*run(capsys, *args(code_models, "chain", *extra)), *needles)


def test_formats_are_exclusive(code_models, capsys):
    assert_one_line_error(*run(capsys, *args(code_models, "chain", "--regex", "a", "--json-object")),
                          "--json-object: not allowed with argument --regex")
