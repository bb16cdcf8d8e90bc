"""Fill-in-the-middle on the server: llama.cpp's ``POST /infill`` (its field names, its response and its event
stream) and OpenAI's legacy ``/v1/completions`` with ``suffix``; greedy infills equal plain decoding
(``Session.infill`` with ``ar``); bad input is a 400 and the server goes on; a model without FIM tokens is a 400.

In-process apps (FastAPI's TestClient) serve a tiny pair whose tokenizer has Qwen2.5-Coder's FIM tokens, and the
session's chat pair, which has none."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from helpers import chat_model_pair, until_loaded  # noqa: E402
from speculant.tiny_models import FIM_TOKENS  # noqa: E402

MODEL = "tiny-fim"
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return c\n"
FILES = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """In-process models run on one thread."""


@pytest.fixture(scope="module")
def fim_models(tmp_path_factory) -> tuple[str, str]:
    return chat_model_pair(tmp_path_factory.mktemp("fim-serve"), layers=2, context=512, special_tokens=FIM_TOKENS)


def _client(target: str, draft: str | None, method: str, **settings):
    from fastapi.testclient import TestClient

    from speculant.serve import ServeSettings, check_settings, create_app

    app = create_app(check_settings(ServeSettings(target=target, draft=draft, method=method, model_name=MODEL,
                                                  speculation="on", **settings)))
    return TestClient(app, base_url="http://127.0.0.1")  # no API key: loopback Hosts only


@pytest.fixture(scope="module")
def client(fim_models):
    with _client(*fim_models, "chain:k=3") as c:
        until_loaded(c)
        yield c


@pytest.fixture(scope="module")
def plain(fim_models):
    """``Session.infill`` with plain decoding (``ar``) on the same models: what every greedy answer must equal."""
    import speculant

    session = speculant.load(fim_models[0], method="ar")

    def infill(prefix: str, suffix: str, extra=None, n: int = 24):
        gen = session.infill(prefix, suffix, extra, max_new_tokens=n, temperature=0)
        ids = gen.token_ids
        if gen.finish_reason == "stop":
            ids = ids[:-1]  # the end token is no text
        return session.tokenizer.decode(ids, skip_special_tokens=True), len(gen.token_ids)

    return infill


def _infill(client, **fields) -> dict:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 24, "temperature": 0, **fields}
    r = client.post("/infill", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_infill_answers_as_llama_cpp_and_equals_plain_decoding(client, plain):
    out = _infill(client)
    text, n = plain(PREFIX, SUFFIX)
    assert out["content"] == text and out["tokens_predicted"] == n
    assert out["stop"] is True and out["stop_type"] in ("eos", "limit") and out["model"] == MODEL
    assert out["tokens_evaluated"] > 0 and out["timings"]["predicted_n"] == n
    assert out["speculant"]["draft_tokens"] > 0  # it drafted, and the answer is still plain decoding's
    off = _infill(client, speculant_speculation="off")
    assert off["content"] == text and off["speculant"]["draft_tokens"] == 0
    # repository files, and llama.cpp's "prompt": text inserted at the cursor, after the prefix
    assert _infill(client, input_extra=FILES)["content"] == plain(PREFIX, SUFFIX, FILES)[0]
    assert _infill(client, prompt="c = ")["content"] == plain(PREFIX + "c = ", SUFFIX)[0]
    # seeded sampling (llama.cpp's default temperature, top-k and top-p) is reproducible
    assert _infill(client, temperature=None, seed=3)["content"] == _infill(client, temperature=None, seed=3)["content"]
    # llama.cpp's hints and neutral values are taken
    assert _infill(client, cache_prompt=True, t_max_predict_ms=500, samplers=["top_k"], n_probs=0, seed=-1,
                   top_k=0)["content"] == text


def test_infill_keeps_the_text_near_the_cursor_as_llama_cpp_and_reports_reuse(client, monkeypatch):
    """/infill keeps the prefix's last and the suffix's first tokens (llama.cpp's split of its batch, here shrunk
    to fit the tiny model), /v1/completions keeps all; a repeated request reuses its prompt (llama.cpp's
    ``tokens_cached`` and ``timings.cache_n``)."""
    from speculant.serve import app as app_module

    monkeypatch.setattr(app_module, "INFILL_TAKE", (12, 6))
    long_prefix, long_suffix = "import os\n" * 20 + PREFIX, SUFFIX + "print(add(1, 2))\n" * 10
    first = _infill(client, input_prefix=long_prefix, input_suffix=long_suffix)
    again = _infill(client, input_prefix=long_prefix, input_suffix=long_suffix)
    assert first["tokens_evaluated"] == again["tokens_evaluated"] <= 12 + 6 + 3 + 2
    assert again["content"] == first["content"]
    assert again["tokens_cached"] == again["timings"]["cache_n"] >= 16 and \
        again["timings"]["prompt_n"] == again["tokens_evaluated"] - again["tokens_cached"]
    full = client.post("/v1/completions", json={"model": MODEL, "prompt": long_prefix, "suffix": long_suffix,
                                                "max_tokens": 2, "temperature": 0})
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] > first["tokens_evaluated"]


def test_infill_streams_server_sent_events(client, plain):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 24, "temperature": 0, "stream": True}
    with client.stream("POST", "/infill", json=body) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert len(events) > 2 and all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == plain(PREFIX, SUFFIX)[0]
    assert events[-1]["tokens_predicted"] == plain(PREFIX, SUFFIX)[1]


def test_completions_with_suffix_is_fill_in_the_middle(client, plain):
    body = {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain(PREFIX, SUFFIX)[0]
    r = client.post("/v1/completions", json={**body, "suffix": ""})  # an empty suffix: a plain completion
    assert r.status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"n_predict": 4}, "input_prefix"),  # neither input_prefix nor input_suffix
    ({"input_prefix": 3, "input_suffix": ""}, "input_prefix"),
    ({"input_prefix": "", "input_suffix": ["x"]}, "input_suffix"),
    ({"input_prefix": "", "input_extra": {"filename": "a"}}, "input_extra"),
    ({"input_prefix": "", "input_extra": [{"filename": "a", "text": 3}]}, "input_extra[0].text"),
    ({"input_prefix": "", "input_extra": [{"path": "a", "text": ""}]}, "input_extra[0].path"),
    ({"input_prefix": "", "prompt": 5}, "prompt"),
    ({"input_prefix": "", "n_predict": 0}, "n_predict"),
    ({"input_prefix": "", "n_predict": "8"}, "n_predict"),
    ({"input_prefix": "", "temperature": -1}, "temperature"),
    ({"input_prefix": "", "top_p": 0}, "top_p"),
    ({"input_prefix": "", "repeat_penalty": 1.3}, "repeat_penalty"),
    ({"input_prefix": "", "cache_prompt": "yes"}, "cache_prompt"),
    ({"input_prefix": "", "mystery": 1}, "mystery"),
])
def test_bad_infill_requests_are_400_and_the_server_goes_on(client, body, param):
    r = client.post("/infill", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert client.post("/infill", content=b"{not json").status_code == 400
    assert _infill(client, n_predict=2)["tokens_predicted"] <= 2


def test_suffix_on_chat_and_bad_suffixes_are_400(client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "suffix": "x", "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]
    for suffix, code in ((3, "invalid_type"), ("x", "unsupported_value")):
        prompt = PREFIX if suffix == 3 else [5, 6, 7]  # a suffix needs a text prompt
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "suffix": suffix})
        assert r.status_code == 400 and r.json()["error"]["code"] == code
    assert _infill(client, n_predict=2)["tokens_predicted"] <= 2


def test_stop_strings_and_the_api_key(fim_models, client, plain):
    text, _ = plain(PREFIX, SUFFIX)
    word = text[2:4]
    assert word.strip()  # a stop string inside the greedy answer: it ends there, trimmed
    out = _infill(client, stop=[word])
    assert out["content"] == text[:text.index(word)] and out["stop_type"] == "word"
    with _client(fim_models[0], None, "ar", api_key="k") as c:
        until_loaded(c)
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 2}
        assert c.post("/infill", json=body).status_code == 401
        assert c.post("/infill", json=body, headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_model_without_fim_tokens_is_400(chat_models):
    with _client(chat_models[0], None, "ar") as c:
        until_loaded(c)
        for path, body in (("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX}),
                           ("/v1/completions", {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX})):
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert "no fill-in-the-middle tokens" in error["message"] and error["code"] == "fim_not_supported"
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PREFIX, "max_tokens": 2})
        assert r.status_code == 200  # and it goes on serving


def test_bench_serve_sends_fim_records_with_suffix():
    from speculant.bench.serve_load import LoadSettings, _body

    settings = LoadSettings(url="http://127.0.0.1:1")
    path, body = _body({"id": "f", "prefix": PREFIX, "suffix": SUFFIX, "middle": "c = a + b"}, MODEL, settings)
    assert path == "/v1/completions" and body["prompt"] == PREFIX and body["suffix"] == SUFFIX
