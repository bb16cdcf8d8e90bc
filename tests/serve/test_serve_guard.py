"""The Host/Origin guard of a server without an API key: only loopback hosts (or the one ``--host`` names) are
served, and cross-origin requests need ``--allow-origin``; with a key, the key protects the server. Apps that are
never started (no model loads): the guard answers before any route."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from helpers import serve_settings  # noqa: E402
from speculant.serve import create_app  # noqa: E402

MODEL = "tiny-chat"
LOCAL = "http://127.0.0.1"
_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def unloaded(models):
    """Apps that are never started (no model loads): the guard answers before any route."""
    def make(**kw) -> TestClient:
        return TestClient(create_app(serve_settings(models, **kw)), base_url=LOCAL)
    return make


def test_without_a_key_only_loopback_hosts_are_served(unloaded):
    c = unloaded()
    for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "127.0.0.2"):
        assert c.get("/health", headers={"Host": host}).status_code == 503, host  # loading: past the guard
    for host in ("evil.example", "evil.example:8000", "10.0.0.5:8000", "localhost.evil.example"):
        r = c.get("/health", headers={"Host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request", host
    every = unloaded(host="0.0.0.0")
    assert every.get("/health", headers={"Host": "10.0.0.5:8000"}).status_code == 503
    assert every.get("/health", headers={"Host": "rebound.example"}).status_code == 421
    named = unloaded(host="myhost.lan")
    assert named.get("/health", headers={"Host": "myhost.lan:8000"}).status_code == 503
    keyed = unloaded(api_key="k")
    assert keyed.get("/health", headers={"Host": "evil.example"}).status_code == 503  # the key protects it


def test_cross_origin_requests_need_allow_origin(unloaded):
    c = unloaded()
    r = c.post("/v1/completions", json=_COMPLETION, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert c.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                 "Access-Control-Request-Method": "POST"}).status_code == 403
    assert c.post("/v1/completions", json=_COMPLETION, headers={"Origin": "null"}).status_code == 403
    same = c.post("/v1/completions", json=_COMPLETION, headers={"Origin": LOCAL, "Host": "127.0.0.1"})
    assert same.status_code == 503  # its own origin: past the guard (the model is not loaded)
    assert c.post("/v1/completions", json=_COMPLETION).status_code == 503  # no Origin: not a browser

    app = "http://localhost:3000"
    allowed = unloaded(allow_origin=(app + "/",))
    pre = allowed.options("/v1/chat/completions", headers={
        "Origin": app, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == app
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = allowed.get("/health", headers={"Origin": app})
    assert r.headers["access-control-allow-origin"] == app and "Origin" in r.headers["vary"]
    assert allowed.get("/health", headers={"Origin": "http://localhost:3001"}).status_code == 403
    anyone = unloaded(allow_origin=("*",))
    assert anyone.get("/health", headers={"Origin": "http://x.example"}).headers["access-control-allow-origin"] == "*"

    keyed = unloaded(api_key="k")  # with a key and no --allow-origin: Origin is not checked
    assert keyed.get("/health", headers={"Origin": "http://evil.example"}).status_code == 503
    keyed_allow = unloaded(api_key="k", allow_origin=(app,))
    assert keyed_allow.get("/health", headers={"Origin": "http://evil.example"}).status_code == 403
    assert keyed_allow.get("/health", headers={"Origin": app}).status_code == 503
