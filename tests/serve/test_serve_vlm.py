"""``speculant serve`` with a vision-language target: an OpenAI client sends an image as a ``data:`` URL and gets
the target's own answer (the drafter reads the text only); anything but a ``data:`` URL, broken base64 or an image
sent to a text model is a 400, and the server goes on. A real server (a subprocess) serves a tiny LLaVA saved with
its processor, greedy."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import start_server, stop_server  # noqa: E402

MODEL = "tiny-vlm"


@pytest.fixture(scope="module")
def vlm_pair(tmp_path_factory):
    from transformers import AutoTokenizer

    from speculant.tiny_models import perturbed, save_tiny_llava, tiny_model

    root = tmp_path_factory.mktemp("vlm")
    target = save_tiny_llava(root / "target")
    tok = AutoTokenizer.from_pretrained(target)
    draft = perturbed(tiny_model("llama", vocab_size=len(tok), seed=0, init_std=0.2), 0.3, seed=4)
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    return str(target), str(root / "draft")


def _png(colour) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (36, 28), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(url: str, image: str, text: str = "What is in the picture?", method: str | None = None) -> list[int]:
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": text}]}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_an_image_chat_is_answered_exactly_and_bad_images_are_400s(vlm_pair, tmp_path):
    import speculant

    target, draft = vlm_pair
    server, url = start_server(["--target", target, "--draft", draft, "--method", "chain:k=3",
                                "--served-model-name", MODEL, "--speculation", "on"], tmp_path / "err.txt",
                               ready=True)
    try:
        red, blue = _png((200, 10, 50)), _png((10, 10, 240))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": red}},
                                         {"type": "text", "text": "What is in the picture?"}]}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        got = _chat(url, red)
        from PIL import Image

        session = speculant.load(target, method="ar")  # the target alone, in this process
        want = session.generate("What is in the picture?", images=[Image.open(io.BytesIO(base64.b64decode(
            red.split(",", 1)[1])))], max_new_tokens=16, eos_token_id=[]).token_ids
        assert got == want
        assert _chat(url, blue) != got  # the image is read
        for image, needle in (("https://example.com/cat.png", "never fetches"), ("data:image/png;base64,@@@",
                                                                              "invalid base64"),
                              ("data:image/png;base64," + base64.b64encode(b"not an image").decode(),
                               "not an image")):
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}]}]}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert _chat(url, red) == got  # the server goes on
    finally:
        stop_server(server)


def test_an_image_sent_to_a_text_model_is_a_400(chat_models, tmp_path):
    server, url = start_server(["--target", chat_models[0], "--method", "ar", "--served-model-name", MODEL],
                               tmp_path / "err.txt", ready=True)
    try:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _png((1, 2, 3))}}, {"type": "text", "text": "hi"}]}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "reads text only" in r.json()["error"]["message"], r.text
    finally:
        stop_server(server)
