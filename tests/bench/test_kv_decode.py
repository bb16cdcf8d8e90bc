"""Decoding at long context under a KV budget (speculant.bench.kv_decode, ``kv-eval --task decode``): long
code-edit requests fill the asked length and ask for a function inside it, every method runs with the full cache
and under the budget, full-cache speculation equals plain decoding, the budget bounds the cache."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

import speculant
from speculant import cli
from speculant.bench.kv_decode import long_code_prompts, run_kv_decode, summarise


@pytest.fixture(scope="module")
def tok(chat_models):
    return AutoTokenizer.from_pretrained(chat_models[0])


def test_prompts_fill_the_length_and_ask_for_a_function_inside(tok):
    prompts = long_code_prompts(tok, 1536, 2, seed=0)
    assert len({p.module for p in prompts}) == 2
    for p in prompts:
        assert 1536 - 200 < len(p.input_ids) <= 1536
        text = tok.decode(p.input_ids)
        name = p.function.split(".")[-1]
        assert f"`{p.function}`" in text and f"def {name}(" in text.split("Rewrite the function")[0]
        assert 0 <= p.depth < 1
    assert [p.function for p in long_code_prompts(tok, 1536, 2, seed=0)] == [p.function for p in prompts]
    with pytest.raises(ValueError, match="held-out modules are longer than"):
        long_code_prompts(tok, 10**6, 1)


def test_run_interleaves_full_and_budget_and_full_speculation_is_exact(chat_models, tok):
    session = speculant.load(chat_models[0], draft=chat_models[1], method="chain:k=3")
    prompts = long_code_prompts(tok, 1024, 1, seed=0)
    order = []
    report = run_kv_decode(session, prompts, ["ar", "chain:k=3"], "keydiff", 0.25, 64, max_new_tokens=24,
                           warmup=0, progress=lambda r: order.append((r["method"], r["cache"])))
    assert order == [("ar", "full"), ("ar", "budget"), ("chain:k=3", "full"), ("chain:k=3", "budget")]
    rows = {(r["method"], r["cache"]): r for r in report["rows"]}
    assert rows[("chain:k=3", "full")]["token_ids"] == rows[("ar", "full")]["token_ids"]
    budget = rows[("ar", "budget")]["budget"]
    assert budget == int(0.25 * len(prompts[0].input_ids))
    full_kv, small_kv = rows[("ar", "full")]["kv_peak_bytes"], rows[("ar", "budget")]["kv_peak_bytes"]
    per_token = full_kv / (len(prompts[0].input_ids) + 24)  # the full cache holds the prompt and the answer
    assert small_kv <= (budget + 64) * per_token * 1.01
    chain = [a for a in report["agreement"] if a["method"] == "chain:k=3"][0]
    assert chain["full_vs_ar_full"] == {"identical": True, "first_difference": None}
    s = report["summary"]
    assert set(s) == {"ar/full", "ar/budget", "chain:k=3/full", "chain:k=3/budget"}
    assert s["ar/full"]["decode_speedup_vs_ar_full"] == 1.0 and "decode_speedup_vs_own_full" in s["ar/budget"]


def test_summary_ratios():
    rows = [{"method": m, "cache": c, "wall_s": w, "prefill_s": 1.0, "decode_s": w - 1.0,
             "decode_tokens_per_s": 10.0 / (w - 1.0), "acceptance_length": 1.0, "new_tokens": 10,
             "kv_peak_bytes": 100}
            for m, c, w in (("ar", "full", 3.0), ("ar", "budget", 2.0), ("x", "full", 2.0), ("x", "budget", 1.5))]
    s = summarise(rows)
    assert s["x/budget"]["decode_speedup_vs_own_full"] == pytest.approx(2.0)
    assert s["x/budget"]["wall_ratio_vs_ar_full"] == pytest.approx(2.0)
    assert s["ar/budget"]["decode_speedup_vs_ar_full"] == pytest.approx(2.0)


def test_cli_decode_end_to_end_and_errors(chat_models, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["kv-eval", "--task", "decode", "--target", chat_models[0], "--draft", chat_models[1], "--methods",
            "ar,chain:k=2", "--lengths", "1024", "--samples", "1", "--max-new-tokens", "8", "--warmup", "0",
            "--block", "64", "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["settings"]["task"] == "decode" and report["settings"]["methods"] == ["ar", "chain:k=2"]
    assert len(report["results"]) == 1 and len(report["results"][0]["rows"]) == 4
    assert json.loads((out / "kv_results.json").read_text())["results"] == report["results"]
    base = ["kv-eval", "--task", "decode", "--target", chat_models[0], "--draft", chat_models[1]]
    for extra, message in ((["--budget-fraction", "1"], "--budget-fraction must be in (0, 1)"),
                           (["--methods", "chain:k=2", "--draft", chat_models[0] + "-none"], "does not exist"),
                           (["--samples", "0"], "--samples and --max-new-tokens must be >= 1"),
                           (["--lengths", "4096"], "exceed the target model's context of 2048")):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and "Traceback" not in "\n".join(err)
