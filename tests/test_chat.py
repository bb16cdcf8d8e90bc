"""Chat templates: messages to ids, stop at the end-of-turn token, and the CLI's chat / --raw / --system."""

from __future__ import annotations

import json

import pytest
import torch

from speculant import cli
from speculant.models.chat import chat_ids, has_chat_template, stop_ids
from speculant.core.engine import generate
from speculant.models.loading import load_model_dir


@pytest.fixture(scope="module")
def chat_dirs(chat_models):
    return chat_models


def test_chat_ids_round_trip(chat_dirs):
    _, tok = load_model_dir(chat_dirs[0])
    assert has_chat_template(tok)
    ids = chat_ids(tok, "hello there", system="be brief")
    text = tok.decode(ids)
    assert text == "<s>system\nbe brief</s>\n<s>user\nhello there</s>\n<s>assistant\n"
    assert chat_ids(tok, [{"role": "user", "content": "hello there"}]) == chat_ids(tok, "hello there")


def test_chat_ids_errors(chat_dirs, code_tokenizer):
    _, tok = load_model_dir(chat_dirs[0])
    with pytest.raises(ValueError, match="role"):
        chat_ids(tok, [{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="twice"):
        chat_ids(tok, [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}], system="c")
    with pytest.raises(ValueError, match="empty"):
        chat_ids(tok, [])
    plain = code_tokenizer
    with pytest.raises(ValueError, match="no chat template"):
        chat_ids(plain, "hi")


def test_stop_ids_and_generation_stops_at_end_of_turn(chat_dirs):
    from speculant.drafters.registry import build_drafter
    from speculant.models.loading import load_draft

    target, tok = load_model_dir(chat_dirs[0])
    assert tok.convert_tokens_to_ids("</s>") in stop_ids(tok, target)
    ids = chat_ids(tok, "hello")
    free = generate(target, ids, max_new_tokens=20, eos_token_id=[]).token_ids
    stop = free[5]  # pretend this token ends the turn: every method must stop at its first occurrence
    expected = free[: free.index(stop) + 1]
    draft = load_draft(chat_dirs[1], target)
    for spec in ("ar", "chain:k=3", "tree:budget=6"):
        drafter = None if spec == "ar" else build_drafter(spec, draft)
        assert generate(target, ids, drafter=drafter, max_new_tokens=20, eos_token_id=[stop]).token_ids == expected


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_chat_equals_api_with_template(chat_dirs, capsys):
    target_dir, draft_dir = chat_dirs
    code, out, err = _run(capsys, "generate", "hello", "--system", "be brief", "--target", target_dir, "--draft",
                          draft_dir, "--method", "chain:k=3", "--max-new-tokens", "12", "--json")
    assert code == 0, err
    got = json.loads(out)
    target, tok = load_model_dir(target_dir, dtype=torch.float32)
    expected = generate(target, chat_ids(tok, "hello", system="be brief"), max_new_tokens=12,
                        eos_token_id=stop_ids(tok, target)).token_ids
    assert got["token_ids"] == expected
    code, out, err = _run(capsys, "generate", "hello", "--raw", "--target", target_dir, "--method", "ar",
                          "--max-new-tokens", "12", "--json")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == generate(target, tok("hello")["input_ids"], max_new_tokens=12).token_ids


def test_cli_system_needs_template(chat_dirs, capsys):
    code, _, err = _run(capsys, "generate", "hello", "--raw", "--system", "x", "--target", chat_dirs[0],
                        "--method", "ar")
    assert code == 2 and err.count("\n") == 1 and "--system" in err
