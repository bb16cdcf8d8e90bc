"""``speculant train draft``: a drafter for any Hugging Face or GGUF target, the Direct Alignment way.

Goel et al. 2024, "Direct Alignment of Draft Model for Speculative Decoding with Chat-Fine-Tuned LLMs":

1. **prompts** and 2. **answers**: instruction prompts, answered by the target through its chat template at
   several temperatures with its top-k distribution at every answer token kept, or the prompts' own answers read
   by the target (:mod:`.answers_stage`: :func:`~.answers_stage.run_answers`, ``RUN/answers/``);
3. **fine-tune**: a small drafter, initialised from a few of the target's own layers and sharing its embedding and
   LM head (frozen), learns the target's answers with a distillation loss (FKL, TVD or TVD++,
   :mod:`..losses`) over the VocabTrim kept set it will draft from (:mod:`.draft_train`). ``kind="model"``
   fine-tunes a draft model of its own instead (``draft``: e.g. a smaller sibling sharing the target's tokenizer,
   as the paper does), all of it but its embedding and LM head; ``kind="feature"``
   makes a feature (EAGLE) drafter instead, which also reads the target's hidden states: the target's states
   over the answers are extracted first (``RUN/features/``, :func:`~.answers_stage.run_features`) and the
   drafter also regresses them (:mod:`.feature_train`);
4. **export**: the drafter's own layers and norm (``model.safetensors``), its config, ``attached.json`` (what
   it shares with which target; a ``model`` drafter: the whole model in bfloat16 with its tokenizer and
   ``draft_model.json``, a directory ``--draft`` takes as it is), ``vocab_trim.json`` from the target's answers,
   the training history and a ``MODEL_CARD.md``.

Every stage writes its result before the next starts and is skipped when that result exists, so an interrupted
run resumes where it stopped (the training stage from its last checkpoint). The run's options and the checks made
before any work are in :mod:`.checks`; this module trains and exports (:func:`run_training`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .checks import FEATURE_KINDS, DraftRunConfig, check_draft, check_extra_data, check_init, resolve_kind

__all__ = ["DRAFT_MODEL_FILE", "run_training", "split_validation"]


DRAFT_MODEL_FILE = "draft_model.json"
"""What an exported ``model`` drafter was made from and how (beside its ``config.json``)."""


_GREEDY_KEEP = 4096  # VocabTrim size used by default under greedy decoding (the target's top token is rarely rarer)
_CONTEXT = 96  # prompt tokens before each answer seen in training (a 2-layer drafter looks little further back)


def _samples(cfg: DraftRunConfig, run: Path) -> list:
    """The training samples of the answers (and, for feature kinds, the states) in ``run``."""
    from .answers import AnswerShard, shard_paths
    from .draft_train import collect_samples

    paths = shard_paths(run / "answers")  # shards finish out of order: pair each with its own features
    if not paths:
        raise ValueError(f"{run} has no answer shards")
    shards = [AnswerShard.load(p) for p in paths]
    if cfg.kind in FEATURE_KINDS:
        from .feature_train import collect_feature_samples
        from .features import features_dir, load_features

        feats = load_features(features_dir(run, cfg.taps), paths)
        return collect_feature_samples(shards, feats, context=_CONTEXT)
    return collect_samples(shards, context=_CONTEXT)


def _split_samples(cfg: DraftRunConfig, run: Path):
    """``(train, validation)``: the run's own samples split by prompt row (:func:`split_validation`), then the
    samples of ``cfg.extra_data``'s runs added to training only, less those whose prompt a validation sample has
    (the same request read or answered in another run). The validation stays the run's own answers."""
    from .answers import run_list

    check_extra_data(cfg)
    train, validation = split_validation(_samples(cfg, run), cfg.validation_fraction, cfg.seed)
    held = {_prompt_key(s) for s in validation}
    for extra in run_list(cfg.extra_data):
        train += [s for s in _samples(cfg, extra) if _prompt_key(s) not in held]
    return train, validation


def _prompt_key(sample) -> tuple:
    """What identifies a sample's prompt across runs: its length and its last tokens (the chat template applied)."""
    return sample.start, sample.context.tobytes()


