"""The Host/Origin guard of a server without an API key: only loopback hosts (or the one ``--host`` names) are
served, and cross-origin requests need ``--allow-origin``; with a key, the key protects the server. Apps that are
never started (no model loads): the guard answers before any route. A malformed ``Host`` is 400 either way; every
response is ``nosniff``, the page carries a Content-Security-Policy; ``/metrics`` needs the key with
``--metrics-need-key``."""

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


def test_malformed_hosts_are_400_with_or_without_a_key(unloaded):
    port = 8000
    bad = (f"127.0.0.1:{port}@evil.example", "127.0.0.1@evil", "evil.example#127.0.0.1", "127.0.0.1:abc",
           "user@127.0.0.1", "127.0.0.1/x", "127.0.0.1 evil", "127.0.0.1:", "127.0.0.1:99999", "[::1", "[evil]:80",
           "[::1]x", ":8000", "loc%61lhost")
    for c in (unloaded(), unloaded(api_key="k")):
        for host in bad:
            r = c.get("/health", headers={"Host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
            assert r.headers["x-content-type-options"] == "nosniff"
        r = c.get("/health", headers=[("Host", "127.0.0.1"), ("Host", "evil.example")])
        assert r.status_code == 400, r.text  # two Host headers: which one would the check be about?
    c = unloaded()
    for host in (f"[::1]:{port}", "[::1]", "[0:0:0:0:0:0:0:1]:1", "localhost.:8000", "127.0.0.1", "LocalHost"):
        assert c.get("/health", headers={"Host": host}).status_code == 503, host  # loading: past the guard
    assert unloaded(host="::1").get("/health", headers={"Host": "[::1]:1"}).status_code == 503
    assert unloaded(host="fe80::5").get("/health", headers={"Host": "[FE80::5]:1"}).status_code == 503
    assert unloaded(host="fe80::5").get("/health", headers={"Host": "[fe80::6]:1"}).status_code == 421


def test_metrics_need_the_key_only_with_metrics_need_key(unloaded, models):
    assert unloaded(api_key="k").get("/metrics").status_code == 200  # open by default, as vLLM serves it
    closed = unloaded(api_key="k", metrics_need_key=True)
    r = closed.get("/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert closed.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = closed.get("/metrics", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text
    assert closed.get("/health").status_code == 503  # /health stays open (loading)
    with pytest.raises(ValueError, match="--metrics-need-key needs --api-key"):
        serve_settings(models, metrics_need_key=True)


def test_help_says_which_routes_the_key_leaves_open():
    import argparse

    from speculant.commands import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    helps = {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
    for flag in ("--api-key", "--metrics-need-key"):
        assert "/metrics" in helps[flag] and "/health" in helps[flag] and "open" in helps[flag], helps[flag]
    assert "--metrics-need-key" in helps["--api-key"]
    assert p.parse_args([]).metrics_need_key is False


def test_every_response_is_nosniff_and_the_page_has_a_strict_csp(unloaded):
    import base64
    import hashlib
    import re

    from speculant.serve.page import PAGE

    c = unloaded()
    for r in (c.get("/health"), c.get("/metrics"), c.get("/nowhere"), c.get("/health", headers={"Host": "evil"}),
              c.post("/v1/completions", json=_COMPLETION, headers={"Origin": "http://evil.example"})):
        assert r.headers["x-content-type-options"] == "nosniff", r.status_code
    assert "content-security-policy" not in c.get("/health").headers
    page = c.get("/")
    assert page.status_code == 200 and page.text == PAGE
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    policy = dict(d.strip().split(" ", 1) for d in page.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'self'" and policy["connect-src"] == "'self'"
    assert policy["img-src"] == "'self' data:" and policy["frame-ancestors"] == "'none'"
    assert policy["base-uri"] == "'none'" and "unsafe" not in page.headers["content-security-policy"]
    for tag in ("script", "style"):  # the server's own files, and the page's own inline blocks by hash
        blocks = [b for b in re.findall(rf"<{tag}\b[^>]*>(.*?)</{tag}>", PAGE, re.S) if b.strip()]
        assert policy[f"{tag}-src"].split() == ["'self'"] + [
            f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks]
    assert not re.search(r"<[^>]+\son[a-z]+=|style=", PAGE)  # no inline handlers or style attributes: CSP blocks them
