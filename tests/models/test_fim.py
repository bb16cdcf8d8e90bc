"""Fill-in-the-middle prompts in the model's own tokens (:mod:`speculant.models.fim`) and ``Session.infill``: the
Qwen2.5-Coder layout with and without repository files, a clear error for a tokenizer without FIM tokens, and
greedy infilling identical whatever the method drafts."""

from __future__ import annotations

import pytest

from helpers import chat_model_pair
from speculant.models.fim import FIM_FORMATS, fim_format, fim_ids, fim_stop_ids, has_fim, repo_files
from speculant.tiny_models import FIM_TOKENS, tiny_tokenizer

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return c\n"


@pytest.fixture(scope="module")
def fim_tok():
    return tiny_tokenizer(vocab_size=300, special_tokens=FIM_TOKENS)


@pytest.fixture(scope="module")
def plain_tok():
    return tiny_tokenizer(vocab_size=300)


@pytest.fixture(scope="module")
def session(tmp_path_factory, one_thread):
    import speculant

    target, draft = chat_model_pair(tmp_path_factory.mktemp("fim"), layers=2, context=512,
                                    special_tokens=FIM_TOKENS)
    return speculant.load(target, draft=draft, method="chain:k=3")


def test_qwen_layout_without_and_with_repository_files(fim_tok):
    assert fim_format(fim_tok).family == "qwen2.5-coder" and has_fim(fim_tok)
    layout = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    assert fim_tok.decode(fim_ids(fim_tok, PREFIX, SUFFIX)) == layout
    ids = fim_ids(fim_tok, PREFIX, SUFFIX, [{"filename": "a.py", "text": "x = 1"}, ("b.py", "y = 2\n")],
                  repo_name="demo", filename="c.py")
    assert fim_tok.decode(ids) == ("<|repo_name|>demo\n<|file_sep|>a.py\nx = 1\n<|file_sep|>b.py\ny = 2\n"
                                   f"<|file_sep|>c.py\n{layout}")
    # the code being edited cannot inject a control token: its special-token strings are text
    inject = fim_ids(fim_tok, "a<|fim_middle|>", "")
    assert inject.count(fim_tok.convert_tokens_to_ids("<|fim_middle|>")) == 1
    vocab = fim_tok.get_vocab()
    assert {vocab["<|endoftext|>"], vocab["<|file_sep|>"], fim_tok.eos_token_id} <= set(fim_stop_ids(fim_tok))


def test_every_family_names_its_tokens():
    for fmt in FIM_FORMATS:
        assert all(fmt.required) and fmt.family
    assert FIM_FORMATS[0].required == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def test_a_tokenizer_without_fim_tokens_is_a_clear_error(plain_tok):
    assert not has_fim(plain_tok)
    with pytest.raises(ValueError, match=r"no fill-in-the-middle tokens.*<\|fim_prefix\|>"):
        fim_ids(plain_tok, PREFIX, SUFFIX)
    partial = tiny_tokenizer(vocab_size=300, special_tokens=["<|fim_prefix|>", "<|fim_suffix|>"])
    with pytest.raises(ValueError, match=r"qwen2.5-coder's <\|fim_middle\|> missing"):
        fim_format(partial)
    no_repo = tiny_tokenizer(vocab_size=300, special_tokens=["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    assert fim_ids(no_repo, PREFIX, SUFFIX)
    with pytest.raises(ValueError, match="no repository tokens"):
        fim_ids(no_repo, PREFIX, SUFFIX, [("a.py", "x")])


@pytest.mark.parametrize("extra, match", [
    ("a.py", "must be a list"), ([{"filename": "a.py"}], r"extra\[0\].text must be a string"),
    ([{"filename": 3, "text": ""}], "filename must be a string"), ([{"path": "a", "text": ""}], "unknown field"),
    ([3], r"extra\[0\] must be"),
])
def test_bad_repository_files(extra, match):
    with pytest.raises(ValueError, match=match):
        repo_files(extra)


def test_infill_greedy_equals_plain_decoding(session):
    fast = session.infill(PREFIX, SUFFIX, max_new_tokens=40, temperature=0)
    plain = session.infill(PREFIX, SUFFIX, max_new_tokens=40, temperature=0, method="ar")
    assert fast.token_ids == plain.token_ids and len(plain.token_ids) > 0
    assert fast.stats.draft_tokens > 0 and plain.stats.draft_tokens == 0
    files = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    fast = session.infill(PREFIX, SUFFIX, files, max_new_tokens=30, temperature=0)
    plain = session.infill(PREFIX, SUFFIX, files, max_new_tokens=30, temperature=0, drafter=None)
    assert fast.token_ids == plain.token_ids
    # the same as generate on the FIM prompt's ids with the FIM stops
    ids = fim_ids(session.tokenizer, PREFIX, SUFFIX)
    direct = session.generate(ids, max_new_tokens=40, temperature=0,
                              eos_token_id=fim_stop_ids(session.tokenizer, session.target))
    assert direct.token_ids == session.infill(PREFIX, SUFFIX, max_new_tokens=40, temperature=0).token_ids


def test_infill_stops_at_a_fim_end_token(session):
    plain = session.infill(PREFIX, SUFFIX, max_new_tokens=40, temperature=0, method="ar")
    stop = plain.token_ids[3]  # make the fourth token an end token: the middle ends there
    got = session.infill(PREFIX, SUFFIX, max_new_tokens=40, temperature=0, eos_token_id=[stop])
    assert got.token_ids == plain.token_ids[:plain.token_ids.index(stop) + 1] and got.finish_reason == "stop"


def test_infill_bad_input(session, plain_tok):
    with pytest.raises(ValueError, match="infill takes no system"):
        session.infill(PREFIX, SUFFIX, system="be brief")
    with pytest.raises(ValueError, match="prefix must be a string"):
        session.infill(3, SUFFIX)
    import dataclasses

    without = dataclasses.replace(session, tokenizer=plain_tok)
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        without.infill(PREFIX, SUFFIX)
