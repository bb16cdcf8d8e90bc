"""The matrix cache of GGUF models (speculant.models.matrix_cache): a later load reads the q4 / q8 kernel blocks the
first one wrote and leaves their tensors undecoded, and gets the same model bit for bit (float32 and bfloat16, tied
and untied heads, Llama's permuted rows, Q4_0/Q5_0/Q8_0/Q4_K/Q6_K); a damaged, stale, foreign or incomplete cache
is ignored and rewritten; the blocks round-trip through QuantMatrix.from_blocks."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from speculant.core import kernels, quant
from speculant.core.quant import ATTR, QuantMatrix, quantization_of, quantized_linears
from speculant.models import gguf as gguf_module
from speculant.models import matrix_cache
from speculant.models.loading import load_pretrained, quantize_loaded, resolve_model
from speculant.models.sources import gguf_backing

gguf = pytest.importorskip("gguf", reason="writing GGUF files needs the 'gguf' package")
from test_sources import _tiny_gguf  # noqa: E402

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))


def _state(model) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Each quantized linear's kind and blocks, the embedding and the logits of IDS."""
    mats = [(getattr(m, ATTR).kind, getattr(m, ATTR).blocks.clone()) for m in quantized_linears(model)]
    with torch.no_grad():
        logits = model(IDS).logits
    return mats, model.get_input_embeddings().weight.detach().clone(), logits


def _same(a, b) -> None:
    assert [k for k, _ in a[0]] == [k for k, _ in b[0]]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a[0], b[0]))
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def _decoded(monkeypatch) -> list[int]:
    """Count the tensors load_gguf_model decodes from now on."""
    calls = []
    real = gguf_module.decode

    def spy(data, qtype, pool=None, out=None):
        calls.append(qtype)
        return real(data, qtype, pool, out=out)

    monkeypatch.setattr(gguf_module, "decode", spy)
    return calls


@pytest.mark.parametrize("arch, qtype, tied, kind, dtype", [
    ("llama", "Q4_0", False, "file", "float32"), ("llama", "Q8_0", True, "file", "float32"),
    ("qwen2", "Q4_0", True, "q4", "float32"), ("qwen2", "Q8_0", False, "q8", "float32"),
    ("llama", "Q5_0", False, "q4", "float32"), ("llama", "Q4_0", False, "file", "bfloat16"),
    ("qwen2", "Q8_0", True, "file", "bfloat16")])
def test_a_cached_load_is_the_first_load_bit_for_bit(tmp_path, cache_dir, monkeypatch, arch, qtype, tied, kind,
                                                      dtype):
    """The reference is the float load quantized afterwards (every tensor decoded, nothing cached); the first
    quantized load leaves the tensors it takes as codes undecoded and writes the cache; the later one reads it and
    decodes only the float parts (embedding, norms, any tensor requantized from values). Same blocks, same tied
    embedding (a tied head's dequantized matrix), same logits, every time."""
    _, path = _tiny_gguf(tmp_path, arch, getattr(gguf.GGMLQuantizationType, qtype), tied=tied)
    want, directory = _reference(path, kind, dtype)
    cache = matrix_cache.cache_file(directory, kind, getattr(torch, dtype))
    assert not cache.exists()

    calls = _decoded(monkeypatch)
    first, _ = load_pretrained(path, dtype=dtype, quantization=kind)
    assert quantization_of(first) == kind and cache.is_file()
    _same(_state(first), want)
    first_decodes = len(calls)

    calls.clear()
    later, _ = load_pretrained(path, dtype=dtype, quantization=kind)
    assert quantization_of(later) == kind
    _same(_state(later), want)
    released = [m for m in quantized_linears(later) if m.weight.device.type == "meta"]
    assert released and len(calls) == len(gguf_module._Header(path).tensors) - len(released)
    coded = gguf_module.coded_weights(gguf_backing(directory), later.config, kind)  # taken as codes: never decoded
    assert first_decodes == len(gguf_module._Header(path).tensors) - len(coded)
    assert bool(coded) == ((qtype, kind) != ("Q5_0", "q4"))  # 5-bit codes in a q4 model: requantized from values


def _reference(path, kind, dtype="float32"):
    """The float load quantized afterwards (every tensor decoded, nothing cached): the state to match, and the
    model directory."""
    float_model, _ = load_pretrained(path, dtype=dtype)
    directory = resolve_model(path)
    quantize_loaded(float_model, kind, gguf_backing(directory))
    return _state(float_model), directory


