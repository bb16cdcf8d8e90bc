"""The server's web page: ``GET /`` and the files it loads from ``/static/`` (its script and style, the vendored
marked, DOMPurify and highlight.js) with their types; the page names nothing elsewhere and has no inline script,
style or handler (it runs under ``default-src 'self'``). In a real headless chromium (skipped without one) against
a real ``speculant serve`` of the tiny chat pair: a two-turn conversation (the second request carries the first
exchange), accepted drafts coloured, the prompt-token line under each answer, markdown rendered with highlighted
code blocks, an answer's HTML shown as text, never run, a canned stream whose usage chunk reports reused
prompt tokens, and a canned stream of tool calls shown with their names and indented arguments."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from helpers import serve_settings, start_server, stop_server  # noqa: E402
from speculant.serve import create_app  # noqa: E402
from speculant.serve.page import PAGE, STATIC, WEB  # noqa: E402

LOCAL = "http://127.0.0.1"
VENDORED = {"marked/marked.umd.js": "marked v", "dompurify/purify.min.js": "DOMPurify",
            "highlight/highlight.min.js": "Highlight.js v", "highlight/github.min.css": "Theme: GitHub"}


@pytest.fixture(scope="module")
def unloaded(models):
    """An app that is never started (no model loads), with an API key: the page and its files need none."""
    return TestClient(create_app(serve_settings(models, api_key="k")), base_url=LOCAL)


def test_the_page_loads_only_its_own_files_and_nothing_inline(unloaded):
    r = unloaded.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.text == PAGE
    scripts = re.findall(r'<script\b[^>]*\bsrc="([^"]+)"[^>]*></script>', PAGE)
    styles = re.findall(r'<link rel="stylesheet" href="([^"]+)">', PAGE)
    assert scripts == ["/static/marked/marked.umd.js", "/static/dompurify/purify.min.js",
                       "/static/highlight/highlight.min.js", "/static/page.js"]
    assert styles == ["/static/highlight/github.min.css", "/static/page.css"]
    assert PAGE.count("<script") == len(scripts)  # no inline script
    assert "<style" not in PAGE and " style=" not in PAGE and not re.search(r"\son[a-z]+=", PAGE)
    assert "http:" not in PAGE and "https:" not in PAGE and "//" not in PAGE.replace("<!doctype", "")
    for ref in scripts + styles:
        assert unloaded.get(ref).status_code == 200, ref


def test_the_static_files_are_served_with_their_types(unloaded):
    assert set(VENDORED) | {"page.js", "page.css"} <= set(STATIC)
    for name, path in STATIC.items():
        r = unloaded.get("/static/" + name)
        assert r.status_code == 200, name
        want = "text/javascript" if name.endswith(".js") else "text/css"
        assert r.headers["content-type"] == want + "; charset=utf-8", name
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.content == path.read_bytes(), name
    for name, marker in VENDORED.items():
        assert marker in unloaded.get("/static/" + name).text[:600], name
        assert (WEB / name).parent.joinpath("LICENSE").is_file(), name
    for name in ("README.md", "marked/LICENSE", "../serve/page.py", "%2e%2e/serve/page.py", "nope.js", ""):
        r = unloaded.get("/static/" + name)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", name


def test_the_vendored_versions_are_the_ones_the_readme_names():
    readme = (WEB / "README.md").read_text()
    for name, pattern in (("marked/marked.umd.js", r"marked v(\S+) "), ("dompurify/purify.min.js", r"DOMPurify (\S+) "),
                          ("highlight/highlight.min.js", r"Highlight.js v(\S+) ")):
        version = re.search(pattern, (WEB / name).read_text()[:600]).group(1)
        assert f"| {version} |" in readme, (name, version)


# ------------------------------------------------------------------------------------------- in a browser

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    from webdriver import browser_paths

    if browser_paths() is None:
        pytest.skip("chromium and chromedriver are not installed (apt install chromium chromium-driver)")
    proc, url = start_server(["--target", models["target"], "--draft", models["draft"], "--method", "chain:k=3",
                              "--served-model-name", MODEL, "--speculation", "on"],
                             tmp_path_factory.mktemp("page") / "stderr.txt", ready=True)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def browser(server):
    from webdriver import Browser

    with Browser() as b:
        b.open(server + "/")
        b.wait(f"return document.getElementById('model').textContent === '{MODEL}'", what="the model list")
        # record the request bodies the page sends
        b.js("window.sent = []; const f = window.fetch; window.fetch = (url, o) => { "
             "if (o && o.body) window.sent.push(JSON.parse(o.body)); return f(url, o); };")
        yield b


def _ask(b, text: str, turn: int) -> str:
    b.type("#prompt", text)
    b.click("#send")
    b.wait(f"return document.querySelectorAll('.meta').length === {turn} && "
           f"document.querySelectorAll('.meta')[{turn - 1}].textContent.length > 0 && "
           "!document.getElementById('send').disabled", timeout=120, what=f"answer {turn}")
    return b.js(f"return document.querySelectorAll('.assistant')[{turn - 1}].textContent")


def test_a_conversation_of_two_turns_in_the_browser(browser, tmp_path):
    b = browser
    b.js("document.getElementById('max').value = '40'")
    first = _ask(b, "Write a poem about the sea.", 1)
    assert len(first) > 10
    assert b.js("return document.querySelectorAll('.assistant .draft').length") > 0  # coloured drafts
    assert b.js("return document.querySelector('#log.drafts') !== null")
    final = b.js("return document.getElementById('final').textContent")
    assert "τ" in final and "target calls" in final
    assert float(b.js("return document.getElementById('tau').textContent")) > 1.0
    meta1 = b.js("return document.querySelector('.meta').textContent")
    assert re.match(r"prompt \d+ tokens(, \d+ reused)? · \d+ tokens · τ ", meta1), meta1

    second = _ask(b, "And one about the moon.", 2)
    assert second
    sent = b.js("return window.sent.filter(s => s.messages)")
    assert len(sent) == 2
    assert all(s["stream"] and s["stream_options"] == {"include_usage": True} for s in sent)
    assert sent[0]["messages"] == [{"role": "user", "content": "Write a poem about the sea."}]
    history = sent[1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user"]
    assert history[1]["content"].strip() and history[2]["content"] == "And one about the moon."
    meta2 = b.js("return document.querySelectorAll('.meta')[1].textContent")
    prompts = [int(re.match(r"prompt (\d+)", m).group(1)) for m in (meta1, meta2)]
    assert prompts[1] > prompts[0]  # the second prompt holds the first exchange
    assert [u["role"] for u in b.js("return window.speculantPage.messages")] == ["user", "assistant"] * 2

    b.screenshot(tmp_path / "page.png")
    assert (tmp_path / "page.png").read_bytes()[:4] == b"\x89PNG"

    b.click("#new")  # a new chat: the log and the history are empty
    assert b.js("return document.getElementById('log').children.length") == 0
    assert b.js("return window.speculantPage.messages.length") == 0
    b.click("#drafts")
    assert b.js("return document.querySelector('#log.drafts') === null")
    b.click("#drafts")


def test_markdown_renders_with_highlighted_code_blocks(browser):
    b = browser
    md = ("# Title\n\nSome **bold** and `code`.\n\n```python\ndef add(a, b):\n    return a + b  # sum\n```\n\n"
          "- one\n- two\n")
    html = b.js("return window.speculantPage.render(arguments[0])", md)
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html and "<li>one</li>" in html
    assert re.search(r'<pre><code class="hljs language-python">.*<span class="hljs-keyword">def</span>', html, re.S)
    assert '<span class="hljs-comment"># sum</span>' in html
    # the characters of draft tokens are coloured in the rendered text, code included
    origins = ["draft" if 38 <= i < 60 else "target" for i in range(len(md))]
    coloured = b.js("return window.speculantPage.render(arguments[0], arguments[1])", md, origins)
    assert '<span class="draft">' in coloured
    assert re.sub(r"<[^>]+>", "", coloured) == re.sub(r"<[^>]+>", "", html)  # the same text
    # unclosed fence while streaming: still a code block
    assert "<pre><code" in b.js("return window.speculantPage.render(arguments[0])", "```js\nlet x = 1;")


def test_html_in_an_answer_is_shown_not_run(browser):
    b = browser
    b.js("window.pwned = 0")
    evil = ('Hi <img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>\n\n'
            '<div onclick="window.pwned=3">block</div>\n\n[link](javascript:window.pwned=4) ![pic](/nope.png)')
    html = b.js("return window.speculantPage.render(arguments[0])", evil)
    assert "<img" not in html and "<script" not in html and "<div" not in html and "javascript:" not in html
    assert "&lt;img" in html and "&lt;script&gt;" in html
    # in the page: put into an answer's element, as the page does
    b.js("const d = document.createElement('div'); d.className = 'assistant'; d.id = 'evil';"
         "d.innerHTML = window.speculantPage.render(arguments[0]); document.getElementById('log').appendChild(d);"
         "d.querySelectorAll('a').forEach(a => a.click());", evil)
    assert b.js("return window.pwned") == 0
    text = b.js("return document.getElementById('evil').textContent")
    assert '<img src=x onerror="window.pwned=1">' in text and "<script>window.pwned=2</script>" in text
    b.js("document.getElementById('evil').remove()")


def _ask_canned(b, chunks: list[dict], prompt: str) -> str:
    """Send ``prompt`` from the page, its chat request answered with ``chunks`` as a stream (30 ms apart, then
    ``[DONE]``; the request bodies are recorded in ``window.sent``); the answer's meta line once it is there."""
    b.js("window.sent = []; const chunks = arguments[0], real = window.fetch;"
         "window.fetch = (url, o) => { if (!String(url).includes('/chat/')) return real(url, o);"
         "  window.sent.push(JSON.parse(o.body)); const enc = new TextEncoder();"
         "  const body = new ReadableStream({async start(c) {"
         "    for (const ch of chunks) { c.enqueue(enc.encode('data: ' + JSON.stringify(ch) + '\\n\\n'));"
         "      await new Promise(r => setTimeout(r, 30)); }"
         "    c.enqueue(enc.encode('data: [DONE]\\n\\n')); c.close(); }});"
         "  return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}})); };",
         chunks)
    b.type("#prompt", prompt)
    b.click("#send")
    return b.wait("return document.querySelector('.meta') && document.querySelector('.meta').textContent",
                  what="the canned answer")


