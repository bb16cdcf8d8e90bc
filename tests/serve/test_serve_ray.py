"""``speculant serve --ray --replicas 2``: the server as a Ray Serve deployment on a local Ray cluster.

Slow (about a minute on 2 cores: Ray starts its own processes, then two replicas each load the model); run with
``make test-all`` or ``pytest -m slow tests/serve/test_serve_ray.py``. Skipped without ``ray[serve]``
(``pip install "speculant[ray]"``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve]: pip install 'speculant[ray]'")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import chat_model_pair  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_serve_two_replicas_streams_a_request(tmp_path):
    target, _ = chat_model_pair(tmp_path / "models", layers=2, context=256)
    port = _free_port()
    home = tmp_path / "home"  # where Ray would write its auth token (~/.ray/auth_token)
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "speculant", "serve", "--ray", "--replicas", "2", "--target", target, "--method",
             "ar", "--port", str(port), "--served-model-name", "tiny", "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            if re.search(r"2 replica\(s\), at http://\S+/v1", log.read_text()):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"Ray Serve did not start: {log.read_text()}")
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
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the process group of the server this test started
                proc.wait()
    assert proc.returncode == 0, log.read_text()
