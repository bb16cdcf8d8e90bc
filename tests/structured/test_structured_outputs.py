"""Structured outputs on llguidance (:mod:`speculant.structured`): compiling ``response_format``, greedy output
under a constraint token-identical for plain decoding and every drafting method, valid against its format, forced
tokens, padding ids, a grammar that can only end, and bad formats as one-line ValueErrors."""

from __future__ import annotations

import json
import re

import pytest
import torch

import speculant
from speculant.core import engine
from speculant.core.types import DraftTree
from speculant.drafters.model import DraftModelDrafter
from speculant.drafters.registry import build_drafter
from speculant.structured import CompiledFormat, compile_response_format
from speculant.tiny_models import perturbed, tiny_model

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                   "size": {"enum": [1, 22, 333]}},
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # compact JSON: a random tiny model finishes it
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
REGEX = {"type": "regex", "pattern": r"(yes|no), [0-9]{1,3}!"}
GRAMMAR = {"type": "grammar", "grammar": 'start: "call " name " with " %json{"type": "integer", "minimum": 0}\n'
                                         'name: "wrap" | "fill" | "dedent"'}
EOS = 1


@pytest.fixture(scope="module")
def tok(code_tokenizer):
    return code_tokenizer


@pytest.fixture(scope="module")
def pair(tok):
    """A target whose logits are 20 ids wider than the tokenizer (padding rows, as Qwen's) and its perturbed
    draft; init 0.5: well-separated logits."""
    target = tiny_model("llama", vocab_size=len(tok) + 20, hidden=32, layers=2, init_std=0.5, seed=3)
    return target, perturbed(target, scale=0.02, seed=4)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok("def wrap(text, width):\n    ")["input_ids"]


METHODS = ["chain:k=4", "chain-trimmed", "specinfer", "spectr", "rsd-c", "rsd-s", "tree", "lookup", "hybrid", "mask-probe"]


def _drafter(spec, draft):
    if spec == "chain-trimmed":  # VocabTrim: the constraint's mask taken onto the kept ids
        return DraftModelDrafter(draft, k=3, vocab_trim=list(range(0, 300, 2)), tokenizers_match=True)
    return build_drafter(spec, draft, tokenizers_match=True) if spec is not None else None


def _valid(fmt: dict, text: str) -> None:
    if fmt["type"] == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "ok", "size"} and value["size"] in (1, 22, 333), text
        assert isinstance(value["ok"], bool) and len(value["name"]) <= 6, text
    elif fmt["type"] == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif fmt["type"] == "regex":
        assert re.fullmatch(fmt["pattern"], text), text
    else:
        assert re.fullmatch(r"call (wrap|fill|dedent) with (0|[1-9][0-9]*)", text), text


@pytest.mark.parametrize("fmt", [JSON_SCHEMA, REGEX, GRAMMAR], ids=["json_schema", "regex", "grammar"])
def test_greedy_output_is_identical_for_every_method_and_valid(pair, tok, prompt, fmt):
    target, draft = pair
    compiled = compile_response_format(fmt, tok)
    plain = engine.generate(target, prompt, max_new_tokens=60, eos_token_id=EOS, constraint=compiled.constraint())
    assert plain.finish_reason == "stop" and EOS not in plain.token_ids  # complete: it ends without a stop token
    assert max(plain.token_ids) < len(tok)  # padding ids are never allowed
    _valid(fmt, tok.decode(plain.token_ids))
    assert plain.stats.forced_tokens == 0 and plain.stats.constraint_masks >= len(plain.token_ids)
    forced = 0
    for spec in METHODS:
        gen = engine.generate(target, prompt, drafter=_drafter(spec, draft), max_new_tokens=60, eos_token_id=EOS,
                              constraint=compiled.constraint())
        assert gen.token_ids == plain.token_ids, spec
        assert gen.finish_reason == "stop", spec
        forced += gen.stats.forced_tokens
        assert gen.stats.constraint_mask_s > 0, spec
    assert forced > 0  # the format's fixed text is proposed without drafting


def test_unconstrained_output_breaks_the_format(pair, tok, prompt):
    """The control: the same model unconstrained does not write the format (so the tests above test the mask)."""
    target, _ = pair
    gen = engine.generate(target, prompt, max_new_tokens=30, eos_token_id=EOS)
    assert not re.fullmatch(REGEX["pattern"], tok.decode(gen.token_ids))


def test_sampled_output_is_valid_and_the_same_per_seed_through_the_public_api(pair, tok, prompt):
    target, draft = pair
    texts = set()
    for seed in range(4):
        gen = speculant.generate(target, prompt, drafter=draft, max_new_tokens=60, temperature=1.0, seed=seed,
                                 eos_token_id=EOS, response_format=JSON_SCHEMA, tokenizer=tok)
        again = speculant.generate(target, prompt, drafter=draft, max_new_tokens=60, temperature=1.0, seed=seed,
                                   eos_token_id=EOS, response_format=JSON_SCHEMA, tokenizer=tok)
        assert gen.token_ids == again.token_ids
        _valid(JSON_SCHEMA, tok.decode(gen.token_ids))
        texts.add(tok.decode(gen.token_ids))
    assert len(texts) > 1


