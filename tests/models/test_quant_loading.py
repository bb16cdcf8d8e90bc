"""``quantization=`` where models load: loading, the session (target and draft), ``--quantization`` in every
front-end, and a GGUF file's own 4-bit codes (Q4_K, Q4_1) carried over into int4/q4 matrices unchanged.

The GGUF files are tiny random Llamas written here (test_sources.py's writer): Llama so that the Q/K row
permutation a loader undoes is exercised. gguf's Python package cannot quantize Q4_K, so those tensors are random
(valid) Q4_K blocks: the test compares the quantized model with the same file loaded in float, not with the model
the file was written from.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from speculant import cli
from speculant.commands import common
from speculant.core.quant import ATTR, QUANTIZATIONS, QuantMatrix, quantization_of, quantized_linears
from speculant.core.target_forward import llama_forward_for
from speculant.models.loading import load_model_dir, load_pretrained, quantize_loaded
from speculant.plan import resolve
from speculant.session import load_plan
from speculant.tiny_models import tiny_model, tiny_tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\n"


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------- options


def test_the_option_offers_every_kind_and_says_its_default():
    import argparse

    p = argparse.ArgumentParser()
    common.add_model_arguments(p)
    action = next(a for a in p._actions if a.dest == "quantization")
    assert tuple(action.choices) == QUANTIZATIONS and action.default is None
    assert "default: a packaged model's own format" in action.help and "file (each matrix as precise" in action.help
    args = p.parse_args(["--quantization", "q4"])
    assert common.session_arguments(args)["quantization"] == "q4"


def test_a_packaged_target_loads_in_its_own_format_unless_told():
    """No quantization asked: a packaged target by name takes its default_quantization (q4 for the Qwen pair), its
    draft by name follows; any other target stays float; an explicit kind wins."""
    from speculant.models.sources import PACKAGED
    from speculant.plan import _resolve_quantization

    qwen = "qwen2.5-coder-1.5b-instruct"
    assert PACKAGED[qwen].default_quantization == "file"  # q4 with the file's wider tensors kept wider
    assert PACKAGED["qwen2.5-coder-0.5b-instruct"].default_quantization == "q4"
    assert _resolve_quantization(qwen, "qwen2.5-coder-0.5b-instruct", None, None) == ("file", "q4")  # DRAFT_KIND
    assert _resolve_quantization(qwen, None, "q8", None) == ("q8", "q8")
    assert _resolve_quantization(qwen, None, "none", None) == ("none", "none")
    assert _resolve_quantization(qwen, None, None, "none") == ("file", "none")
    assert _resolve_quantization("smollm2-135m-instruct", None, None, None) == ("none", "none")
    assert _resolve_quantization("some/dir", None, None, None) == ("none", "none")


def test_unknown_kind_is_a_one_line_error(code_models):
    with pytest.raises(ValueError, match="unknown quantization") as err:
        resolve(code_models["target"], method="ar", quantization="int3")
    _one_line(err.value)
    with pytest.raises(ValueError, match="unknown quantization"):
        load_pretrained(code_models["target"], quantization="fp8")
    with pytest.raises(ValueError, match=r"unknown quantization 'q4m'; known: none, int8, int4, q4, file, q8"):
        resolve(code_models["target"], method="ar", quantization="q4m")


# ---------------------------------------------------------------------------------------------- session


@pytest.mark.parametrize("kind", ["int8", "int4", "q4"])
def test_the_session_quantizes_target_and_draft(code_models, kind):
    session = load_plan(resolve(code_models["target"], code_models["draft"], "chain:k=3", quantization=kind))
    assert quantization_of(session.target) == quantization_of(session.draft) == kind
    assert (session.plan.quantization, session.plan.draft_quantization) == (kind, kind)
    assert all(getattr(m, ATTR).kind == kind for m in quantized_linears(session.target))


def test_draft_quantization_overrides_the_target_kind_and_modules_are_taken_as_they_are(code_models):
    session = load_plan(resolve(code_models["target"], code_models["draft"], "chain", quantization="q4",
                                draft_quantization="none"))
    assert (quantization_of(session.target), quantization_of(session.draft)) == ("q4", "none")
    other = session.with_draft(code_models["draft"])  # keeps the session's draft kind
    assert quantization_of(other.draft) == "none"
    plan = resolve(session.target, session.draft, "chain")  # loaded modules: their own kinds
    assert (plan.quantization, plan.draft_quantization) == ("q4", "none")
    with pytest.raises(ValueError, match="quantized to q4, not int8") as err:
        resolve(session.target, session.draft, "chain", quantization="int8")
    _one_line(err.value)


def test_an_attached_drafter_loads_next_to_a_quantized_tied_target(tmp_path, code_tokenizer):
    """The drafter's embedding check reads the float embedding it was made for: the session loads it before the
    target's tied (shared with the embedding) head is quantized, and the drafter then shares the quantized head."""
    from speculant.models.attached import build_attached, save_attached

    target = tiny_model("llama", vocab_size=len(code_tokenizer), hidden=64, layers=2)
    target.config.tie_word_embeddings = True
    target.lm_head.weight = target.model.embed_tokens.weight
    target.save_pretrained(tmp_path / "t")
    code_tokenizer.save_pretrained(tmp_path / "t")
    draft = save_attached(build_attached(target, [0]), target, tmp_path / "d", target_name="tiny",
                          dtype=torch.float32)
    session = load_plan(resolve(str(tmp_path / "t"), str(draft), "chain:k=2", quantization="q4"))
    assert quantization_of(session.target) == quantization_of(session.draft) == "q4"
    assert session.draft.lm_head is session.target.lm_head
    assert session.target.lm_head.weight is session.target.model.embed_tokens.weight  # tied: the case that matters
    from speculant.models.loading import load_draft

    with pytest.raises(ValueError, match="different model"):  # what loading it after quantizing would do
        load_draft(str(draft), session.target)
    with pytest.raises(ValueError, match="already holds a q4 matrix") as err:  # the shared head has one kind
        load_plan(resolve(str(tmp_path / "t"), str(draft), "chain:k=2", quantization="q4",
                          draft_quantization="int8"))
    _one_line(err.value)