def split_validation(samples: list, fraction: float, seed: int) -> tuple[list, list]:
    """``(train, validation)``: a sample is held out when a hash of its prompt row (and ``seed``) falls in the
    first ``fraction`` of the hash range, so a run whose data grows keeps its held-out prompts held out (the
    answers of one prompt at several temperatures stay on one side); at least one sample is held out."""
    def unit(row: int) -> float:  # a hash of the row in [0, 1)
        return ((row * 2654435761 + seed * 40503 + 12345) % 2**32) / 2**32

    held = [unit(s.row) < fraction for s in samples]
    if not any(held) and samples:
        held[min(range(len(samples)), key=lambda i: unit(samples[i].row))] = True
    return [s for s, h in zip(samples, held) if not h], [s for s, h in zip(samples, held) if h]


def _draft_model(cfg: DraftRunConfig) -> tuple:
    """``(draft model in float32, its tokenizer, the target's stop ids)`` of a ``model`` run."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from ...models.chat import stop_ids
    from ...models.loading import load_pretrained, resolve_model

    tokenizer, _ = check_draft(cfg)
    target_dir = resolve_model(cfg.target)
    try:  # the target's generation config, as loading it would give: its file, else derived from its config
        generation = GenerationConfig.from_pretrained(str(target_dir), local_files_only=True)
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(target_dir),
                                                                                   local_files_only=True))
    draft, draft_tokenizer = load_pretrained(cfg.draft, dtype="float32")
    names = {n for n, _ in draft.named_parameters()}
    if not {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"} <= names:
        raise ValueError(f"--draft {cfg.draft}: --kind model fine-tunes Llama-family models (model.embed_tokens, "
                         f"model.layers.N), not {type(draft).__name__}")
    return draft, draft_tokenizer, stop_ids(tokenizer, SimpleNamespace(generation_config=generation))


def _frozen(cfg: DraftRunConfig, draft) -> tuple[str, ...]:
    """Name prefixes of the parameters a ``model`` run keeps as they are: with ``train_last`` N, the decoder layers
    before the last N (their outputs need no gradient, so a step costs their forward only)."""
    if cfg.kind != "model" or cfg.train_last is None:
        return ()
    return tuple(f"model.layers.{i}." for i in range(draft.config.num_hidden_layers - cfg.train_last))


def _save_draft_model(draft, tokenizer, out: Path, meta: dict) -> None:
    """Export a fine-tuned ``model`` drafter (its last use: it is left in bfloat16): the whole model, its tokenizer
    and ``meta``."""
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(out, max_shard_size="1000GB")  # one model.safetensors
    tokenizer.save_pretrained(out)
    (out / DRAFT_MODEL_FILE).write_text(json.dumps(meta, indent=1))


def _add_contemplation(cfg: DraftRunConfig, draft, target, samples: list) -> None:
    """Give a drafter that has none ConFu's parameters (:mod:`speculant.models.confu_contemplation`), the soft prompt
    started from the target's own keys and values over the first training answer's tokens."""
    from ...models.confu_contemplation import add_contemplation, contemplation_of

    if contemplation_of(draft) is not None:
        return
    module = add_contemplation(draft, target.config, soft=cfg.soft, mixture=cfg.mixture)
    tokens = np.concatenate([np.concatenate([s.context, s.answer]) for s in samples[:8]])  # [N] token ids
    if len(tokens) < cfg.soft:
        raise ValueError(f"--soft {cfg.soft}: the training data holds only {len(tokens)} tokens to start the soft "
                         "prompt from")
    module.init_from(target, torch.from_numpy(tokens[: cfg.soft].astype(np.int64)))  # [soft]


def _machine(cfg: DraftRunConfig) -> str:
    """One line on where the drafter was trained (for its model card)."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    threads = torch.get_num_threads()
    return (f"{os.cpu_count()} CPU cores ({cpu}), {threads} torch thread{'s' if threads != 1 else ''}, "
            f"torch {torch.__version__}, no GPU")