def test_json_object_mode_and_batches_and_steps(pair, tok, prompt):
    target, draft = pair
    fmt = {"type": "json_object", }
    gens = speculant.generate_batch(target, [prompt, prompt[:5]], drafter=draft, max_new_tokens=40, eos_token_id=EOS,
                                    response_format=REGEX, tokenizer=tok)
    for gen, p in zip(gens, [prompt, prompt[:5]]):
        alone = speculant.generate(target, p, max_new_tokens=40, eos_token_id=EOS, response_format=REGEX,
                                   tokenizer=tok)
        assert gen.token_ids == alone.token_ids
    steps = speculant.generate_steps(target, prompt, drafter="lookup", max_new_tokens=20, eos_token_id=EOS,
                                     response_format=fmt, tokenizer=tok)
    tokens = [t for event in steps for t in event.tokens]
    assert tokens == steps.result.token_ids and tok.decode(tokens).startswith("{")


def test_a_stop_token_is_allowed_where_the_format_may_end(pair, tok, prompt):
    """``a+`` may end after any ``a``: the stop token is allowed there (and only there), so greedy decoding under
    it stops at the model's own choice or runs to the length; never a token outside the format."""
    target, draft = pair
    fmt = {"type": "regex", "pattern": "(ab)+"}
    c = compile_response_format(fmt, tok).constraint()
    c.begin(len(tok) + 20, {EOS})
    assert not bool(c.mask_after([])[EOS])
    ab = tok("ab")["input_ids"]
    after = c.mask_after(ab)
    assert bool(after[EOS]) and not bool(after[len(tok):].any())
    plain = engine.generate(target, prompt, max_new_tokens=12, eos_token_id=EOS,
                            constraint=compile_response_format(fmt, tok).constraint())
    chain = engine.generate(target, prompt, drafter=_drafter("chain:k=3", draft), max_new_tokens=12,
                            eos_token_id=EOS, constraint=compile_response_format(fmt, tok).constraint())
    assert chain.token_ids == plain.token_ids
    text = tok.decode([t for t in plain.token_ids if t != EOS])
    assert re.fullmatch("(ab)*a?b?", text), text


def test_a_grammar_that_can_only_end_generates_nothing(pair, tok, prompt):
    target, draft = pair
    fmt = {"type": "regex", "pattern": ""}
    for drafter in (None, _drafter("chain:k=3", draft)):
        gen = speculant.generate(target, prompt, drafter=drafter, max_new_tokens=10, eos_token_id=EOS,
                                 response_format=fmt, tokenizer=tok)
        assert gen.token_ids == [] and gen.finish_reason == "stop" and gen.stats.target_calls == 0
    steps = speculant.generate_steps(target, prompt, max_new_tokens=10, eos_token_id=EOS, response_format=fmt,
                                     tokenizer=tok)
    events = list(steps)
    assert len(events) == 1 and events[0].done and events[0].tokens == [] and steps.result.finish_reason == "stop"


def test_tree_masks_cut_forbidden_nodes_and_their_descendants(tok):
    c = compile_response_format({"type": "regex", "pattern": "(yes|no)!"}, tok).constraint()
    c.begin(len(tok) + 20, {EOS})
    y, n_, bang = (tok(s)["input_ids"][0] for s in ("y", "n", "!"))
    tree = DraftTree(tokens=[y, bang, n_, y], parents=[-1, -1, -1, 1])
    masks, allowed = c.tree_masks(tree)
    assert masks.shape == (5, len(tok) + 20) and masks.dtype == torch.bool
    assert allowed == [True, False, True, False]  # '!' is not allowed first; its child goes with it
    assert bool(masks[0, y]) and bool(masks[0, n_]) and not bool(masks[0, bang])
    assert bool(masks[2].all())  # a forbidden node's row: a dummy, never read
    assert c.masks >= 3 and c.mask_s > 0
    assert c.commit([y]) == 1 and not c.finished


def test_forced_tokens_follow_the_format(tok):
    c = compile_response_format({"type": "regex", "pattern": "textwrap\\.[a-z]+"}, tok).constraint()
    c.begin(len(tok), {EOS})
    forced = c.forced(8)
    assert forced and tok.decode(forced).startswith("text") and c.forced(1) == forced[:1]
    assert c.forced(0) == []


@pytest.mark.parametrize("fmt,message", [
    ("json", r"^response_format must be a dict"),
    ({"type": "xml"}, r"^response_format type must be one of text, json_object, json_schema, regex, grammar"),
    ({"type": "json_schema"}, r"^response_format json_schema needs a 'json_schema' object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "zzz"}}}, r"Invalid type: zzz"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                       "unevaluatedProperties": False}}},
     r"^response_format json_schema: Unimplemented keys: \[\"unevaluatedProperties\"\]"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                       "maximum": 2}}},
     r"Unsatisfiable schema: minimum \(5\) is greater than maximum \(2\)"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, r"strict must be true or false"),
    ({"type": "regex", "pattern": "("}, r"^response_format regex: .*unclosed group"),
    ({"type": "regex"}, r"^response_format regex needs a 'pattern' string"),
    ({"type": "grammar", "grammar": "start: nope"}, r"^response_format grammar: .*nope"),
    ({"type": "grammar", "grammar": "  "}, r"^response_format grammar is empty"),
    ({"type": "regex", "pattern": "[^\\x00-\\U0010FFFF]"}, r"^response_format regex: "),
])
def test_bad_formats_are_one_line_value_errors(tok, fmt, message):
    with pytest.raises(ValueError, match=message) as err:
        compile_response_format(fmt, tok)
    assert "\n" not in str(err.value)


