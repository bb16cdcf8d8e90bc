"""``speculant serve --ray --replicas 2``: the server as a Ray Serve deployment on a local Ray cluster, with
prefix-aware routing (a conversation's turns reach the replica that holds its prefix).

The routing key and the routed replica's request forwarding are checked in-process (no Ray needed); building the
routed application needs ``ray[serve]``, and the tests that start a cluster are slow (about a minute each on 2
cores: Ray starts its own processes, then two replicas each load the model); run them with ``make test-all`` or
``pytest -m slow tests/serve/test_serve_ray.py``. Ray tests are skipped without ``ray[serve]``
(``pip install "speculant[ray]"``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from helpers import chat_model_pair, serve_settings  # noqa: E402
from speculant.serve import create_app  # noqa: E402
from speculant.serve.ray_routing import REPLICA_HEADER, RoutedReplica, RoutedRequest, routing_key  # noqa: E402

try:
    import ray.serve  # noqa: F401
    HAS_RAY = True
except ImportError:
    HAS_RAY = False
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="needs ray[serve]: pip install 'speculant[ray]'")

LOCAL = "http://127.0.0.1"
SYSTEMS = ("You answer in one short sentence, politely, and never use more words than needed. " * 3,
           "Reply like a ship's captain: brisk orders, nautical words, and no apologies at all. " * 3)
ASKS = ("hello", "and then?", "thanks")


def _body(messages: list[dict], **extra) -> dict:
    return {"model": "tiny-chat", "messages": messages, "max_tokens": 12, "temperature": 0, **extra}


def test_routing_key_of_a_next_turn_extends_the_turn_before():
    turn1 = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi!"}, {"role": "user", "content": "more"}]
    key1, key2 = (routing_key(json.dumps(_body(m)).encode()) for m in (turn1, turn2))
    assert key1.startswith(SYSTEMS[0]) and key2.startswith(key1) and len(key2) > len(key1)
    other = routing_key(json.dumps(_body([{"role": "system", "content": SYSTEMS[1]}, *turn1[1:]])).encode())
    assert other[0] != key1[0]  # the role comes after the text: two system prompts share no prefix by role
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert routing_key(json.dumps(_body(parts)).encode()) == "ab\n<|user|>\n"
    assert routing_key(b'{"prompt": "def f(", "suffix": "return 1"}') == "def f("
    assert routing_key(b'{"prompt": [5, 17]}') == "5 17 "
    # llama.cpp's /infill: the files, then the prefix and the text at the cursor, as its FIM prompt starts
    assert routing_key(b'{"input_prefix": "def f(", "prompt": "x", "input_suffix": "1"}') == "def f(x"
    assert routing_key(b'{"input_extra": [{"filename": "a.py", "text": "A"}], "input_prefix": "p"}') == "a.py\nA\np"
    for bad in (b"", b"not json", b"[1, 2]", b'{"prompt": 3}', b'{"messages": "x"}', b"\xff"):
        assert routing_key(bad) == ""


def _forward(replica: RoutedReplica, body: dict, path: str = "/v1/chat/completions") -> tuple[dict, bytes]:
    """One request through a routed replica, as the ingress sends it: the response head and the whole body."""
    data = json.dumps(body).encode()
    req = RoutedRequest(prompt=routing_key(data), method="POST", path=path, query_string=b"",
                        headers=[(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                                 (b"content-length", str(len(data)).encode())], body=data,
                        client=("127.0.0.1", 5000), server=("127.0.0.1", 8000))

    async def collect():
        parts = [part async for part in replica(req)]
        return parts[0], b"".join(parts[1:])

    return asyncio.run(collect())


@pytest.mark.filterwarnings("ignore:coroutine 'RoutedReplica.__del__' was never awaited")  # the GC's own call
def test_routed_replica_answers_as_the_app_does(models):
    """The model replica behind the prefix router runs each forwarded request through the app: same answers
    (streamed too), its prefix cache reused by the next turn, errors as the app gives them."""
    settings = serve_settings(models)
    replica = RoutedReplica.__new__(RoutedReplica)
    asyncio.run(replica.__init__(settings))
    try:
        with TestClient(create_app(settings, load="startup"), base_url=LOCAL) as c:
            messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "hello"}]
            want = c.post("/v1/chat/completions", json=_body(messages)).json()
        head, raw = _forward(replica, _body(messages))
        assert head["status"] == 200 and (REPLICA_HEADER.encode(), b"") in head["headers"]
        got = json.loads(raw)
        answer = got["choices"][0]["message"]["content"]
        assert answer == want["choices"][0]["message"]["content"]
        turn2 = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
        head, raw = _forward(replica, _body(turn2))
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        head, raw = _forward(replica, _body(messages, stream=True))
        assert dict(head["headers"])[b"content-type"].startswith(b"text/event-stream")
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) == answer
        head, raw = _forward(replica, {"model": "tiny-chat", "messages": []})
        assert head["status"] == 400 and "error" in json.loads(raw)
    finally:
        asyncio.run(replica.__del__())


@needs_ray
def test_prefix_routing_builds_on_rays_prefix_router(models):
    """Two or more replicas get the ingress and Ray's PrefixCacheAffinityRouter; --ray-routing default or one
    replica the plain deployment; an unknown routing is a ValueError."""
    from speculant.serve.ray_app import build_deployment

    settings = serve_settings(models)
    routed = build_deployment(settings, 2, 1.0)
    assert routed._bound_deployment.name == "speculant"
    model = routed._bound_deployment.init_args[0]._bound_deployment
    assert model.name == "speculant-model" and model.num_replicas == 2
    router = model._deployment_config.request_router_config
    assert router.request_router_class.endswith("PrefixCacheAffinityRouter")
    assert router.request_router_kwargs["imbalanced_threshold"] == settings.max_batch
    for plain in (build_deployment(settings, 2, 1.0, routing="default"), build_deployment(settings, 1, 1.0)):
        assert plain._bound_deployment.name == "speculant" and not plain._bound_deployment.init_args
    with pytest.raises(ValueError, match="--ray-routing"):
        build_deployment(settings, 2, 1.0, routing="nearest")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ray(tmp_path, args: list[str]):
    """``speculant serve --ray ARGS`` on a free port with a HOME of its own; the process, its base URL, its log
    and that HOME, once it says it serves."""
    port = _free_port()
    home = tmp_path / "home"  # where Ray would write its auth token (~/.ray/auth_token)
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "speculant", "serve", "--ray", *args, "--port", str(port),
                                 "--threads", "1"], stdout=subprocess.DEVNULL, stderr=err, env=env,
                                start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            break
        if re.search(r"replica\(s\), at http://\S+/v1", log.read_text()):
            return proc, f"http://127.0.0.1:{port}", log, home
        time.sleep(0.5)
    _stop(proc)
    raise AssertionError(f"Ray Serve did not start: {log.read_text()}")


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group of the server this test started
            proc.wait()


@needs_ray
@pytest.mark.slow
def test_ray_prefix_routing_keeps_each_conversation_on_its_replica(tmp_path, models):
    """Two conversations of three turns, interleaved, on two replicas: every turn of a conversation is answered
    by the replica that answered its first (named in the response header), later turns reuse its prefix cache,
    and the answers are a single server's; a stream and an error pass through the router too."""
    httpx = pytest.importorskip("httpx")
    with TestClient(create_app(serve_settings(models), load="startup"), base_url=LOCAL) as c:
        want = []
        for system in SYSTEMS:
            messages, answers = [{"role": "system", "content": system}], []
            for ask in ASKS:
                messages.append({"role": "user", "content": ask})
                answers.append(c.post("/v1/chat/completions", json=_body(messages)).json()
                               ["choices"][0]["message"]["content"])
                messages.append({"role": "assistant", "content": answers[-1]})
            want.append(answers)
    proc, url, log, _ = _start_ray(tmp_path, ["--replicas", "2", "--target", models["target"], "--draft",
                                              models["draft"], "--method", "chain:k=4", "--served-model-name",
                                              "tiny-chat"])
    try:
        conversations = [[{"role": "system", "content": system}] for system in SYSTEMS]
        replicas: list[list[str]] = [[], []]
        got: list[list[str]] = [[], []]
        cached: list[list[int]] = [[], []]
        with httpx.Client(base_url=url, timeout=120) as http:
            for ask in ASKS:
                for i, messages in enumerate(conversations):
                    messages.append({"role": "user", "content": ask})
                    r = http.post("/v1/chat/completions", json=_body(messages))
                    assert r.status_code == 200, r.text
                    replicas[i].append(r.headers[REPLICA_HEADER])
                    body = r.json()
                    got[i].append(body["choices"][0]["message"]["content"])
                    cached[i].append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                    messages.append({"role": "assistant", "content": got[i][-1]})
            assert http.get("/health").json()["status"] == "ok"  # no prompt: load-balanced
            bad = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert bad.status_code == 400 and "error" in bad.json()  # the replica's own OpenAI-style error
            with http.stream("POST", "/v1/chat/completions", json=_body(conversations[0][:2], stream=True)) as r:
                assert r.headers[REPLICA_HEADER] == replicas[0][0]  # same system prompt: same replica
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            assert "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in lines[:-1] if json.loads(line[6:])["choices"]) == got[0][0]
        assert got == want
        for names, reused in zip(replicas, cached):
            assert len(set(names)) == 1 and names[0], replicas
            assert all(n > 0 for n in reused[1:]), cached
        assert replicas[0][0] != replicas[1][0], replicas  # the second conversation went to the idle replica
    finally:
        _stop(proc)
    assert proc.returncode == 0, log.read_text()


@needs_ray
@pytest.mark.slow
def test_ray_serve_two_replicas_streams_a_request(tmp_path):
    """Ray's own routing (--ray-routing default): a streamed request through Ray's proxy, no auth token."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    target, _ = chat_model_pair(tmp_path / "models", layers=2, context=256)
    proc, url, log, home = _start_ray(tmp_path, ["--replicas", "2", "--ray-routing", "default", "--target",
                                                 target, "--method", "ar", "--served-model-name", "tiny"])
    try:
        assert "2 replica(s)" in log.read_text()
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens <= 8
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert not (home / ".ray" / "auth_token").exists()  # RAY_AUTH_MODE=disabled for the local cluster
    finally:
        _stop(proc)
    assert proc.returncode == 0, log.read_text()
