"""Slow: the packaged Qwen2.5-Coder pair (1.5B target, 0.5B draft) in its own weights (``file``: the file's Q4_K as q4,
its Q6_K as q6), end to end (``make qwen-models``)."""

from __future__ import annotations

import pytest

from speculant.bench import run_bench
from speculant.models.sources import packaged_installed

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@pytest.mark.slow
def test_every_method_decodes_the_q4_pair_exactly_and_transformers_runs_it_too(tmp_path):
    """~3 min, ~6 GB: on two code-chat requests every method's greedy output equals plain decoding of the same ``file``
    weights (float32; the lean forward's compiled calls on the real shapes, q6 matrices included), and transformers'
    own generate, which multiplies by the same quantized matrices (ReleasedLinear), writes the same tokens."""
    if not (packaged_installed(TARGET) and packaged_installed(DRAFT)):
        pytest.skip("the packaged Qwen2.5-Coder models are not installed (make qwen-models)")
    methods = ["ar", "chain:k=3", "chain:k=3:stop=0.7", "chain:k=4:lookup=8", "lookup", "tree"]
    results = run_bench("builtin:code-chat", num_prompts=2, methods=methods, baselines=["hf-ar"], target=TARGET,
                        max_new_tokens=24, warmup=0, dtype="float32", progress=False, out=tmp_path)
    assert results["settings"]["target_quantization"] == "file"
    for spec in methods:
        assert results["methods"][spec]["identical_to_ar"] == 1.0, spec
    assert results["methods"]["chain:k=3"]["acceptance_length"] > 1.5
    hf = results["runs"]["hf-ar"]
    assert len(hf) == 2 and all(0 < len(r["token_ids"]) <= 24 for r in hf)
    # the same q4 matrices (its attention differs from ours by float rounding only): the same tokens here
    assert results["methods"]["hf-ar"]["identical_to_ar"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["builtin:json-extract", "builtin:tools"])
def test_the_pair_under_a_schema_or_a_forced_tool_call_is_exact_and_valid(tmp_path, workload):
    """~2 min each: under each request's constraint (a strict JSON Schema; a tool call forced by its grammar where
    ``tool_choice`` is ``required``) every method's greedy output equals constrained plain decoding, every JSON
    answer is valid, and so is every forced call."""
    if not (packaged_installed(TARGET) and packaged_installed(DRAFT)):
        pytest.skip("the packaged Qwen2.5-Coder models are not installed (make qwen-models)")
    methods = ["ar", "chain:k=3:stop=0.7", "chain:k=5:stop=0.7:lookup=10:window=128", "specinfer"]
    results = run_bench(workload, num_prompts=4, methods=methods, baselines=[], target=TARGET, max_new_tokens=160,
                        warmup=0, dtype="float32", progress=False, out=tmp_path)
    for spec in methods:
        assert results["methods"][spec]["identical_to_ar"] == 1.0, spec
    for prompt, run in zip(results["prompts"], results["runs"]["ar"]):
        if workload.endswith("json-extract") or prompt.get("tool_choice") == "required":
            assert run["valid"], (prompt["id"], run["answer_error"])
    assert sum(r["forced_tokens"] for r in results["runs"]["chain:k=3:stop=0.7"]) > 0
