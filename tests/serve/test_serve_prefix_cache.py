"""The server reuses prompt prefixes across requests: a conversation's next turn and requests that share a system
prompt compute only their new tokens, the answer is the same as without reuse, ``usage.prompt_tokens_details
.cached_tokens`` says how many prompt tokens were reused (streamed too), /metrics counts them under vLLM's names,
and ``--prefix-cache-mb`` is checked (0 turns reuse off)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from helpers import cli_error_line, serve_settings, until_loaded  # noqa: E402
from speculant.plan import DEFAULT_PREFIX_CACHE_MB  # noqa: E402
from speculant.serve import ServeSettings, create_app  # noqa: E402

LOCAL = "http://127.0.0.1"
SYSTEM = "You answer in one short sentence, politely, and never use more words than needed. " * 3


def _client(models, **kw):
    return TestClient(create_app(serve_settings(models, **kw)), base_url=LOCAL)


def _conversation(c, turns: int = 3, **extra) -> list[dict]:
    """Three turns of one conversation, greedy; each turn's response."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    out = []
    for turn in range(turns):
        r = c.post("/v1/chat/completions", json={"model": "tiny-chat", "messages": messages, "max_tokens": 16,
                                                  "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        out.append(body)
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"and then {turn}?"}]
    return out


def _metrics(c) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(c.get("/metrics").text) for s in f.samples
            if s.name.startswith("vllm:prefix_cache")}


def test_later_turns_reuse_earlier_ones_and_answer_the_same(models):
    with _client(models) as c, _client(models, prefix_cache_mb=0) as cold:
        until_loaded(c)
        until_loaded(cold)
        warm, fresh = _conversation(c), _conversation(cold)
        assert [r["choices"][0]["message"]["content"] for r in warm] == \
               [r["choices"][0]["message"]["content"] for r in fresh]
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in warm]
        # at least the previous turn's prompt (but its last token), in whole blocks of 16 (a random model's answer
        # need not tokenize again as it was generated, so its own blocks may not match)
        assert cached[0] == 0 and all(n >= 16 * ((before["usage"]["prompt_tokens"] - 1) // 16)
                                      for n, before in zip(cached[1:], warm)), cached
        assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in fresh)
        m = _metrics(c)
        assert m["vllm:prefix_cache_queries_total"] == sum(r["usage"]["prompt_tokens"] for r in warm)
        assert m["vllm:prefix_cache_hits_total"] == sum(cached)
        assert _metrics(cold) == {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}


def test_a_shared_system_prompt_is_reused_and_streamed_usage_says_so(models):
    with _client(models) as c:
        until_loaded(c)
        c.post("/v1/chat/completions", json={"model": "tiny-chat", "max_tokens": 2, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]})
        with c.stream("POST", "/v1/chat/completions", json={
                "model": "tiny-chat", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "second"}]}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16 * (len(SYSTEM) // 4 // 16) > 0, usage


def test_the_default_budget_is_the_sessions():
    assert ServeSettings().prefix_cache_mb == DEFAULT_PREFIX_CACHE_MB


@pytest.mark.parametrize("value", ["-1", "nan", "lots"])
def test_a_bad_budget_is_one_line_exit_2(capsys, value):
    cli_error_line(capsys, ["serve", "--prefix-cache-mb", value], "--prefix-cache-mb")