def test_a_streamed_answer_shows_the_reused_prompt_tokens_and_renders_its_code(browser):
    """The page's own stream handling against a canned stream: markdown arriving in pieces, the usage chunk with
    ``prompt_tokens_details.cached_tokens`` (the server's prefix cache) shown under the answer."""
    b = browser
    b.click("#new")
    pieces = ["Use this:\n\n```py", "thon\nprint('hi')  # greet\n", "```\n\nDone <b>now</b>."]
    chunks = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}],
               "speculant": {"tokens": 3, "accepted": 2, "sources": [[len(p), "draft"]]}} for p in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "speculant": {"acceptance_length": 3.0, "target_calls": 3, "method": "chain:k=3"}})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49,
                                            "prompt_tokens_details": {"cached_tokens": 32}}})
    try:
        meta = _ask_canned(b, chunks, "How do I greet?")
        assert meta.startswith("prompt 40 tokens, 32 reused · 9 tokens · τ 3.00"), meta
        assert meta.endswith("stop")
        code = b.js("const c = document.querySelector('.assistant pre code.hljs.language-python');"
                    "return c && c.innerHTML")
        assert code and 'class="hljs-built_in"' in code and "hljs-comment" in code, code
        assert b.js("return document.querySelector('.assistant').textContent").strip().endswith("Done <b>now</b>.")
        assert b.js("return document.querySelectorAll('.assistant b').length") == 0
        assert b.js("return document.querySelectorAll('.assistant .draft').length") > 0  # all draft: coloured
        assert b.js("return window.speculantPage.messages")[1] == {"role": "assistant", "content": "".join(pieces)}
    finally:
        b.js("window.location.reload()")
        b.wait(f"return document.getElementById('model').textContent === '{MODEL}'", what="the reloaded page")