def test_a_model_quantized_to_one_kind_refuses_another(code_models):
    model, _ = load_model_dir(code_models["target"], quantization="int4")
    head = model.get_output_embeddings()
    assert getattr(head, ATTR).kind == "int4"
    from speculant.core.quant import quantize_model

    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "q4")


# ---------------------------------------------------------------------------------------------- front-ends


def _generate(capsys, target, draft, method, kind, n=20):
    code = cli.main(["generate", PROMPT, "--target", target, "--draft", draft, "--method", method,
                     "--quantization", kind, "--max-new-tokens", str(n), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["token_ids"]


@pytest.mark.parametrize("kind", ["int4", "q4"])
def test_generate_greedy_output_equals_plain_decoding_of_the_quantized_model(code_models, capsys, kind):
    t, d = code_models["target"], code_models["draft"]
    spec = _generate(capsys, t, d, "chain:k=3", kind)
    plain = _generate(capsys, t, d, "ar", kind)
    assert spec == plain and len(plain) >= 10  # (an end of sequence may come before 20)
    # and the quantized model is another model: its plain decoding is its own (the float one may differ)
    from speculant import generate

    model, tok = load_model_dir(t, quantization=kind)
    assert generate(model, tok(PROMPT)["input_ids"], max_new_tokens=20).token_ids == plain
    float_model, _ = load_model_dir(t)
    assert quantization_of(float_model) == "none"


def test_bench_records_the_kind(code_models, tmp_path):
    from speculant.bench.harness import run_bench as run

    results = run(prompts=[PROMPT], methods=["ar", "chain:k=2"], baselines=[], target=code_models["target"],
                  draft=code_models["draft"], max_new_tokens=6, repeats=1, warmup=0, quantization="q4",
                  progress=False)
    assert results["settings"]["target_quantization"] == results["settings"]["draft_quantization"] == "q4"


def test_serve_and_kv_eval_and_demo_pass_the_kind_to_the_session(code_models, monkeypatch):
    import argparse
    import dataclasses

    from speculant.commands import kv_eval
    from speculant.serve.settings import ServeSettings, plan

    assert "quantization" in {f.name for f in dataclasses.fields(ServeSettings)}  # --quantization fills it
    p = plan(ServeSettings(target=code_models["target"], method="ar", quantization="int8"))
    assert p.quantization == "int8"
    seen = []
    import speculant.plan

    real = speculant.plan.resolve

    def spy(*args, **kwargs):
        seen.append(kwargs.get("quantization"))
        raise RuntimeError("stop")

    monkeypatch.setattr(speculant.plan, "resolve", spy)
    parser = argparse.ArgumentParser()
    kv_eval.add_arguments(parser)
    with pytest.raises(RuntimeError, match="stop"):
        kv_eval.run(parser.parse_args(["--target", code_models["target"], "--quantization", "int4"]))
    assert seen == ["int4"]
    monkeypatch.setattr(speculant.plan, "resolve", real)
    from speculant import demo

    calls = []
    monkeypatch.setattr(demo.cli, "main", lambda argv: calls.append(argv) or 1)  # stop after the generate step
    assert demo._generate_then_measure(code_models["target"], code_models["draft"], PROMPT,
                                       argparse.Namespace(k=2, max_new_tokens=4, threads=1, quantization="q4"),
                                       tiny=True) == 1
    assert calls[0][calls[0].index("--quantization") + 1] == "q4"


# ---------------------------------------------------------------------------------------------- GGUF codes

gguf = pytest.importorskip("gguf", reason="writing GGUF files needs the 'gguf' package")


SPREAD = {"near": 4.0, "wide": 1000.0}  # ratio of dmin to d in the random Q4_K blocks (see _random_q4_k)


def _random_q4_k(w: np.ndarray, rng: np.random.Generator, spread: float) -> np.ndarray:
    """Random valid Q4_K super-blocks for ``w [rows, cols]`` (cols a multiple of 256), uint8 ``[rows, cols / 256
    * 144]``: any bytes are a valid block once ``d`` and ``dmin`` are finite. ``dmin / d`` lies within a factor
    ``spread`` of 1: near 1 as in real files (both come from one block's range), or far, so that the two terms of
    ``d * sc * q - dmin * m`` take very different exponents."""
    rows, cols = w.shape
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, len(blocks)) * rng.choice([-1, 1], len(blocks))
    dmin = np.abs(d) * np.exp(rng.uniform(-np.log(spread), np.log(spread), len(blocks)))
    halves = np.stack([d, dmin], 1)
    blocks[:, 0:4] = halves.astype(np.float16).view(np.uint8).reshape(len(blocks), 4)
    return blocks.reshape(rows, -1)


def _random_q6_k(w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random valid Q6_K super-blocks (210 bytes: 6-bit codes, 16 int8 scales, fp16 ``d`` at byte 208)."""
    rows, cols = w.shape
    blocks = rng.integers(0, 256, (rows * cols // 256, 210), dtype=np.uint8)
    d = rng.uniform(0.0001, 0.001, len(blocks)).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(len(blocks), 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Tiny Llama GGUF files (hidden 256, 4 heads, 2 KV heads: Q/K rows permuted in the file) with every matrix
    Q4_K (random blocks: ``Q4_K`` with dmin near d, ``Q4_K-wide`` far from it), Q6_K (random blocks), Q4_0, Q4_1,
    Q5_0, Q5_1 and Q8_0 (gguf's quantizer)."""
    from test_sources import write_llama_gguf

    tok = tiny_tokenizer(["hello world, a tiny gguf test.\n" * 3, "def f(x):\n    return x + 1\n" * 3],
                         vocab_size=300)
    model = tiny_model("llama", seed=0, vocab_size=len(tok), hidden=256, layers=1, heads=4, kv_heads=2,
                       context=64, init_std=0.05)  # intermediate 512: every input size a multiple of 256
    root = tmp_path_factory.mktemp("gguf-quant")
    rng = np.random.default_rng(0)
    real = gguf.quants.quantize

    spread = [1.0]

    def quantize(w, qtype):  # gguf cannot quantize Q4_K and Q6_K in Python: random blocks instead
        if qtype == gguf.GGMLQuantizationType.Q6_K:
            return _random_q6_k(w, rng)
        return _random_q4_k(w, rng, spread[0]) if qtype == gguf.GGMLQuantizationType.Q4_K else real(w, qtype)

    files = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf.quants, "quantize", quantize)
    try:
        for name in ("Q4_K", "Q4_K-wide", "Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q6_K"):
            spread[0] = SPREAD["wide" if name.endswith("wide") else "near"]
            qtype = gguf.GGMLQuantizationType[name.split("-")[0]]
            files[name] = write_llama_gguf(root / f"tiny-{name}.gguf", model, tok, qtype)
    finally:
        mp.undo()
    return files


def _file_values(path) -> dict[int, torch.Tensor]:
    """Each quantized linear's weight as the float load reads it (the file's dequantized values), by position."""
    model, _ = load_pretrained(path, dtype="float32")
    return {i: m.weight.detach().clone() for i, m in enumerate(quantized_linears(model))}


def _matrices(path, kind):
    model, _ = load_pretrained(path, dtype="float32", quantization=kind)
    assert quantization_of(model) == kind
    return model, [getattr(m, ATTR) for m in quantized_linears(model)]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_1"])
def test_int4_from_the_file_codes_equals_the_file(gguf_files, cache_dir, qtype):
    """Exact when d and dmin (Q4_1: d and m) are of like magnitude, as in real files: then every term of int4's
    ``(q - 8) * scale + (minimum + 8 * scale)`` and of the file's ``scale * q + minimum`` fits in float32's 24 bits
    (scale: 11 x 6 bits, times a 4-bit code), so both forms round nothing (the 1.5B's Q4_K tensors: no weight off,
    benchmarks/quant_fidelity.py)."""
    want = _file_values(gguf_files[qtype])
    model, matrices = _matrices(gguf_files[qtype], "int4")
    assert len(matrices) == 8  # q, k, v, o, gate, up, down and the (untied) head
    for i, q in enumerate(matrices):
        assert torch.equal(q.dequantize(), want[i]), i
        module = quantized_linears(model)[i]  # the model's own forward multiplies by the same matrix
        assert module.weight.device.type == "meta" and module.weight.shape == want[i].shape
        x = torch.randn(2, want[i].shape[1])
        assert torch.equal(module(x), q.linear(x))


def test_int4_from_codes_with_far_apart_scales_is_the_file_up_to_float32_rounding(gguf_files, cache_dir):
    """With dmin 1000x from d the int4 form's sums round (the file's value is itself one rounding of a sum):
    within a few float32 ulps of the terms, and the codes are still the file's."""
    want = _file_values(gguf_files["Q4_K-wide"])
    model, matrices = _matrices(gguf_files["Q4_K-wide"], "int4")
    off = 0
    for i, q in enumerate(matrices):
        scale = q.scale.repeat_interleave(32, 1).abs()
        bound = (16 * scale + q.zero.repeat_interleave(32, 1).abs() + want[i].abs()) * 2.0 ** -23
        diff = (q.dequantize() - want[i]).abs()
        assert bool((diff <= bound).all()), i
        off += int((diff > 0).sum())
    assert off > 0  # the case is real: some weights do round


def test_q4_from_q4_1_codes_is_exact_and_from_q4_k_within_float16_scales(gguf_files, cache_dir):
    want = _file_values(gguf_files["Q4_1"])
    for i, q in enumerate(_matrices(gguf_files["Q4_1"], "q4")[1]):  # Q4_1's d and m are float16 already
        assert torch.equal(q.dequantize(), want[i]), i
    want = _file_values(gguf_files["Q4_K"])
    codes = {}
    from speculant.models.gguf import int4_tensors

    model, matrices = _matrices(gguf_files["Q4_K"], "q4")
    params = {id(p): n for n, p in model.named_parameters()}
    for name, c, scale, minimum in int4_tensors(gguf_files["Q4_K"], model):
        codes[name] = (c, scale, minimum)
    for i, (m, q) in enumerate(zip(quantized_linears(model), matrices)):
        c, scale, minimum = codes[params[id(m.weight)]]
        assert torch.equal(q.unpacked_codes(), c)  # the file's codes, rows in the model's order
        assert torch.equal(q.scale, scale.half()) and torch.equal(q.zero, minimum.half())
        # the file's value minus q4's: q * (scale rounding) + (minimum rounding), each at most 2^-11 relative
        bound = (15 * scale.abs() + minimum.abs()).repeat_interleave(32, 1) * 2.0 ** -11 + 1e-6
        diff = (q.dequantize() - want[i]).abs()
        assert bool((diff <= bound).all()), (i, float((diff - bound).max()))
        assert diff.max() > 0  # Q4_K's d * sc does not fit in float16: q4 rounds it (measured, not assumed)


@pytest.mark.parametrize("qtype, kind", [("Q8_0", "file"), ("Q5_0", "file"), ("Q5_1", "q8"), ("Q4_0", "file"),
                                         ("Q4_0", "q8"), ("Q8_0", "q8"), ("Q4_0", "q4")])
def test_file_and_q8_keep_4_5_and_8_bit_codes_exactly(gguf_files, cache_dir, qtype, kind):
    """Q4_0, Q5_0, Q5_1 and Q8_0 blocks are codes with a float16 scale and minimum per 32 (Q5_0: ``d (q - 16)``,
    minimum ``-16 d``; Q8_0: ``d q`` = ``d (q + 128) - 128 d``): q8 holds them as they are, and so does a ``file``
    model (its 5- and 8-bit tensors as q8 matrices, its 4-bit ones as q4), every weight the file's value."""
    want = _file_values(gguf_files[qtype])
    model, _ = load_pretrained(gguf_files[qtype], dtype="float32")
    assert quantize_loaded(model, kind, gguf_files[qtype]) == 8 and quantization_of(model) == kind
    holds = "q4" if qtype == "Q4_0" and kind != "q8" else "q8"
    for i, m in enumerate(quantized_linears(model)):
        q = getattr(m, ATTR)
        assert q.kind == holds and torch.equal(q.dequantize(), want[i]), i
        assert q.kernel_bits == (4 if holds == "q4" else 8 if qtype == "Q8_0" else 7)  # 4- and 5-bit codes: below 128
    table = llama_forward_for(model)._q4_table(torch.float32)  # the one-call layer loop takes the same bits
    layers = [m for m in quantized_linears(model)][:-1]  # q, k, v, o, gate, up, down (the head is not in the table)
    assert table is not None and set(table[:, 10:].flatten().tolist()) == {getattr(m, ATTR).kernel_bits for m in layers}


def test_a_file_model_keeps_6_bit_tensors_as_they_are(gguf_files, cache_dir):
    """Q6_K (an int8 scale per 16, a float16 d per 256, no minimum) has no per-32 form: a ``file`` model keeps it as q6
    matrices of the file's own codes, d and sub-scales, every weight the file's value bit for bit; the model's own
    forward and the lean one multiply by it. ``wide_bits=8`` requantizes it to q8 from its values instead, within half
    a q8 step (1/510 of the group's range) of the file, 16x closer than q4 would be (``wide_bits=7``: 7-bit codes, the
    kernel's cheaper AVX2 route, within 1/254); int4 and q4 requantize it to their own kind (and the 8-bit codes of
    Q8_0 too)."""
    want = _file_values(gguf_files["Q6_K"])
    model, matrices = _matrices(gguf_files["Q6_K"], "file")
    assert len(matrices) == 8
    for i, (m, q) in enumerate(zip(quantized_linears(model), matrices)):
        assert q.kind == "q6" and q.kernel_bits == 6 and torch.equal(q.dequantize(), want[i]), i
        x = torch.randn(3, want[i].shape[1])
        assert torch.equal(m(x), q.linear(x))
        assert torch.allclose(q.linear(x), x @ want[i].T, rtol=0.02, atol=0.02 * float((x @ want[i].T).abs().max()))
    table = llama_forward_for(model)._q4_table(torch.float32)
    assert table is not None and set(table[:, 10:].flatten().tolist()) == {6}
    eight, _ = load_pretrained(gguf_files["Q6_K"], dtype="float32")
    assert quantize_loaded(eight, "file", gguf_files["Q6_K"], wide_bits=8) == 0
    seven, _ = load_pretrained(gguf_files["Q6_K"], dtype="float32")
    quantize_loaded(seven, "file", gguf_files["Q6_K"], wide_bits=7)
    eights = [getattr(m, ATTR) for m in quantized_linears(eight)]
    sevens = [getattr(m, ATTR) for m in quantized_linears(seven)]
    assert len(sevens) == len(eights) == 8
    for i, (q, q7) in enumerate(zip(eights, sevens)):
        assert q.kind == q7.kind == "q8" and q.kernel_bits == 8 and q7.kernel_bits == 7
        group = want[i].reshape(want[i].shape[0], -1, 32)
        span = (group.amax(-1) - group.amin(-1)).repeat_interleave(32, 1)
        err = (q.dequantize() - want[i]).abs()
        assert bool((err <= span / 510 * 1.01 + 1e-6).all()), i
        assert bool(((q7.dequantize() - want[i]).abs() <= span / 254 * 1.01 + 1e-6).all()), i
        q4 = QuantMatrix.quantize(want[i], "q4")
        assert float(err.mean()) < float((q4.dequantize() - want[i]).abs().mean()) / 8
    for kind in ("int4", "q4"):
        assert {getattr(m, ATTR).kind for m in quantized_linears(_matrices(gguf_files["Q6_K"], kind)[0])} == {kind}
    model, _ = load_pretrained(gguf_files["Q8_0"], dtype="float32")
    assert quantize_loaded(model, "q4", gguf_files["Q8_0"]) == 0
    assert {getattr(m, ATTR).kind for m in quantized_linears(model)} == {"q4"}


def test_other_types_are_requantized_from_their_values(gguf_files, cache_dir):
    model, _ = load_pretrained(gguf_files["Q8_0"], dtype="float32")
    assert quantize_loaded(model, "int4", gguf_files["Q8_0"]) == 0 and quantization_of(model) == "int4"
    float_model, _ = load_pretrained(gguf_files["Q4_K"], dtype="float32")
    assert quantize_loaded(float_model, "q4", gguf_files["Q4_K"]) == 8
    int8, _ = load_pretrained(gguf_files["Q4_K"], dtype="float32")
    assert quantize_loaded(int8, "int8", gguf_files["Q4_K"]) == 0 and quantization_of(int8) == "int8"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))


def test_q6_k_codes_are_gguf_s_dequantization():
    """Q6_K's raw contents (codes, d, sub-scales) give gguf's own dequantized values bit for bit, in gguf's order of
    operations ``(d * sc) * (q - 32)``: what a q6 matrix holds."""
    from speculant.models.gguf import q6_k_codes

    rng = np.random.default_rng(3)
    blocks = _random_q6_k(np.zeros((4, 512)), rng).reshape(-1, 210)
    codes, d, sc = q6_k_codes(torch.from_numpy(blocks.copy()))
    assert codes.shape == (8, 256) and int(codes.max()) < 64 and d.shape == (8, 1) and sc.dtype == torch.int8
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K)).reshape(8, 256)
    step = (d * sc.float()).repeat_interleave(16, 1)
    assert torch.equal(step * (codes.float() - 32), want)
    m = QuantMatrix.q6(codes.reshape(4, 512), d.expand(-1, 8).reshape(4, 16), sc.reshape(4, 32), torch.float32)
    assert torch.equal(m.dequantize(), want.reshape(4, 512))
