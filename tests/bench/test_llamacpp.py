"""The llama.cpp baselines (speculant.bench.llamacpp): specs, errors, llama.cpp's report parsed from recorded text,
and (slow, after `make llamacpp`) one end-to-end bench run on the packaged Qwen pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculant.bench import llamacpp, run_bench
from speculant.bench.hf import BASELINES, parse_baseline
from speculant.models.sources import SOURCE_FILE, packaged_installed
from speculant.tiny_models import tiny_model

# The end of what llama-speculative-simple 0.3.36's vendored llama.cpp prints on stderr (trimmed).
SPECULATIVE_STDERR = """\
llama_context: n_ctx = 256
main: speculative decoding will use checkpoints (context does not support partial sequence removal)

encoded   33 tokens in    0.402 seconds, speed:   82.090 t/s
decoded   32 tokens in    1.780 seconds, speed:   17.978 t/s

n_draft   = 3
n_predict = 32
n_drafted = 27
n_accept  = 23
accept    = 85.185%

draft:

statistics     draft-simple: #calls(b,g,a) =    1      9      9, #gen drafts =      9, #acc drafts =      8
target:

llama_perf_context_print:        load time =     610.21 ms
llama_perf_context_print: prompt eval time =    1902.11 ms /   140 tokens (   13.59 ms per token,    73.60 tokens per second)
"""

# The end of what llama-lookup prints (it also reports its n-gram cache's time).
LOOKUP_STDERR = """\
encoded   12 tokens in    0.150 seconds, speed:   80.000 t/s
decoded   17 tokens in    0.600 seconds, speed:   28.333 t/s

n_draft      = 4
n_predict    = 17
n_drafted    = 8
t_draft_flat = 0.12 ms
t_draft      = 2.50 ms, 312.50 us per token, 3200.00 tokens per second
n_accept     = 5
accept       = 62.500%

