"""Log-probabilities of the emitted tokens (``generate(..., logprobs=K)``, OpenAI's ``logprobs``/``top_logprobs``).

They come out of verification (the target's rows along the accepted path), so they must equal a plain
teacher-forced target forward over prompt + output, for accepted draft tokens and bonus tokens alike, for every
drafting method, greedy and sampled; asking for them must not change the tokens. The server serves them in
OpenAI's shapes (chat and completions, streamed and not)."""

from __future__ import annotations

import json

import pytest
import torch

import speculant
from speculant.drafters.registry import build_drafter
from speculant.tiny_models import perturbed, tiny_model

VOCAB = 96
N = 20
TOP = 3
# the target repeats itself after this prompt (77 77 77 ...), so prompt lookup gets draft tokens accepted too
PROMPT = [3, 4]
METHODS = ["ar", "chain:k=3", "tree:budget=10:topk=3:depth=4", "rsd-c:branching=2/2/1", "specinfer:width=2:depth=3",
           "lookup", "mask-probe"]
# float32 rounding between the engine's forward (lean, tree-masked, cached) and one plain transformers forward
ATOL, RTOL = 5e-5, 1e-5
# seed 0: every method gets draft tokens accepted in its 20 sampled tokens (the test asserts it covered them)
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=40, top_p=0.95, seed=0)}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """Every test here runs on one thread."""


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, vocab_size=VOCAB)
    return target, perturbed(target, scale=0.08, seed=7)  # agrees often, not always: accepted and bonus tokens


def _drafter(spec, draft):
    return None if spec == "ar" else build_drafter(spec, draft)


def teacher_forced(target, prompt: list[int], out: list[int]) -> torch.Tensor:
    """``[len(out), V]``: the target's raw log-probabilities at each output position, one plain forward."""
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + out])).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(out) - 1], dim=-1)


def check_against(target, prompt, gen, top) -> None:
    ref = teacher_forced(target, prompt, gen.token_ids)  # [E, V]
    assert [lp.token for lp in gen.logprobs] == gen.token_ids
    got = torch.tensor([lp.logprob for lp in gen.logprobs])
    want = ref.gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    for i, lp in enumerate(gen.logprobs):
        assert len(lp.top) == top
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), ref[i].topk(top).values, atol=ATOL, rtol=RTOL)
        for tok, v in lp.top:  # the ids are those values' tokens (ties aside, the same as the reference's top-k)
            assert abs(ref[i, tok].item() - v) <= ATOL + RTOL * abs(v)


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("spec", METHODS)
def test_logprobs_equal_a_teacher_forced_forward(pair, spec, mode):
    target, draft = pair
    kwargs = dict(max_new_tokens=N, eos_token_id=[], **SAMPLING[mode])
    plain = speculant.generate(target, PROMPT, drafter=_drafter(spec, draft), **kwargs)
    steps = []
    gen = speculant.generate(target, PROMPT, drafter=_drafter(spec, draft), logprobs=TOP,
                             stream=lambda ids, lps: steps.append((ids, lps)), **kwargs)
    assert plain.logprobs is None
    assert gen.token_ids == plain.token_ids  # asking for logprobs changes nothing
    assert len(gen.logprobs) == len(gen.token_ids) == N
    check_against(target, PROMPT, gen, TOP)
    # the stream got the same logprobs, step by step, with its ids
    assert [t for ids, _ in steps for t in ids] == gen.token_ids
    assert [lp for _, lps in steps for lp in lps] == gen.logprobs
    assert all([lp.token for lp in lps] == ids for ids, lps in steps)
    if spec != "ar":  # accepted draft tokens were covered, not only bonus tokens
        assert sum(gen.stats.accepted_hist[1:]) > 0, (spec, gen.stats.accepted_hist)


def test_top_zero_and_cut_steps(pair):
    """``logprobs=0``: the emitted token's logprob only; a step cut by a stop token or max_new_tokens reports the
    emitted tokens only."""
    target, draft = pair
    ref = speculant.generate(target, PROMPT, max_new_tokens=N, eos_token_id=[]).token_ids
    stop = ref[7]
    gen = speculant.generate(target, PROMPT, drafter=build_drafter("chain:k=4", target), max_new_tokens=N,
                             eos_token_id=stop, logprobs=0)
    assert gen.token_ids == ref[: ref.index(stop) + 1]
    assert all(lp.top == () for lp in gen.logprobs)
    check_against(target, PROMPT, gen, 0)
    gen = speculant.generate(target, PROMPT, drafter=build_drafter("chain:k=4", target), max_new_tokens=6,
                             eos_token_id=[], logprobs=1)
    assert len(gen.logprobs) == 6
    check_against(target, PROMPT, gen, 1)


