"""Training pipeline: corpus split, tokenizer, losses, a few pretraining steps (resumable), model loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import speculant
from speculant.data.corpus import load_corpus, split_of
from speculant.train.losses import distill_loss
from speculant.train.bundled.pretrain import TrainConfig, train
from speculant.train.bundled.tokenizer import save_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_corpus_split_is_by_module_and_deterministic(corpus):
    splits: dict[str, set[str]] = {}
    for d in corpus:
        splits.setdefault(d.top, set()).add(d.split)
        assert d.split == split_of(d.top)
        assert "/test/" not in d.module.replace(".", "/") + "/" or d.module.startswith("pydoc:")
    assert all(len(s) == 1 for s in splits.values()), "a module contributes to two splits"
    counts = {s: sum(len(d.text) for d in corpus if d.split == s) for s in ("train", "validation", "test")}
    assert counts["train"] > 10 * counts["validation"] > 0 and counts["test"] > 0
    assert not any(d.top == "test" for d in corpus)  # the stdlib's own test suite is excluded
    assert any(d.module.startswith("pydoc:") for d in corpus)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    texts = [d.text for d in corpus if d.split == "train"][:40]
    return train_tokenizer(texts, vocab_size=400)


def test_tokenizer_round_trips_and_loads(tokenizer, tmp_path):
    text = 'def f(x):\n    """Tab\there, ünïcødé ✓."""\n\treturn {x: [1, 2]}  # done\n\n'
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 400
    save_tokenizer(tokenizer, tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again(text).input_ids == ids and again.eos_token == "<|endoftext|>"


def test_tvd_surrogate_gradient_is_the_exact_tvd_gradient():
    torch.manual_seed(0)
    z = torch.randn(5, 11, requires_grad=True)
    q_logits = torch.randn(5, 11)
    tvd = 0.5 * (q_logits.softmax(-1) - z.softmax(-1)).abs().sum(-1).mean()
    (want,) = torch.autograd.grad(tvd, z)
    (got,) = torch.autograd.grad(distill_loss(z, q_logits, "tvd"), z)
    torch.testing.assert_close(got, want)
    fkl = distill_loss(z, q_logits, "fkl")
    kl = torch.nn.functional.kl_div(z.log_softmax(-1), q_logits.softmax(-1), reduction="none").sum(-1).mean()
    torch.testing.assert_close(torch.autograd.grad(fkl, z)[0], torch.autograd.grad(kl, z)[0])
    assert torch.isfinite(distill_loss(z, q_logits, "tvd++"))
    with pytest.raises(ValueError, match="unknown distillation loss"):
        distill_loss(z, q_logits, "rkl")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tokenizer, corpus):
    d = tmp_path_factory.mktemp("data")
    save_tokenizer(tokenizer, d)
    docs = [x.text for x in corpus if x.split == "train"][:40]
    stream = np.asarray(sum((tokenizer(t).input_ids + [tokenizer.eos_token_id] for t in docs), []), dtype=np.uint16)
    np.save(d / "train.npy", stream[: len(stream) * 9 // 10])
    np.save(d / "validation.npy", stream[len(stream) * 9 // 10 :])
    (d / "splits.json").write_text(json.dumps({s: {"modules": [], "tokens": 0} for s in ("train", "validation", "test")}))
    return d


def test_few_steps_lower_the_loss_and_resume(data_dir, tmp_path):
    cfg = dict(data=str(data_dir), out=str(tmp_path / "run"), preset="tiny", batch_size=8, seq_len=32,
               long_seq_len=64, long_fraction=0.1, lr=3e-3, warmup=5, ckpt_every=10, eval_batches=2, threads=1)
    train(TrainConfig(steps=20, **cfg), progress=False)
    first = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert first["step"] == 20
    export = train(TrainConfig(steps=60, **cfg), progress=False)  # resumes at step 20
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    history = state["history"]
    assert state["step"] == 60 and [h["step"] for h in history][:2] == [10, 20] and history[-1]["step"] == 60
    assert history[-1]["ce"] < history[0]["ce"] - 0.5
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["validation_loss"] < np.log(400)  # better than uniform over the vocabulary
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 400


def test_load_pretrained_errors(tmp_path):
    with pytest.raises(ValueError, match="'no-such-model' does not exist, and it is not a .gguf file, a bundled name"):
        speculant.load_pretrained("no-such-model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is missing weights"):
        speculant.load_pretrained(str(tmp_path))


def test_bundled_models_load_offline_and_generate():
    from speculant.models.loading import bundled_dir

    assert bundled_dir("default-target") is not None and bundled_dir("default-draft") is not None
    target, tok = speculant.load_pretrained("default-target")
    draft, dtok = speculant.load_pretrained("default-draft")
    assert tok.get_vocab() == dtok.get_vocab() and len(tok) == 16384
    assert target.dtype == torch.float32  # bundled models load in fp32 by default (exact greedy equality)
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 25e6 <= n_target <= 40e6 and 2e6 <= n_draft <= 5e6
    ids = tok("def add(a, b):\n").input_ids
    gen = speculant.generate(target, ids, drafter=speculant.DraftModelDrafter(draft, k=4), max_new_tokens=16)
    plain = speculant.generate(target, ids, max_new_tokens=16)
    assert gen.token_ids == plain.token_ids and len(gen.token_ids) >= 1
    text = "    return a + b\n"
    assert tok.decode(tok(text).input_ids) == text


def test_distill_data_then_fine_tune_and_calibrate(data_dir, tmp_path):
    """The Direct Alignment path on a tiny model: the target's completions of training prompts become a split, a
    draft fine-tunes on it from an existing model against the target, and VocabTrim calibrates on it."""
    from speculant.train.calibrate import write_calibration
    from speculant.train.bundled.distill_data import DistillDataConfig, generate_distill_data

    cfg = dict(data=str(data_dir), preset="tiny", batch_size=4, seq_len=32, long_fraction=0.0, lr=3e-3,
               warmup=2, ckpt_every=100, eval_batches=1, threads=1)
    teacher = train(TrainConfig(out=str(tmp_path / "teacher"), steps=30, **cfg), progress=False)
    tokens = np.load(data_dir / "train.npy")
    # code_prompts() reads the real corpus (train split); keep this fast with few short prompts
    path = generate_distill_data(DistillDataConfig(
        data=str(data_dir), teacher=str(teacher), split="distill", prompts=8, max_new_tokens=12,
        min_prompt_tokens=4, max_prompt_tokens=24, temperatures=[0.0, 1.0], batch_size=4, threads=1,
        precision="fp32"), progress=False)
    stream = np.load(path)
    info = json.loads((data_dir / "distill.json").read_text())
    assert info["samples"] == 8 and 0 < info["generated_tokens"] <= 8 * 12 and len(stream) == info["tokens"]
    assert stream.max() < 400 and len(tokens) > len(stream)

    tuned = train(TrainConfig(out=str(tmp_path / "draft"), steps=6, init=str(teacher), train_split="distill",
                              teacher=str(teacher), kd_weight=0.9, **cfg), progress=False)
    before = AutoModelForCausalLM.from_pretrained(teacher, local_files_only=True)
    after = AutoModelForCausalLM.from_pretrained(tuned, local_files_only=True)
    # started from the teacher's weights (not a fresh initialisation) and moved
    with torch.no_grad():
        diff = [float((a - b).abs().max()) for a, b in zip(after.parameters(), before.parameters())]
    assert 0 < max(diff) < 0.5

    out = write_calibration(tuned, data_dir, "distill", default_size=16)
    cal = json.loads(out.read_text())
    counts = np.bincount(stream.astype(np.int64), minlength=400)
    assert cal["default_size"] == 16 and counts[cal["token_ids"][0]] == counts.max()
    assert sorted(cal["token_ids"]) == sorted(np.flatnonzero(counts).tolist())