def run_training(cfg: DraftRunConfig, loss: str | None = None, progress: bool = True) -> Path:
    """Stage 3: fine-tune the attached drafter with ``loss`` (default ``cfg.loss``; ``"none"`` exports the
    untrained initialisation) and export it to ``RUN/<loss>/draft``; returns that directory."""
    from ...models.attached import build_attached, load_attached, save_attached
    from ...models.chat import stop_ids
    from ...models.loading import load_pretrained
    from ..calibrate import write_calibration_tokens
    from .draft_train import TOKEN, kept_ids, train_attached
    from ..precision import autocast_dtype

    loss = loss or cfg.loss
    resolve_kind(cfg)
    run = Path(cfg.out)
    out = run / (("" if cfg.kind == "token" else cfg.kind + "-") + loss.replace("+", "p"))
    export = out / "draft"
    if (export / "model.safetensors").exists():
        return export
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out.mkdir(parents=True, exist_ok=True)
    earlier = out / "run_config.json"
    if (out / "checkpoint.pt").exists() and earlier.exists():  # resuming: the same start, or the card would lie
        before = json.loads(earlier.read_text())
        started = before.get("init")
        if started != cfg.init:
            raise ValueError(f"{out} holds a checkpoint of a training started from "
                             f"{started or 'the target layers'}; resume it with the same --init (now: "
                             f"{cfg.init or 'none'}), or train into another --out")
        for name in ("draft", "train_last"):  # a model drafter: the same model, the same layers trained
            if before.get(name) != getattr(cfg, name):
                raise ValueError(f"{out} holds a checkpoint of a training with --{name.replace('_', '-')} "
                                 f"{before.get(name)}; resume it with the same (now: {getattr(cfg, name)}), or train "
                                 "into another --out")
    earlier.write_text(json.dumps({**asdict(cfg), "loss": loss}, indent=1))
    if cfg.kind == "model":  # a draft model of its own: the target's answers hold all it teaches, no weights needed
        draft, tokenizer, stops = _draft_model(cfg)  # tokenizer: the draft's own (the target's vocabulary)
        target = None
    else:
        target, tokenizer = load_pretrained(cfg.target, dtype="float32")
        stops = stop_ids(tokenizer, target)
    train, validation = _split_samples(cfg, run)
    vocab = (target if target is not None else draft).get_input_embeddings().weight.shape[0]
    kept = kept_ids(train, vocab, cfg.keep, stops)
    if cfg.init:  # continue an earlier drafter (e.g. the shipped one) on this run's data
        check_init(cfg)
        draft = load_attached(cfg.init, target)
    elif target is not None:
        draft = build_attached(target, cfg.layers, features=cfg.kind in FEATURE_KINDS, taps=cfg.taps)
    objective = TOKEN
    if cfg.kind == "confu":
        from .confu_training import ConFuObjective

        _add_contemplation(cfg, draft, target, train)
        objective = ConFuObjective(regression=cfg.regression, unroll=cfg.unroll, target=target, window=cfg.window)
    elif cfg.kind in FEATURE_KINDS:
        from .feature_train import FeatureObjective

        objective = FeatureObjective(regression=cfg.regression, unroll=cfg.unroll)
    start = time.perf_counter()
    if loss == "none":
        from .draft_train import batches, evaluate, kept_head

        kept_index, head = kept_head(draft, kept)
        history = [{"step": 0, **evaluate(draft, batches(validation, kept_index, cfg.batch_size, stops[0], objective),
                                          head, objective)}]
        out.mkdir(parents=True, exist_ok=True)
        (out / "history.json").write_text(json.dumps(history, indent=1))
    else:
        history = train_attached(draft, train, validation, kept, out, loss=loss, steps=cfg.steps,
                                 batch_size=cfg.batch_size, lr=cfg.lr, warmup=cfg.warmup, seed=cfg.seed,
                                 pad=stops[0], amp=autocast_dtype(cfg.precision, torch.device("cpu")),
                                 progress=progress, objective=objective, group_by_length=cfg.group_by_length,
                                 frozen=_frozen(cfg, draft))
    # the training's own clock across resumed runs (the history's last row), else this run's time
    seconds = max(time.perf_counter() - start, float(history[-1].get("seconds") or 0.0))
    tmp = out / "draft.tmp"
    meta = {"kind": cfg.kind, "loss": loss, "steps": cfg.steps if loss != "none" else 0,
            "train_seconds": round(seconds, 1), "validation": history[-1], "machine": _machine(cfg)}
    if target is None:
        _save_draft_model(draft, tokenizer, tmp, {"target": cfg.target, "draft": cfg.draft,
                                                  "train_last": cfg.train_last, **meta})
    else:
        save_attached(draft, target, tmp, target_name=cfg.target, storage=cfg.store, extra={
            **meta, "layers_from_target": cfg.layers, "taps": cfg.taps, "init": cfg.init})
    answers = np.concatenate([s.answer for s in train])  # [N]: every training answer token
    seen = int((np.bincount(answers.astype(np.int64)) > 0).sum())  # distinct tokens answered
    write_calibration_tokens(tmp, answers, "the training answers (distillation data)",
                             default_size=min(cfg.keep, _GREEDY_KEEP, seen), default_size_sampling=min(cfg.keep, seen))
    if export.exists():
        import shutil

        shutil.rmtree(export)
    tmp.rename(export)
    return export