def test_a_tool_call_is_shown_with_its_name_and_arguments(browser):
    """A canned stream whose answer is two tool calls (OpenAI's ``delta.tool_calls``, the arguments of the first in
    two pieces): each shown under the answer with its name and indented arguments, as text; the request carried
    the settings' tools and the conversation keeps the calls."""
    b = browser
    b.click("#new")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    b.js("document.getElementById('tools').value = arguments[0]", json.dumps([tool]))
    deltas = [{"content": "Let me look."},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"<b>Paris</b>", "days": 2}'}}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "now", "arguments": "{}"}}]}]
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                   "speculant": {"acceptance_length": 2.0, "target_calls": 9, "method": "chain:k=3"}})
    try:
        meta = _ask_canned(b, chunks, "Weather in Paris?")
        assert meta.endswith("tool_calls"), meta
        assert b.js("return window.sent[0].tools") == [tool]
        names = b.js("return [...document.querySelectorAll('.tool-call .tool-name')].map(e => e.textContent)")
        assert names == ["tool call: get_weather", "tool call: now"]
        args = b.js("return [...document.querySelectorAll('.tool-call pre')].map(e => e.textContent)")
        assert args == ['{\n  "city": "<b>Paris</b>",\n  "days": 2\n}', "{}"]
        assert b.js("return document.querySelectorAll('.tool-call b').length") == 0  # text, not HTML
        assert b.js("return document.querySelector('.assistant').textContent").strip() == "Let me look."
        last = b.js("return window.speculantPage.messages")[1]
        assert last["content"] == "Let me look." and [c["function"]["name"] for c in last["tool_calls"]] == [
            "get_weather", "now"]
        assert last["tool_calls"][0]["function"]["arguments"] == '{"city": "<b>Paris</b>", "days": 2}'
        b.js("document.getElementById('tools').value = '[oops'")
        b.type("#prompt", "again")
        b.click("#send")
        assert "tools: not valid JSON" in b.wait(
            "const e = document.querySelector('.error'); return e && e.textContent", what="the tools error")
    finally:
        b.js("document.getElementById('tools').value = ''; window.location.reload()")
        b.wait(f"return document.getElementById('model').textContent === '{MODEL}'", what="the reloaded page")