@pytest.fixture(scope="module")
def k_quants(tmp_path_factory):
    """Tiny Llama GGUF files (hidden 256) with every matrix Q4_K or Q6_K (random valid blocks, as
    test_quant_loading.py writes them)."""
    import numpy as np
    from test_quant_loading import _random_q4_k, _random_q6_k
    from test_sources import write_llama_gguf

    from speculant.tiny_models import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(["a tiny k-quant test.\n" * 3, "def g(y):\n    return y * 2\n" * 3], vocab_size=300)
    model = tiny_model("llama", seed=0, vocab_size=len(tok), hidden=256, layers=1, heads=4, kv_heads=2, context=64,
                       init_std=0.05)
    rng, root, files = np.random.default_rng(1), tmp_path_factory.mktemp("k-quants"), {}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("Q4_K", "Q6_K"):
            mp.setattr(gguf.quants, "quantize", lambda w, qtype: _random_q6_k(w, rng)
                       if qtype == gguf.GGMLQuantizationType.Q6_K else _random_q4_k(w, rng, 4.0))
            files[name] = write_llama_gguf(root / f"tiny-{name}.gguf", model, tok, gguf.GGMLQuantizationType[name])
    return files


@pytest.mark.parametrize("qtype, kind", [("Q4_K", "file"), ("Q4_K", "q8"), ("Q6_K", "file"), ("Q6_K", "q4")])
def test_k_quant_files_through_the_cache(k_quants, cache_dir, qtype, kind):
    """Q4_K codes (scales of 17 significant bits, rounded to float16) and Q6_K (requantized from its values) come
    back from the cache as built."""
    want, _ = _reference(k_quants[qtype], kind)
    for _ in range(2):  # the first load builds and caches, the second reads
        _same(_state(load_pretrained(k_quants[qtype], dtype="float32", quantization=kind)[0]), want)


def test_a_bfloat16_load_has_its_own_cache(tmp_path, cache_dir):
    _, path = _tiny_gguf(tmp_path, "llama", gguf.GGMLQuantizationType.Q8_0)
    for dtype in ("float32", "bfloat16"):
        load_pretrained(path, dtype=dtype, quantization="file")
    directory = resolve_model(path)
    assert matrix_cache.cache_file(directory, "file", torch.float32).is_file()
    assert matrix_cache.cache_file(directory, "file", torch.bfloat16).is_file()
    model, _ = load_pretrained(path, dtype="bfloat16", quantization="file")
    assert {getattr(m, ATTR).dtype for m in quantized_linears(model)} == {torch.bfloat16}
    assert matrix_cache.cache_file(directory, "int4", torch.float32) is None  # torch's kinds: not cached


@pytest.mark.parametrize("damage", ["truncated", "garbage", "another file", "another build", "bad description",
                                    "a matrix missing"])
def test_a_damaged_or_stale_cache_is_ignored_and_rewritten(tmp_path, cache_dir, monkeypatch, caplog, damage):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _, path = _tiny_gguf(tmp_path, "llama", gguf.GGMLQuantizationType.Q4_0)
    want = _state(load_pretrained(path, dtype="float32", quantization="file")[0])
    cache = matrix_cache.cache_file(resolve_model(path), "file", torch.float32)
    good = cache.read_bytes()
    with safe_open(str(cache), framework="pt") as f:
        about = json.loads(f.metadata()["speculant"])
    tensors = load_file(str(cache))
    if damage == "truncated":
        cache.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        cache.write_bytes(b"not a safetensors file at all")
    elif damage == "another file":  # a model of the same shapes made from another GGUF file
        (tmp_path / "other").mkdir()
        _, other = _tiny_gguf(tmp_path / "other", "llama", gguf.GGMLQuantizationType.Q8_0)
        load_pretrained(other, dtype="float32", quantization="file")
        cache.write_bytes(matrix_cache.cache_file(resolve_model(other), "file", torch.float32).read_bytes())
    elif damage == "another build":  # made the way an older version made matrices
        save_file(tensors, str(cache), metadata={"speculant": json.dumps({**about, "build": matrix_cache.BUILD - 1})})
    elif damage == "bad description":
        about["matrices"][next(iter(about["matrices"]))] = {"kind": "q4", "shape": 3, "released": True}
        save_file(tensors, str(cache), metadata={"speculant": json.dumps(about)})
    else:  # a matrix missing: its tensor would stay undecoded and be quantized from nothing
        gone = next(iter(about["matrices"]))
        del about["matrices"][gone], tensors[gone]
        save_file(tensors, str(cache), metadata={"speculant": json.dumps(about)})
    caplog.set_level(logging.WARNING, logger="speculant.models.matrix_cache")
    model, _ = load_pretrained(path, dtype="float32", quantization="file")
    _same(_state(model), want)
    assert "ignoring the matrix cache" in caplog.text
    assert cache.read_bytes() == good  # rewritten as the first load wrote it
    _same(_state(load_pretrained(path, dtype="float32", quantization="file")[0]), want)


