"""``speculant serve --online``: the drafter adapts between requests while answers stay exactly plain decoding's,
its version shows in /metrics, and ``--online-state`` carries it across a restart. A real server (a subprocess)
serves the tiny chat pair in float, greedy."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import model_metrics, start_server, stop_server  # noqa: E402

MODEL = "tiny-chat"
PROMPTS = ["def add(a, b):", "The sea is", "Write a poem", "x = 1\ny =", "Hello there, friend", "class Stack:"]


def _start(models, log, state, speculate: bool = True):
    args = ["--target", models[0], "--draft", models[1], "--method", "chain:k=3", "--served-model-name", MODEL,
            "--max-batch", "1", "--speculation", "on" if speculate else "off"]
    if state is not None:
        args += ["--online", "--online-every", "3", "--online-state", str(state)]
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
    again, url = _start(chat_models, tmp_path / "again.txt", state)
    try:
        resumed = model_metrics(url)  # before any request: what the state brought back
        assert resumed["speculant:online_drafter_version"] == saved["version"]
        assert resumed["speculant:online_buffer_bytes"] > 0
        assert _complete(url, PROMPTS[0]) == want[PROMPTS[0]]
    finally:
        stop_server(again)
