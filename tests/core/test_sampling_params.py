"""``SamplingParams``, the one place the sampling rules live: tiny positive temperatures (below
``MIN_TEMPERATURE``) are greedy, the same in the Python API, the CLI and the server (no "probability tensor contains
inf/nan"), and seeds take torch's range."""

from __future__ import annotations

import json

import pytest

import speculant
from helpers import chat_model_pair, until_loaded
from speculant import cli
from speculant.core.types import MIN_TEMPERATURE, SamplingParams

TINY = 1e-38


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = chat_model_pair(tmp_path_factory.mktemp("floor"), layers=2, context=256)
    return {"target": target, "draft": draft}


def test_the_rule():
    for t in (TINY, 5e-324, MIN_TEMPERATURE / 2):
        p = SamplingParams(temperature=t, top_k=5, seed=1)
        assert p.greedy and p.temperature == 0.0 and p.top_k == 5
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    with pytest.raises(ValueError, match=">= 0"):
        SamplingParams(temperature=-TINY)


def test_python_api(models):
    import speculant

    session = speculant.load(models["target"], models["draft"], "chain:k=3")
    greedy = session.generate("def add(a, b):", max_new_tokens=12, temperature=0)
    for t in (TINY, MIN_TEMPERATURE / 10):
        assert session.generate("def add(a, b):", max_new_tokens=12, temperature=t).token_ids == greedy.token_ids
    # just above the floor: samples, and computes (no inf/nan)
    warm = session.generate("def add(a, b):", max_new_tokens=12, temperature=MIN_TEMPERATURE * 2, seed=0)
    assert len(warm.token_ids) == 12


def test_cli(models, capsys):
    def run(t: str) -> list[int]:
        code = cli.main(["generate", "def add(a, b):", "--raw", "--target", models["target"], "--draft",
                         models["draft"], "--method", "chain:k=3", "--max-new-tokens", "12", "--temperature", t,
                         "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)["token_ids"]

    assert run("1e-38") == run("0")


def test_server(models):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from speculant.serve import ServeSettings, check_settings, create_app

    settings = check_settings(ServeSettings(target=models["target"], draft=models["draft"], method="chain:k=3",
                                            model_name="m"))
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        until_loaded(c)

        def ids(t: float) -> list[int]:
            r = c.post("/v1/completions", json={"model": "m", "prompt": "def add(a, b):", "max_tokens": 12,
                                                "temperature": t, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert ids(TINY) == ids(0)


def test_seed_range_is_torchs():
    """The largest and smallest seeds torch takes still work; one past them is a one-line error, not torch's."""
    for seed in (2**64 - 1, -(2**63)):
        speculant.SamplingParams(temperature=1.0, seed=seed)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="out of range: torch takes seeds from -2\\*\\*63 to 2\\*\\*64 - 1"):
            speculant.SamplingParams(temperature=1.0, seed=seed)