def test_top_is_capped_at_the_vocabulary(pair):
    target, _ = pair
    gen = speculant.generate(target, PROMPT, max_new_tokens=2, logprobs=VOCAB + 50)
    assert all(len(lp.top) == VOCAB for lp in gen.logprobs)


def test_session_generate_takes_logprobs(pair):
    target, _ = pair
    session = speculant.load(target, method="lookup")
    gen = session.generate(PROMPT, max_new_tokens=8, logprobs=2, eos_token_id=[])
    check_against(target, PROMPT, gen, 2)


# ---------------------------------------------------------------------------------------------- server

LOCAL = "http://127.0.0.1"
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(chat_models):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from speculant.serve import ServeSettings, check_settings, create_app

    target, draft = chat_models
    settings = check_settings(ServeSettings(target=target, draft=draft, method="chain:k=4", model_name=MODEL))
    app = create_app(settings)
    with TestClient(app, base_url=LOCAL) as client:
        import time

        deadline = time.time() + 60
        while client.get("/health").status_code != 200:
            assert time.time() < deadline, "the model did not load"
            time.sleep(0.05)
        yield client, app.state.worker


def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True}
COMPLETION = {"model": MODEL, "prompt": "The sky is", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}


def _check_values(worker, prompt_ids, token_ids, logprobs, tops) -> None:
    """``logprobs`` / ``tops`` (per token, the alternatives' logprobs) against a teacher-forced forward of the
    served target."""
    ref = teacher_forced(worker.target, prompt_ids, token_ids)
    want = ref.gather(-1, torch.tensor(token_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(logprobs), want, atol=ATOL, rtol=RTOL)
    for row, top in zip(ref, tops):
        torch.testing.assert_close(torch.tensor(top), row.topk(len(top)).values, atol=ATOL, rtol=RTOL)


def test_chat_logprobs(server):
    client, worker = server
    body = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3}).json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    ids = choice["token_ids"]
    assert len(content) == len(ids) == body["usage"]["completion_tokens"] == 12
    tok = worker.tokenizer
    for e, t in zip(content, ids):
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["token"] == tok.decode([t]) and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 3 and all(set(x) == {"token", "logprob", "bytes"} for x in e["top_logprobs"])
    _check_values(worker, body["prompt_token_ids"], ids, [e["logprob"] for e in content],
                  [[x["logprob"] for x in e["top_logprobs"]] for e in content])
    # streamed: the same entries, spread over the chunks (none on the role chunk)
    events = _events(client.post("/v1/chat/completions",
                                 json={**CHAT, "logprobs": True, "top_logprobs": 3, "stream": True}))
    assert events[0]["choices"][0]["logprobs"] is None
    streamed = [e for ev in events[1:] for e in ev["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in streamed]),
                               torch.tensor([e["logprob"] for e in content]), atol=ATOL, rtol=RTOL)
    # logprobs: true alone is top_logprobs 0; off is null
    body = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).json()
    assert all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])
    assert client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs(server):
    client, worker = server
    body = client.post("/v1/completions", json={**COMPLETION, "logprobs": 2}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    ids = choice["token_ids"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) == 12
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and 1 <= len(top) <= 3  # the emitted token is always there
    ref = teacher_forced(worker.target, body["prompt_token_ids"], ids)
    want = ref.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"]), want, atol=ATOL, rtol=RTOL)
    events = _events(client.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "stream": True}))
    parts = [ev["choices"][0]["logprobs"] for ev in events if ev["choices"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_cut_by_a_stop_string_are_not_reported(server, stream):
    client, _ = server
    base = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 24}).json()["choices"][0]
    text = base["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip() and text.index(stop) > 0
    req = {**COMPLETION, "max_tokens": 24, "stop": [stop], "logprobs": 1}
    if stream:
        events = _events(client.post("/v1/completions", json={**req, "stream": True}))
        got = [t for ev in events if ev["choices"] for t in ev["choices"][0]["logprobs"]["tokens"]]
        ids = events[-1]["choices"][0]["token_ids"]
    else:
        choice = client.post("/v1/completions", json=req).json()["choices"][0]
        got, ids = choice["logprobs"]["tokens"], choice["token_ids"]
    assert len(got) == len(ids) < len(base["token_ids"])
    assert ids == base["token_ids"][: len(ids)]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_fields(server, path, body, param):
    client, _ = server
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
