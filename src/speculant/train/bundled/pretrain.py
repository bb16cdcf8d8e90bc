"""Pretraining (and optional distillation) of Llama-architecture models on the prepared corpus.

AdamW, linear warm-up then cosine decay, bf16 autocast where the device supports it, resumable checkpoints
(model, optimizer, step, data RNG) every ``ckpt_every`` steps, a progress bar with loss and tokens/s, and the
validation loss / perplexity at the end. The result is exported as a Hugging Face directory (safetensors in
bf16, tokenizer, generation config) loadable with ``AutoModelForCausalLM.from_pretrained``.

With ``teacher`` set, the loss is ``(1 - kd_weight) * CE + kd_weight * distill_loss(student, teacher)``,
the teacher (the target) running teacher-forced on the same batch. With ``init`` a trained model is fine-tuned
instead (its architecture replaces the preset's), and ``train_split`` selects the token stream, e.g. the target's
own completions written by :mod:`.distill_data` (the Direct Alignment recipe of Goel et al. 2024).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from .data import load_split
from ..losses import distill_loss
from ..precision import autocast_dtype

__all__ = ["ModelSpec", "PRESETS", "TrainConfig", "build_model", "train", "evaluate"]

log = logging.getLogger(__name__)


@dataclass
class ModelSpec:
    """A Llama configuration (tied input/output embeddings)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int = 2048

    def config(self, vocab_size: int, eos_id: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate,
            max_position_embeddings=self.context, tie_word_embeddings=True, bos_token_id=eos_id,
            eos_token_id=eos_id, pad_token_id=eos_id, rope_theta=10000.0,
        )


PRESETS: dict[str, ModelSpec] = {
    "target": ModelSpec(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),
    "draft": ModelSpec(hidden=192, layers=2, heads=3, kv_heads=1, intermediate=512),
    "tiny": ModelSpec(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, context=256),
}


@dataclass
class TrainConfig:
    """Everything a training run depends on (saved in the run directory, checked on resume)."""

    data: str  # directory written by ``prepare`` (tokenizer + token arrays)
    out: str  # run directory: checkpoints, logs, the exported model in ``out/model``
    preset: str = "target"
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 1024
    long_seq_len: int = 2048  # the last ``long_fraction`` of the steps train on longer windows (same tokens/step)
    long_fraction: float = 0.15
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 100
    eval_batches: int = 16
    device: str = "auto"
    precision: str = "auto"  # auto | fp32 | bf16
    teacher: str | None = None  # HF directory of the target to distil from
    kd_weight: float = 0.5
    kd_loss: str = "fkl"
    threads: int | None = None
    init: str | None = None  # HF directory to start from (fine-tuning) instead of a random initialisation
    train_split: str = "train"  # or a split written by ``distill_data`` (the target's own completions)
    extra: dict = field(default_factory=dict)


def build_model(spec: ModelSpec, vocab_size: int, eos_id: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(spec.config(vocab_size, eos_id), dtype=torch.float32)


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    return autocast_dtype(cfg.precision, device)


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int, device) -> torch.Tensor:
    """``[batch, seq_len + 1]`` random windows of the token stream."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows).to(device)


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, seq_len: int, batches: int, batch_size: int, device, amp=None) -> float:
    """Mean next-token cross-entropy over ``batches`` fixed (seeded) windows of ``tokens``."""
    model.eval()
    rng = np.random.default_rng(1234)
    total = 0.0
    for _ in range(batches):
        x = _batch(tokens, rng, batch_size, seq_len, device)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = model(input_ids=x[:, :-1]).logits
        total += float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()))
    model.train()
    return total / batches


def train(cfg: TrainConfig, progress: bool = True) -> Path:
    """Run (or resume) training; export the model to ``cfg.out/model`` and return that path."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = _device(cfg)
    amp = _autocast_dtype(cfg, device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.data, local_files_only=True)
    train_tokens = load_split(cfg.data, cfg.train_split)
    val_tokens = load_split(cfg.data, "validation")
    spec = PRESETS[cfg.preset]
    if cfg.init:
        model = AutoModelForCausalLM.from_pretrained(cfg.init, local_files_only=True, dtype=torch.float32)
        if model.get_input_embeddings().num_embeddings != len(tokenizer):
            raise ValueError(f"{cfg.init} has a vocabulary of {model.get_input_embeddings().num_embeddings} "
                             f"tokens but the tokenizer in {cfg.data} has {len(tokenizer)}")
        model.to(device)
    else:
        model = build_model(spec, len(tokenizer), tokenizer.eos_token_id, cfg.seed).to(device)
    model.train()
    teacher = None
    if cfg.teacher:
        teacher = AutoModelForCausalLM.from_pretrained(cfg.teacher, local_files_only=True, dtype=torch.float32)
        teacher.to(device).eval()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    rng = np.random.default_rng(cfg.seed)
    step = 0
    ckpt = out / "checkpoint.pt"
    history: list[dict] = []
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        if state["config"] != asdict(cfg):
            log.warning("resuming %s with a different config: %s", ckpt, state["config"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        step = state["step"]
        history = state.get("history", [])
        log.info("resumed from step %d", step)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1))

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"config": asdict(cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "rng": rng.bit_generator.state, "step": step, "history": history}, tmp)
        tmp.replace(ckpt)

    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, desc=f"train {cfg.preset}", unit="step")
    t_last, tok_since = time.perf_counter(), 0
    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        seq_len, batch = cfg.seq_len, cfg.batch_size
        if cfg.long_fraction > 0 and step >= (1 - cfg.long_fraction) * cfg.steps:
            seq_len, batch = cfg.long_seq_len, max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len)
        x = _batch(train_tokens, rng, batch, seq_len, device)
        inputs, labels = x[:, :-1], x[:, 1:]
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = model(input_ids=inputs).logits
        ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss = ce
        if teacher is not None:
            with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                t_logits = teacher(input_ids=inputs).logits
            kd = distill_loss(logits, t_logits, cfg.kd_loss)
            loss = (1 - cfg.kd_weight) * ce + cfg.kd_weight * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tok_since += inputs.numel()
        if step % 10 == 0 or step == cfg.steps:
            now = time.perf_counter()
            rate = tok_since / (now - t_last)
            t_last, tok_since = now, 0
            history.append({"step": step, "loss": loss.item(), "ce": ce.item(), "lr": _lr(cfg, step - 1),
                            "tokens_per_s": rate})
            bar.set_postfix(loss=f"{ce.item():.3f}", tok_s=f"{rate:.0f}")
        bar.update(1)
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save()
    bar.close()

    val_loss = evaluate(model, val_tokens, cfg.seq_len, cfg.eval_batches, cfg.batch_size, device, amp)
    metrics = {
        "steps": step,
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "validation_loss_long": evaluate(model, val_tokens, cfg.long_seq_len, max(1, cfg.eval_batches // 2),
                                         max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len), device, amp)
        if cfg.long_fraction > 0 else None,
        "train_loss_last": history[-1]["ce"] if history else None,
        "validation_loss": val_loss,
        "validation_perplexity": math.exp(val_loss),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "precision": str(amp or torch.float32),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    export = out / "model"
    model.to(torch.bfloat16).save_pretrained(export)
    tokenizer.save_pretrained(export)
    log.info("exported %s (validation loss %.3f, perplexity %.1f)", export, val_loss, math.exp(val_loss))
    return export