target:
"""


def test_specs_of_the_three_baselines():
    assert parse_baseline("llamacpp-ar") == ("llamacpp-ar", {})
    assert parse_baseline("llamacpp-lookup:k=5") == ("llamacpp-lookup", {"k": 5})
    assert parse_baseline("llamacpp-draft") == ("llamacpp-draft", {})
    assert parse_baseline(" llamacpp-draft:k=4 ") == ("llamacpp-draft", {"k": 4})
    assert BASELINES["llamacpp-draft"].needs_draft and not BASELINES["llamacpp-lookup"].needs_draft
    assert {BASELINES[n].runtime for n in llamacpp.PROGRAMS} == {"llama.cpp"}
    with pytest.raises(ValueError, match="unknown option 'ngram' for baseline 'llamacpp-lookup'; its options: k"):
        parse_baseline("llamacpp-lookup:ngram=3")
    with pytest.raises(ValueError, match="unknown option 'k' for baseline 'llamacpp-ar'"):
        parse_baseline("llamacpp-ar:k=3")
    with pytest.raises(ValueError, match="must be >= 1"):
        parse_baseline("llamacpp-draft:k=0")
    with pytest.raises(ValueError, match="expected int"):
        parse_baseline("llamacpp-draft:k=many")


def test_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_LLAMACPP_BIN", str(tmp_path))
    target, draft = Path("/m/t.gguf"), Path("/m/d.gguf")
    ar = llamacpp.command("llamacpp-ar", {}, target, None, 4, 300, 2)
    assert ar[0] == str(tmp_path / "llama-lookup") and ar[ar.index("--spec-draft-n-max") + 1] == "0"
    assert ar[ar.index("-t") + 1] == ar[ar.index("-tb") + 1] == "2" and ar[ar.index("-c") + 1] == "300"
    lookup = llamacpp.command("llamacpp-lookup", {"k": 7}, target, None, 4, 300, 2)
    assert lookup[lookup.index("--spec-draft-n-max") + 1] == "7"
    assert llamacpp.command("llamacpp-lookup", {}, target, None, 4, 300, 2)[-1] == "4"  # the shared default k
    spec = llamacpp.command("llamacpp-draft", {}, target, draft, 4, 300, 2)
    assert spec[0] == str(tmp_path / "llama-speculative-simple") and spec[spec.index("-md") + 1] == str(draft)
    assert spec[spec.index("--spec-draft-n-max") + 1] == str(llamacpp.DEFAULT_DRAFT_K)
    assert spec[spec.index("--spec-type") + 1] == "draft-simple" and spec[spec.index("-td") + 1] == "2"
    with pytest.raises(ValueError, match="needs the draft's GGUF file"):
        llamacpp.command("llamacpp-draft", {}, target, None, 4, 300, 2)


def test_parse_speculative_report():
    t = llamacpp.parse_timings(SPECULATIVE_STDERR)
    assert (t.prompt_tokens, t.new_tokens, t.drafted, t.accepted) == (33, 32, 27, 23)
    assert t.prefill_s == pytest.approx(0.402) and t.decode_s == pytest.approx(1.780) and t.draft_s == 0.0
    assert t.rounds == 9  # each round emits its accepted drafts plus one: 32 = 23 + 9
    stats = llamacpp.stats_from_timings(t)
    assert stats.acceptance_length == pytest.approx(32 / 9)
    assert stats.wall_s == pytest.approx(2.182) and stats.prefill_s == pytest.approx(0.402)
    assert stats.tokens_per_second == pytest.approx(32 / 2.182) and stats.target_forward == "llama.cpp"


def test_parse_lookup_report_and_missing_lines():
    t = llamacpp.parse_timings(LOOKUP_STDERR)
    assert (t.prompt_tokens, t.new_tokens, t.drafted, t.accepted, t.rounds) == (12, 17, 8, 5, 12)
    assert t.draft_s == pytest.approx(0.0025)
    stats = llamacpp.stats_from_timings(t)
    assert stats.draft_forward_s == pytest.approx(0.0025)
    assert stats.target_forward_s == pytest.approx(0.6 - 0.0025) and stats.overhead_s == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no 'decoded' line; its output ended: .*failed to load model"):
        llamacpp.parse_timings("encoded 3 tokens in 0.1 seconds\nerror: failed to load model\n")


def test_generated_text_is_cut_from_stdout():
    assert llamacpp.generated_text("\n\n<|im_start|>user\nhi<|im_end|>Hello\n\n\n\n\n\n",
                                   "<|im_start|>user\nhi<|im_end|>") == "Hello\n\n"
    assert llamacpp.generated_text("\n\nabc def\n\n\n\n", "abc") == " def"


def test_not_built_and_no_gguf_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_LLAMACPP_BIN", str(tmp_path / "nowhere"))
    assert not llamacpp.available()
    target = tiny_model("llama", vocab_size=64, hidden=16, layers=1, context=256)
    prompts = [{"id": "p0", "input_ids": list(range(2, 10))}]
    for spec in ("llamacpp-ar", "llamacpp-lookup:k=2", "llamacpp-draft"):
        with pytest.raises(ValueError, match=r"not built: `make llamacpp`") as err:
            run_bench(prompts, methods=["ar"], baselines=[spec], target=target, draft=target, progress=False)
        assert "\n" not in str(err.value)
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    with pytest.raises(ValueError, match="need a target converted from a GGUF file"):
        run_bench(prompts, methods=["ar"], baselines=["llamacpp-draft"], target=target, draft=target,
                  progress=False)
    # a target from a GGUF file whose draft is not one
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    (model_dir / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf)}))
    assert llamacpp.gguf_of(model_dir) == gguf
    with pytest.raises(ValueError, match="need a draft converted from a GGUF file"):
        llamacpp.gguf_of(tmp_path, role="draft")
    with pytest.raises(ValueError, match="need a draft converted from a GGUF file"):
        llamacpp.gguf_of("<in-process LlamaForCausalLM>", role="draft")
    gguf.unlink()
    with pytest.raises(ValueError, match="the target was converted from is gone"):
        llamacpp.gguf_of(model_dir)


@pytest.mark.slow
def test_bench_runs_the_three_llamacpp_baselines(tmp_path):
    if not llamacpp.available():
        pytest.skip("llama.cpp is not built (make llamacpp)")
    if not (packaged_installed("qwen2.5-coder-1.5b-instruct") and packaged_installed("qwen2.5-coder-0.5b-instruct")):
        pytest.skip("the packaged Qwen2.5-Coder models are not installed (make qwen-models)")
    specs = ["llamacpp-ar", "llamacpp-lookup", "llamacpp-draft"]
    results = run_bench("builtin:code-chat", num_prompts=1, methods=["ar"], baselines=specs,
                        target="qwen2.5-coder-1.5b-instruct", max_new_tokens=16, warmup=0, dtype="bfloat16",
                        progress=False, out=tmp_path)
    assert "llamacpp" in results["settings"]
    for spec in specs:
        s, (row,) = results["methods"][spec], results["runs"][spec]
        assert 0 < len(row["token_ids"]) <= 16 and row["new_tokens"] > 0 and s["tokens_per_second"] > 0
        assert row["target_calls"] == row["new_tokens"] - row["draft_accepted"]
    assert results["methods"]["llamacpp-ar"]["acceptance_length"] == 1.0
    assert results["methods"]["llamacpp-draft"]["k"] == llamacpp.DEFAULT_DRAFT_K
    assert results["methods"]["llamacpp-draft"]["draft_acceptance"] is not None
    assert "llamacpp-draft" in (tmp_path / "results.md").read_text()
