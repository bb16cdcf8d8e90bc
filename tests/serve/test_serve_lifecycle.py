"""A request's life in the server beyond its answer: a non-streaming client that goes away
cancels its generation at once (or before it starts, when queued; one gone while still sending its body is a
cancelled request, not a failed one); bodies over ``--max-body-bytes`` are 413 and
prompts too long to fit are 400 before tokenising, which runs off the event loop; SIGTERM drains (503 for new
work, running and queued requests finish within ``--shutdown-grace``, then end with ``finish_reason`` ``abort``
and ``[DONE]``). Real server subprocesses where a connection or a signal matters (bounded by tokens decoded, never
by timings), in-process apps (TestClient) otherwise, over the session's tiny chat pair (context 2,048)."""

from __future__ import annotations

import json
import signal
import socket
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from helpers import cli_error_line, model_metrics, start_server, stop_server, until_loaded, wait_for  # noqa: E402
from speculant.serve import ServeSettings, check_settings, create_app  # noqa: E402

MODEL = "tiny-chat"
LONG = 1500  # tokens of a generation still running when the test acts on it (context 2048)
CONTEXT = 2048
_LONG_BODY = {"model": MODEL, "prompt": "x = 1", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """In-process models run on one thread."""


@pytest.fixture(scope="module")
def models(chat_models):
    return {"target": chat_models[0], "draft": chat_models[1]}


def _args(models, *extra: str) -> list[str]:
    return ["--target", models["target"], "--draft", models["draft"], "--method", "chain:k=4",
            "--served-model-name", MODEL, "--max-batch", "1", *extra]


_metrics = model_metrics


def _send_raw(url: str, body: dict) -> socket.socket:
    """POST ``body`` to /v1/completions on a socket of its own, without reading the answer (closing the socket is
    the client going away)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def _events(lines) -> list:
    """The ``data:`` payloads of an event stream, JSON-decoded (``[DONE]`` as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


# ---------------------------------------------------------------------------------------------- a client that goes away


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    """The stderr of :func:`server`."""
    return tmp_path_factory.mktemp("lifecycle") / "stderr.txt"


@pytest.fixture(scope="module")
def server(models, server_log):
    proc, url = start_server(_args(models), server_log, ready=True)
    yield url
    stop_server(proc)


def test_non_streaming_client_gone_cancels_at_once(server):
    url = server
    before = _metrics(url)
    s = _send_raw(url, _LONG_BODY)
    wait_for(lambda: _metrics(url)["vllm:num_requests_running"] == 1, "the generation to run")
    s.close()
    after = wait_for(lambda: (m := _metrics(url))["speculant:requests_cancelled_total"]
                      > before["speculant:requests_cancelled_total"] and m, "the cancellation")
    cancelled = (after["speculant:cancelled_generation_tokens_total"]
                 - before["speculant:cancelled_generation_tokens_total"])
    assert 0 < cancelled < LONG / 2  # it used to decode all LONG tokens
    # the next request is served, and nothing else was decoded meanwhile
    r = httpx.post(url + "/v1/completions", json={**_LONG_BODY, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    end = _metrics(url)
    assert end["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == cancelled + 8


def test_queued_non_streaming_request_whose_client_left_never_starts(server):
    url = server
    before = _metrics(url)
    body = {**_LONG_BODY, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        queued = _send_raw(url, {**_LONG_BODY, "prompt": "y = 2"})
        wait_for(lambda: _metrics(url)["vllm:num_requests_waiting"] == 1, "the request to wait")
        queued.close()
        m = wait_for(lambda: (m := _metrics(url))["vllm:num_requests_waiting"] == 0 and m, "the queue to empty")
        assert m["vllm:num_requests_running"] == 1  # left while the first one was still decoding
    wait_for(lambda: _metrics(url)["speculant:requests_cancelled_total"]
              == before["speculant:requests_cancelled_total"] + 2, "both cancellations")
    after = _metrics(url)
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    first = httpx.post(url + "/v1/completions", json={**_LONG_BODY, "max_tokens": 1}, timeout=60).json()
    assert prompt == first["usage"]["prompt_tokens"]  # the queued one was never prefilled


def test_a_client_gone_while_sending_its_body_is_cancelled_not_failed(server, server_log):
    """A client that hangs up halfway through its request body cancelled its request: counted with the other
    cancellations, not as a failure, and without a traceback in the log; the server goes on."""
    url = server
    before = _metrics(url)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for path in ("/v1/completions", "/v1/chat/completions"):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny-" % path.encode())
    after = wait_for(lambda: (m := _metrics(url))["speculant:requests_cancelled_total"]
                     == before["speculant:requests_cancelled_total"] + 2 and m, "both cancellations")
    assert after["speculant:requests_failed_total"] == before["speculant:requests_failed_total"]
    assert after["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"]  # nothing reached the model
    log = server_log.read_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log and "unexpected error" not in log, log
    r = httpx.post(url + "/v1/completions", json={**_LONG_BODY, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------- limits


def _app(models, **kw):
    return create_app(check_settings(ServeSettings(target=models["target"], draft=models["draft"],
                                                   method="chain:k=4", model_name=MODEL, **kw)))


@pytest.fixture(scope="module")
def small(models):
    """A loaded in-process app taking bodies of at most 100,000 bytes (room for prompts too long to fit)."""
    with TestClient(_app(models, max_body_bytes=100_000), base_url="http://127.0.0.1") as client:
        until_loaded(client)
        yield client


def _too_large(r) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "--max-body-bytes" in err["message"], err


def test_bodies_over_the_limit_are_413_and_the_server_goes_on(small):
    big = json.dumps({"model": MODEL, "prompt": "a" * 150_000, "max_tokens": 2}).encode()
    _too_large(small.post("/v1/completions", content=big, headers={"content-type": "application/json"}))
    chunks = (big[i:i + 10_000] for i in range(0, len(big), 10_000))  # no Content-Length: counted as it comes
    _too_large(small.post("/v1/completions", content=chunks, headers={"content-type": "application/json"}))
    r = small.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 2000, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_413_reaches_a_real_client_that_sends_everything(server):
    """A client that sends its whole body before reading (httpx) hears the 413 instead of a reset connection."""
    big = json.dumps({"model": MODEL, "prompt": "a" * 5_000_000}).encode()
    _too_large(httpx.post(server + "/v1/completions", content=big, timeout=60,
                          headers={"content-type": "application/json"}))
    assert httpx.get(server + "/health", timeout=10).status_code == 200


class _SlowTokenizer:
    """The tokenizer, whose encoding waits for ``release`` (and counts its calls); every other attribute is the
    tokenizer's."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.started.set()
        self.release.wait(60)
        return self.inner(*args, **kwargs)


def test_health_answers_while_a_prompt_is_tokenised(small, monkeypatch):
    worker = small.app.state.worker
    slow = _SlowTokenizer(worker.tokenizer)
    monkeypatch.setattr(worker, "tokenizer", slow)
    answers = {}

    def post():
        answers["completion"] = small.post("/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2})

    def health():
        answers["health"] = small.get("/health")

    poster = threading.Thread(target=post)
    poster.start()
    try:
        assert slow.started.wait(30)
        checker = threading.Thread(target=health)
        checker.start()
        checker.join(20)  # tokenising on the event loop would block /health until the release
        assert not checker.is_alive() and answers["health"].status_code == 200
    finally:
        slow.release.set()
        poster.join(60)
    assert answers["completion"].status_code == 200, answers["completion"].text


def test_prompts_that_cannot_fit_are_refused_before_tokenising(small, monkeypatch):
    worker = small.app.state.worker
    slow = _SlowTokenizer(worker.tokenizer)
    slow.release.set()
    monkeypatch.setattr(worker, "tokenizer", slow)
    bound = CONTEXT * worker.token_chars  # more characters than this cannot fit in the context
    assert worker.token_chars == max(map(len, slow.inner.get_vocab()))
    for path, body, param in (
            ("/v1/completions", {"prompt": "ab" * (bound // 2 + 1)}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (bound // 2 + 1)},
                                                   {"role": "user", "content": "b" * (bound // 2 + 1)}]}, "messages"),
            ("/v1/completions", {"prompt": [1] * CONTEXT}, "prompt")):
        r = small.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert slow.calls == 0


def test_body_grace_and_online_options_are_checked(models, capsys):
    cli_error_line(capsys, ["serve", *_args(models, "--max-body-bytes", "0")], "--max-body-bytes")
    cli_error_line(capsys, ["serve", *_args(models, "--shutdown-grace", "-1")], "--shutdown-grace")
    with pytest.raises(ValueError, match="--shutdown-grace"):
        check_settings(ServeSettings(target=models["target"], draft=models["draft"], shutdown_grace=float("nan")))
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-min-z", "-0.5")], "--online-min-z")
    with pytest.raises(ValueError, match="--online-min-z"):
        check_settings(ServeSettings(target=models["target"], draft=models["draft"], online=True,
                                     online_min_z=float("nan")))
    cli_error_line(capsys, ["serve", *_args(models, "--online-traffic", "8")], "--online-traffic needs --online")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic", "-1")], "--online-traffic")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--no-online-distill")], "--no-online-distill needs")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic", "4", "--online-traffic-min-ngram",
                                            "4")], "--online-traffic-min-ngram")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic-min-ngram", "2")],
                   "--online-traffic-min-ngram needs --online-traffic")
    with pytest.raises(ValueError, match="--online-traffic-min-ngram"):
        check_settings(ServeSettings(target=models["target"], draft=models["draft"], online=True, online_traffic=4,
                                     online_traffic_min_ngram=0))
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic", "4", "--online-traffic-scoring",
                                            "often")], "--online-traffic-scoring")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic-scoring", "recent")],
                   "--online-traffic-scoring needs --online-traffic")
    with pytest.raises(ValueError, match="--online-traffic-scoring"):
        check_settings(ServeSettings(target=models["target"], draft=models["draft"], online=True, online_traffic=4,
                                     online_traffic_scoring="often"))
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic", "4", "--online-traffic-min-score",
                                            "1")], "--online-traffic-min-score")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic", "4", "--online-traffic-scoring",
                                            "recent", "--online-traffic-min-score", "0.2")],
                   "--online-traffic-min-score needs")
    with pytest.raises(ValueError, match="--online-traffic-min-score"):
        check_settings(ServeSettings(target=models["target"], draft=models["draft"], online=True, online_traffic=4,
                                     online_traffic_min_score=float("nan")))
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic", "4", "--online-traffic-tree",
                                            "-1")], "--online-traffic-tree")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic-tree", "8")],
                   "--online-traffic-tree needs")
    cli_error_line(capsys, ["serve", *_args(models, "--online", "--online-traffic", "4", "--online-traffic-scoring",
                                            "recent", "--online-traffic-tree", "8")], "--online-traffic-tree needs")
    with pytest.raises(ValueError, match="--online-traffic-tree"):
        check_settings(ServeSettings(target=models["target"], draft=models["draft"], online=True, online_traffic=4,
                                     online_traffic_tree=-2))


# ---------------------------------------------------------------------------------------------- draining


def test_a_draining_app_refuses_new_work_with_503(models):
    with TestClient(_app(models), base_url="http://127.0.0.1") as client:
        until_loaded(client)
        client.portal.call(client.app.state.drain.run)  # idle: done at once, and refusing from then on
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "shutting_down"
        assert client.get("/v1/models").status_code == 200  # reading is fine


def _stream(client: httpx.Client, url: str, **extra):
    body = {**_LONG_BODY, "stream": True, "stream_options": {"include_usage": True}, **extra}
    return client.stream("POST", url + "/v1/completions", json=body)


def _first_text(lines) -> None:
    for line in lines:  # read until some text arrived: the generation is running
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
            return
    raise AssertionError("the stream ended before any text")


def test_sigterm_lets_running_and_queued_streams_finish_and_refuses_new_work(models, tmp_path):
    proc, url = start_server(_args(models, "--shutdown-grace", "300"), tmp_path / "stderr.txt", ready=True)
    try:
        with httpx.Client(timeout=120) as c, _stream(c, url) as first, _stream(c, url, prompt="y = 2") as second:
            lines = first.iter_lines()
            _first_text(lines)
            wait_for(lambda: _metrics(url)["vllm:num_requests_waiting"] == 1, "the second request to wait")
            proc.send_signal(signal.SIGTERM)
            # two generations of LONG tokens are still to finish: the server drains, and refuses new work
            r = wait_for(lambda: (r := httpx.get(url + "/health", timeout=10)).status_code == 503 and r,
                          "the drain to begin")
            assert r.json()["status"] == "shutting_down"
            r = httpx.post(url + "/v1/completions", json={**_LONG_BODY, "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "server_shutting_down"
            for events in (_events(lines), _events(second.iter_lines())):
                assert events[-1] == "[DONE]"
                assert events[-3]["choices"][0]["finish_reason"] == "length"
                assert events[-2]["usage"]["completion_tokens"] == LONG
        assert proc.wait(60) == 0
    finally:
        stop_server(proc)


def test_sigterm_after_the_grace_ends_streams_with_abort_and_done(models, tmp_path):
    proc, url = start_server(_args(models, "--shutdown-grace", "0"), tmp_path / "stderr.txt", ready=True)
    answers = {}
    try:
        with httpx.Client(timeout=120) as c, _stream(c, url) as running:
            lines = running.iter_lines()
            _first_text(lines)

            def post():  # queued behind the stream, not streaming
                answers["queued"] = httpx.post(url + "/v1/completions", json={**_LONG_BODY, "prompt": "y"},
                                               timeout=120)

            poster = threading.Thread(target=post)
            poster.start()
            wait_for(lambda: _metrics(url)["vllm:num_requests_waiting"] == 1, "the second request to wait")
            proc.send_signal(signal.SIGTERM)
            events = _events(lines)
            poster.join(120)
        assert events[-1] == "[DONE]"
        last = events[-3]
        assert last["choices"][0]["finish_reason"] == "abort" and "speculant" in last
        assert 0 < events[-2]["usage"]["completion_tokens"] < LONG
        r = answers["queued"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
        assert proc.wait(60) == 0
    finally:
        stop_server(proc)
