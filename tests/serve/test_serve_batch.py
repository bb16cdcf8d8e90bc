"""Continuous batching in ``speculant serve`` (``--max-batch``): concurrent requests are decoded together, one
target forward per step, each answered as it would be alone; a client that goes away leaves the batch at the next
step while the others go on; a failing step fails its requests only; /metrics shows the batch.

A real server (a subprocess) serves the tiny chat pair in q4 (row-independent: a request's tokens are the same
bits in a batch as alone), greedy."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import model_metrics, start_server, stop_server, wait_for  # noqa: E402

MODEL = "tiny-chat"
PROMPTS = ["def add(a, b):", "The sea is", "Write a poem", "x = 1\ny =", "Hello there, friend"]


@pytest.fixture(scope="module")
def models(chat_models):
    return {"target": chat_models[0], "draft": chat_models[1]}


def _start(models, tmp_path_factory, batch: int):
    args = ["--target", models["target"], "--draft", models["draft"], "--method", "chain:k=3", "--quantization",
            "q4", "--served-model-name", MODEL, "--max-batch", str(batch), "--speculation", "on",
            "--prefill-chunk", "8"]
    return start_server(args, tmp_path_factory.mktemp(f"batch{batch}") / "stderr.txt", ready=True)


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    batched, url = _start(models, tmp_path_factory, 4)
    alone, url1 = _start(models, tmp_path_factory, 1)
    yield url, url1
    stop_server(batched)
    stop_server(alone)


_metrics = model_metrics


def _complete(url: str, prompt: str, n: int = 120, client: httpx.Client | None = None, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = (client or httpx).post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_requests_share_steps_and_get_their_own_answers(servers):
    url, url1 = servers
    want = {p: _complete(url1, p) for p in PROMPTS}  # one at a time
    before = _metrics(url)
    got: dict[str, dict] = {}
    start = threading.Barrier(len(PROMPTS))

    def ask(p: str) -> None:  # clients made first, then every request sent at once: they arrive together even on a
        with httpx.Client() as client:  # loaded machine (making a client takes tens of ms there)
            start.wait()
            got[p] = _complete(url, p, client=client)

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in PROMPTS:
        assert got[p]["choices"][0]["token_ids"] == want[p]["choices"][0]["token_ids"], p
        assert got[p]["choices"][0]["text"] == want[p]["choices"][0]["text"]
        stats = got[p]["speculant"]
        assert stats["target_calls"] == want[p]["speculant"]["target_calls"]  # the engine's own step count
        assert stats["accepted_tokens"] == want[p]["speculant"]["accepted_tokens"]
    after = _metrics(url)
    steps = after["speculant:batch_steps_total"] - before["speculant:batch_steps_total"]
    calls = after["speculant:target_calls_total"] - before["speculant:target_calls_total"]
    assert calls == sum(g["speculant"]["target_calls"] for g in got.values())
    assert steps < 0.7 * calls  # most steps served several requests with one forward
    rows = after["speculant:step_rows_sum"] - before["speculant:step_rows_sum"]
    assert rows / steps > 4  # a step carried more than one request's root and chain
    shared = after["speculant:shared_draft_forwards_total"] - before["speculant:shared_draft_forwards_total"]
    served = after["speculant:shared_draft_requests_total"] - before["speculant:shared_draft_requests_total"]
    assert shared > 0 and served > 1.5 * shared  # requests drafted in shared forwards
    assert after["vllm:num_requests_running"] == 0


def test_a_client_that_goes_away_leaves_the_batch_and_the_others_go_on(servers):
    url, url1 = servers
    want = _complete(url1, PROMPTS[0], n=200)
    before = _metrics(url)
    result: dict = {}
    other = threading.Thread(target=lambda: result.update(_complete(url, PROMPTS[0], n=200)))
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        other.start()
        wait_for(lambda: _metrics(url)["vllm:num_requests_running"] == 2, "both requests in the batch")
    other.join()
    assert result["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    after = wait_for(lambda: (m := _metrics(url))["speculant:requests_cancelled_total"]
                     > before["speculant:requests_cancelled_total"] and m, "the cancellation")
    cancelled = after["speculant:cancelled_generation_tokens_total"] - before[
        "speculant:cancelled_generation_tokens_total"]
    assert 0 < cancelled < 1500 / 2
    wait_for(lambda: _metrics(url)["vllm:num_requests_running"] == 0, "the batch to empty")


def test_a_long_prompt_joins_a_running_stream_in_chunks(servers):
    """A request with a long prompt (token ids, at most attention.MAX_ROWS of them, so that a whole prefill also
    attends row by row) joins a running stream: its prompt goes in 8 tokens per step inside the stream's steps, and
    both answers are each one's alone."""
    url, url1 = servers
    long = [(7 * i) % 90 + 10 for i in range(60)]
    want_long = _complete(url1, long, n=12)
    want_stream = _complete(url1, PROMPTS[2], n=400)
    before = _metrics(url)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        got_long = _complete(url, long, n=12)
        text = "".join(__import__("json").loads(line[6:])["choices"][0]["text"] for line in lines
                       if line.startswith("data: {"))
    assert got_long["choices"][0]["token_ids"] == want_long["choices"][0]["token_ids"]
    assert text and want_stream["choices"][0]["text"].endswith(text)
    chunked = _metrics(url)["speculant:prefill_chunk_tokens_total"] - before["speculant:prefill_chunk_tokens_total"]
    assert chunked >= 8  # at least one chunk rode in the stream's steps


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(models, monkeypatch):
    from fastapi.testclient import TestClient

    from helpers import until_loaded
    from speculant.core.batch import Batch
    from speculant.serve import ServeSettings, check_settings, create_app

    real, calls = Batch.step, []

    def flaky(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom in a step")
        return real(self)

    monkeypatch.setattr(Batch, "step", flaky)
    app = create_app(check_settings(ServeSettings(target=models["target"], draft=models["draft"],
                                                  method="chain:k=3", model_name=MODEL, max_batch=2)))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 20, "ignore_eos": True}
    with TestClient(app, base_url="http://127.0.0.1") as c:
        until_loaded(c)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and "boom in a step" in r.text
        r = c.post("/v1/completions", json=body)  # a fresh batch
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        assert "speculant:requests_failed_total" in c.get("/metrics").text
        # a request may set its own speculation
        r = c.post("/v1/completions", json={**body, "speculant_speculation": "off"})
        assert r.status_code == 200 and r.json()["speculant"]["draft_tokens"] == 0
        r = c.post("/v1/completions", json={**body, "speculant_speculation": "on"})
        assert r.json()["speculant"]["draft_tokens"] > 0
        r = c.post("/v1/completions", json={**body, "speculant_speculation": "always"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculant_speculation"


def test_max_batch_is_checked():
    from speculant.serve import ServeSettings, check_settings

    with pytest.raises(ValueError, match="--max-batch must be >= 1"):
        check_settings(ServeSettings(target="x", max_batch=0))
    with pytest.raises(ValueError, match="--prefill-chunk must be >= 0"):
        check_settings(ServeSettings(target="x", prefill_chunk=-1))


# -------------------------------------------------------------- the sources of the characters (the web page)


def test_a_stream_can_say_which_characters_were_accepted_drafts(servers):
    url, _ = servers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 60,
            "temperature": 0, "stream": True, "speculant_sources": True}
    chunks = []
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(__import__("json").loads(line[6:]))
    texts = [(c["choices"][0]["delta"].get("content"), c.get("speculant")) for c in chunks if c["choices"]]
    annotated = [(t, sp) for t, sp in texts if t]
    assert annotated and all(sp is not None and "sources" in sp for _, sp in annotated)
    for text, sp in annotated:
        assert sum(n for n, _ in sp["sources"]) == len(text)  # the spans cover the chunk's characters
        assert {src for _, src in sp["sources"]} <= {"draft", "target"}
    for _, sp in annotated:  # draft characters only from steps that accepted drafts
        assert sp["accepted"] > 0 or all(src == "target" for _, src in sp["sources"])
    assert any(src == "draft" for _, sp in annotated for _, src in sp["sources"])  # drafts were accepted
    assert sum(sp["tokens"] for _, sp in annotated) <= 60


def test_the_checked_settings_keep_a_packaged_targets_quantization(models, monkeypatch):
    """check_settings turns a target name into its directory; the packaged default quantization found by the name
    must travel with it (a later resolve of the directory finds none: the 1.5B was served unquantized)."""
    from speculant.models import loading
    from speculant.serve import ServeSettings, check_settings

    monkeypatch.setattr(loading, "default_quantization_for", lambda target: "q4")
    settings = check_settings(ServeSettings(target=models["target"], draft=models["draft"], method="chain:k=2"))
    assert settings.quantization == "q4"
    monkeypatch.setattr(loading, "default_quantization_for", lambda target: None)
    assert check_settings(settings).quantization == "q4"  # resolving the checked settings again keeps it


def test_a_replica_that_loads_at_startup_loads_on_its_decoding_thread_and_is_ready(models, monkeypatch):
    """``load="startup"`` (a Ray Serve replica): the app's startup waits for the model, loaded on the worker's own
    thread (the one that decodes: torch ops from another thread would slow it), and is ready when it returns; a
    model that fails to load fails the startup with its reason."""
    import threading

    from fastapi.testclient import TestClient

    from speculant.serve import ServeSettings, check_settings, create_app
    from speculant.serve.worker import Worker

    threads, real = [], Worker.load

    def load(self):
        threads.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(Worker, "load", load)
    settings = check_settings(ServeSettings(target=models["target"], method="ar", model_name=MODEL))
    with TestClient(create_app(settings, load="startup"), base_url="http://127.0.0.1") as c:
        assert c.get("/health").status_code == 200  # no waiting: startup returned with the model loaded
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
        assert c.post("/v1/completions", json=body).status_code == 200
    assert threads == ["speculant-worker"]

    def broken(self):
        raise ValueError("no such weights")

    monkeypatch.setattr(Worker, "load", broken)
    with pytest.raises(RuntimeError, match="no such weights"):
        with TestClient(create_app(settings, load="startup"), base_url="http://127.0.0.1"):
            pass