def test_not_strict_skips_unimplemented_keywords_with_a_warning(tok, caplog):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}
    compiled = compile_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                               "strict": False}}, tok)
    assert compiled.kind == "json_schema" and compiled.constraint() is not None


def test_text_is_no_constraint_and_compiles_are_cached(tok):
    assert compile_response_format({"type": "text"}, tok).constraint() is None
    a = compile_response_format(JSON_SCHEMA, tok)
    assert compile_response_format(json.loads(json.dumps(JSON_SCHEMA)), tok) is a
    assert isinstance(a, CompiledFormat) and a.constraint() is not a.constraint()  # a fresh matcher each time


def test_response_format_needs_a_tokenizer(pair, prompt):
    target, _ = pair
    with pytest.raises(ValueError, match="^response_format needs the target's tokenizer"):
        speculant.generate(target, prompt, response_format={"type": "json_object"})


def test_core_imports_neither_llguidance_nor_structured():
    import ast
    from pathlib import Path

    core = Path(engine.__file__).parent
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("llguidance", "structured") for n in names), path.name


def test_a_batch_mixes_formats_chunked_prefill_and_a_format_that_can_only_end(pair, tok, prompt):
    """Sequences of one batch, each with its own format (or none), joining while others run (chunked prefill),
    each equal to its generation alone; one whose format can only end leaves at once with an empty event."""
    from speculant.core.batch import Batch

    target, draft = pair
    formats = [REGEX, None, GRAMMAR, {"type": "regex", "pattern": ""}]
    alone = [engine.generate(target, prompt, max_new_tokens=40, eos_token_id=EOS,
                             constraint=None if f is None else compile_response_format(f, tok).constraint())
             for f in formats]
    batch = Batch(target, prefill_chunk=4)
    first = batch.add(prompt, _drafter("chain:k=3", draft), max_new_tokens=40, eos_token_id=EOS,
                      constraint=compile_response_format(REGEX, tok).constraint())
    events = batch.step()
    indices = [first] + [batch.add(prompt, _drafter("specinfer", draft), max_new_tokens=40, eos_token_id=EOS,
                                   constraint=None if f is None else compile_response_format(f, tok).constraint())
                         for f in formats[1:]]
    while len(batch):
        events += batch.step()
    ended = [e for e in events if e.sequence == indices[3]]
    assert len(ended) == 1 and ended[0].tokens == [] and ended[0].done
    for i, gen in zip(indices, alone):
        assert batch.result(i).token_ids == gen.token_ids
    with pytest.raises(ValueError, match="a constraint serves one sequence"):
        c = compile_response_format(REGEX, tok).constraint()
        batch.add(prompt, max_new_tokens=4, constraint=c)
        batch.add(prompt, max_new_tokens=4, constraint=c)


@pytest.mark.parametrize("spec", [None, "lookup", "specinfer", "chain:k=4"])
def test_a_format_that_completes_without_stop_tokens_ends_the_generation(pair, tok, prompt, spec):
    """No stop tokens at all (``eos_token_id=[]``): where the format is complete nothing may follow, and the
    generation ends there (sampled; drafts past the end are cut, never sampled from)."""
    target, draft = pair
    fmt = {"type": "regex", "pattern": "(yes|no)!"}
    for seed in range(3):
        gen = speculant.generate(target, prompt, drafter=_drafter(spec, draft), max_new_tokens=30, temperature=1.0,
                                 seed=seed, eos_token_id=[], response_format=fmt, tokenizer=tok)
        assert gen.finish_reason == "stop" and tok.decode(gen.token_ids) in ("yes!", "no!")


def test_json_whitespace_is_bounded_so_an_answer_cannot_run_away_in_spaces(tok):
    """JSON's grammar allows any whitespace; ours a few spaces or one line break and an indentation, so a model
    cannot spend its budget on spaces inside an answer (and pretty-printed JSON still fits)."""
    for rf in ({"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}):
        constraint = compile_response_format(rf, tok).constraint()
        constraint.begin(len(tok), {EOS})
        pretty = tok.encode('{\n    "a": [\n        1,\n        2\n    ]\n}', add_special_tokens=False)
        assert constraint.mask_after(pretty) is not None
        runaway = tok.encode('{"a":' + " " * 40 + "1}", add_special_tokens=False)
        blank_lines = tok.encode('{"a":\n\n\n1}', add_special_tokens=False)
        assert constraint.mask_after(runaway) is None and constraint.mask_after(blank_lines) is None
