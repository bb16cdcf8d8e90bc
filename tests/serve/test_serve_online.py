"""``speculant serve --online``: the drafter adapts between requests while answers stay exactly plain decoding's,
its version shows in /metrics, and ``--online-state`` carries it (and the traffic memory) across a restart. A real
server (a subprocess) serves the tiny chat pair in float, greedy."""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import model_metrics, start_server, stop_server  # noqa: E402

MODEL = "tiny-chat"
PROMPTS = ["def add(a, b):", "The sea is", "Write a poem", "x = 1\ny =", "Hello there, friend", "class Stack:"]


def _start(models, log, state, speculate: bool = True):
    args = ["--target", models[0], "--draft", models[1], "--method", "chain:k=3", "--served-model-name", MODEL,
            "--max-batch", "1", "--speculation", "on" if speculate else "off"]
    if state is not None:
        args += ["--online", "--online-every", "3", "--online-min-held", "1", "--online-min-z", "0",
                 "--online-traffic", "4", "--online-state", str(state)]
    return start_server(args, log, ready=True)


def _complete(url: str, prompt: str) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_an_online_server_adapts_exactly_and_resumes_its_state(chat_models, tmp_path):
    plain, url = _start(chat_models, tmp_path / "plain.txt", None, speculate=False)
    try:
        want = {p: _complete(url, p) for p in PROMPTS}
    finally:
        stop_server(plain)
    state = tmp_path / "online"
    server, url = _start(chat_models, tmp_path / "online.txt", state)
    try:
        for round_ in range(2):
            for p in PROMPTS:
                assert _complete(url, p) == want[p], (round_, p)  # exact before, during and after updates
        deadline = time.time() + 60
        while time.time() < deadline and "speculant:online_updates_total{" not in httpx.get(url + "/metrics").text:
            time.sleep(0.5)  # an update runs while the server is idle
        assert _complete(url, PROMPTS[0]) == want[PROMPTS[0]]
        metrics = model_metrics(url)
        assert metrics["speculant:online_buffer_bytes"] > 0
        version = metrics["speculant:online_drafter_version"]
    finally:
        stop_server(server)
    saved = json.loads((state / "online.json").read_text())
    assert saved["history"] and saved["version"] >= version
    traffic = torch.load(state / "traffic.pt", weights_only=True)  # the traffic memory: every request's tokens
    tokens, starts = traffic["tokens"].tolist(), traffic["starts"].tolist()
    answers = [want[p] for p in PROMPTS * 2 + PROMPTS[:1]]  # in the order served
    assert len(starts) == len(answers)
    for a, b, answer in zip(starts, starts[1:] + [len(tokens)], answers):
        assert tokens[a:b][-len(answer):] == answer  # each request's own prompt and answer
    again, url = _start(chat_models, tmp_path / "again.txt", state)
    try:
        resumed = model_metrics(url)  # before any request: what the state brought back
        assert resumed["speculant:online_drafter_version"] == saved["version"]
        assert resumed["speculant:online_buffer_bytes"] > 0
        assert _complete(url, PROMPTS[0]) == want[PROMPTS[0]]
    finally:
        stop_server(again)


def test_every_torch_op_of_an_online_server_runs_on_its_decoding_thread(chat_models, monkeypatch):
    """Loading, the online adapter's update steps and calls handed to the worker (image encoding) all run on the
    decoding thread, and the adapter starts no thread of its own: torch ops from a second thread slow the decoding
    thread's (the adapter's module doc). The adapter's steps run between requests and the answers stay exact."""
    import threading

    from fastapi.testclient import TestClient

    from helpers import until_loaded
    from speculant.serve import ServeSettings, check_settings, create_app
    from speculant.serve.worker import Worker
    from speculant.online import OnlineAdapter

    seen: dict[str, set] = {"load": set(), "work": set(), "call": set()}
    real_load, real_work = Worker.load, OnlineAdapter.work

    def load(self):
        seen["load"].add(threading.current_thread().name)
        return real_load(self)

    def work(self):
        seen["work"].add(threading.current_thread().name)
        return real_work(self)

    monkeypatch.setattr(Worker, "load", load)
    monkeypatch.setattr(OnlineAdapter, "work", work)
    settings = check_settings(ServeSettings(target=chat_models[0], draft=chat_models[1], method="chain:k=3",
                                            model_name=MODEL, max_batch=1, speculation="on", online=True,
                                            online_every=3, online_min_held=1, online_min_z=0))
    app = create_app(settings)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        until_loaded(c)
        body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        first = [c.post("/v1/completions", json={**body, "prompt": p}).json() for p in PROMPTS]
        deadline = time.time() + 60
        while time.time() < deadline and not app.state.worker.online.history:
            time.sleep(0.2)  # the worker takes the update's steps while idle
        assert app.state.worker.online.history, "no online update ran"
        again = [c.post("/v1/completions", json={**body, "prompt": p}).json() for p in PROMPTS]
        assert [r["choices"][0]["token_ids"] for r in again] == [r["choices"][0]["token_ids"] for r in first]
        worker = app.state.worker
        assert worker.call(lambda: seen["call"].add(threading.current_thread().name) or 7).result(30) == 7
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda: 1 / 0).result(30)
        assert "speculant-online" not in {t.name for t in threading.enumerate()}
    assert seen == {"load": {"speculant-worker"}, "work": {"speculant-worker"}, "call": {"speculant-worker"}}