def test_outdated_files_are_removed_when_the_cache_is_written(tmp_path, cache_dir):
    import os
    import time

    _, path = _tiny_gguf(tmp_path, "llama", gguf.GGMLQuantizationType.Q4_0)
    directory = resolve_model(path)
    cache = matrix_cache.cache_file(directory, "file", torch.float32)
    older = cache.with_name(cache.name.replace(f"-v{quant.BLOCK_LAYOUT}.", "-v0."))
    newer = cache.with_name(cache.name.replace(f"-v{quant.BLOCK_LAYOUT}.", f"-v{quant.BLOCK_LAYOUT + 1}."))
    other_dtype = matrix_cache.cache_file(directory, "file", torch.bfloat16)
    stale, fresh = directory / ".matrices-1.tmp", directory / ".matrices-2.tmp"
    for p in (older, newer, other_dtype, stale, fresh):
        p.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    load_pretrained(path, dtype="float32", quantization="file")
    assert cache.is_file() and not older.exists() and not stale.exists()
    # a newer installation's layout, another dtype's cache, a write that may be in flight: kept
    assert newer.exists() and other_dtype.exists() and fresh.exists()


def test_an_unwritable_cache_still_loads(tmp_path, cache_dir, monkeypatch, caplog):
    _, path = _tiny_gguf(tmp_path, "qwen2", gguf.GGMLQuantizationType.Q4_0)
    want = _state(load_pretrained(path, dtype="float32", quantization="q4")[0])

    from safetensors import SafetensorError

    def refuse(*args, **kwargs):  # safetensors' own I/O error (not an OSError)
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    cache = matrix_cache.cache_file(resolve_model(path), "q4", torch.float32)
    cache.unlink()
    monkeypatch.setattr("safetensors.torch.save_file", refuse)
    caplog.set_level(logging.WARNING, logger="speculant.models.matrix_cache")
    model, _ = load_pretrained(path, dtype="float32", quantization="q4")
    _same(_state(model), want)
    assert "could not write the matrix cache" in caplog.text and not cache.exists()
    assert not list(cache.parent.glob(".matrices-*"))  # no temporary left behind


@pytest.mark.parametrize("kind", ["q4", "q8", "q6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [True, False])
def test_blocks_round_trip(kind, dtype, compiled, monkeypatch):
    w = torch.randn(40, 96, dtype=dtype)  # 40 rows: padded to 48 in the blocks
    if not compiled:  # no compiler: torch's reference multiplies, reading the codes kept unpacked
        monkeypatch.setattr(kernels, "library", lambda: None)
    m = QuantMatrix.quantize(w, kind)
    back = QuantMatrix.from_blocks(kind, tuple(m.shape), m.blocks.clone(), dtype)
    assert (back._codes is None) == compiled
    assert back.kind == kind and back.shape == m.shape and back.dtype == dtype and back.nbytes == m.nbytes
    assert torch.equal(back.scale, m.scale) and torch.equal(back.zero, m.zero)
    assert torch.equal(back.unpacked_codes(), m.unpacked_codes()) and torch.equal(back.dequantize(), m.dequantize())
    x = torch.randn(3, 96, dtype=dtype)
    assert torch.equal(back.linear(x), m.linear(x))
    assert torch.equal(QuantMatrix.cat([back, back]).blocks, QuantMatrix.cat([m, m]).blocks)
    with pytest.raises(ValueError, match="blocks of a 40 x 64 matrix"):
        QuantMatrix.from_blocks(kind, (40, 64), m.blocks, dtype)
    with pytest.raises(ValueError, match="q4, q8 or q6"):
        QuantMatrix.from_blocks("int4", (40, 96), m.blocks, dtype)
    with pytest.raises(ValueError, match="no q4 / q8 / q6 kernel blocks"):
        _ = QuantMatrix.quantize(w, "int8").blocks
