"""``speculant train ACTION``: the training pipeline on the command line.

Actions: ``prepare`` (corpus, tokenizer, tokenised splits), ``model`` (pretrain or distil a model), ``calibrate``
(VocabTrim token frequencies of a draft model), ``distill-data`` (a target's completions of training prompts) and
``draft`` (Direct Alignment: a drafter for any target). Each prints the path it wrote on stdout. Options are
declared from the config dataclasses (:class:`speculant.train.bundled.pretrain.TrainConfig`, ...), which hold the
defaults. Bad options raise ValueError before any work, reported as one line by :func:`speculant.cli.main`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from .common import (
    Formatter,
    Parser,
    add_dataclass_arguments,
    dataclass_from_args,
    nonnegative_int,
    option_name,
    positive_int,
)

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = (
    "Training pipeline. 'prepare' builds the corpus (this interpreter's standard library and pydoc topics, split "
    "by module), trains the byte-level BPE tokenizer and tokenises the splits; 'model' pretrains a Llama model "
    "(optionally distilling from a teacher), with a progress bar and resumable checkpoints, then exports a Hugging "
    "Face directory with a MODEL_CARD.md."
)


def _check_data_dir(path: str) -> None:
    """``--data`` must name an existing directory (a missing one would otherwise be taken for a Hub repository
    id by the tokenizer loader, with a message about repository names)."""
    if not Path(path).expanduser().is_dir():
        raise ValueError(f"--data: directory {path!r} does not exist: write one with "
                         f"'speculant train prepare --out {path}'")


_TRAIN_DOCS = {
    "data": "data directory written by 'speculant train prepare'",
    "out": "run directory (checkpoints, metrics; the model is exported to OUT/model); an existing run resumes",
    "preset": "model size: target (~32M parameters), draft (~3.9M), tiny (tests)",
    "steps": "optimizer steps",
    "batch_size": "sequences per step",
    "seq_len": "tokens per training sequence",
    "long_seq_len": "sequence length of the final context-extension phase",
    "long_fraction": "fraction of the steps (at the end) trained on long_seq_len windows, same tokens per step",
    "lr": "peak learning rate",
    "min_lr_ratio": "final learning rate as a fraction of the peak (cosine decay)",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient-norm clip",
    "seed": "initialisation and data-order seed",
    "ckpt_every": "save a resumable checkpoint every N steps",
    "eval_batches": "validation batches for the final loss",
    "device": "auto (a CUDA GPU if torch sees one, else the CPU), cpu, cuda, cuda:N or mps",
    "precision": "auto (bf16 on a GPU that supports it, else fp32), fp32 or bf16",
    "teacher": "model directory of the target to distil from (draft training)",
    "kd_weight": "weight of the distillation loss (the rest is cross-entropy)",
    "kd_loss": "distillation loss: fkl, tvd or tvd++",
    "threads": "torch CPU threads; default: left to torch",
    "init": "start from this model directory instead of a random initialisation (fine-tuning a drafter)",
    "train_split": "token stream to train on: train (the corpus) or a split made by 'train distill-data'",
}

_DISTILL_DATA_DOCS = {
    "data": "data directory written by 'speculant train prepare' (the result is written there as SPLIT.npy)",
    "teacher": "model directory of the target whose completions are collected",
    "split": "name of the split to write",
    "prompts": "number of training-split prompts (half signature + docstring, half random windows)",
    "max_new_tokens": "tokens the target generates per prompt",
    "min_prompt_tokens": "shortest prompt",
    "max_prompt_tokens": "longest prompt",
    "temperatures": "sampling temperatures cycled per batch, separated by '/' (0 = greedy)",
    "batch_size": "prompts generated together (left-padded)",
    "precision": "auto (bf16 on CPUs/GPUs with native bf16), fp32 or bf16; the teacher is re-run in training",
    "seed": "prompt choice and sampling seed",
    "threads": "torch CPU threads; default: left to torch",
}


_DRAFT_DOCS = {
    "target": "the target: a packaged name (e.g. smollm2-135m-instruct), model directory, .gguf file or Hub id",
    "out": "run directory (prompts, answers, checkpoints; the drafter lands in OUT/<loss>/draft); an existing run "
           "resumes",
    "prompts": "prompt sources, comma-separated: JSONL files (rows {\"messages\": [...]}, chat template applied, or "
               "{\"prompt\": \"...\"}) or built-in sets (e.g. builtin:sharegpt,builtin:code-chat-train: real "
               "users' first turns and coding requests, none from an evaluation set); default: the built-in "
               "instruction prompts",
    "num_prompts": "number of built-in prompts",
    "self_prompts": "more prompts written by the target itself (Magpie: its chat template up to a user's message, "
                    "sampled at temperature 1), appended to the others; chat targets only",
    "self_prompt_tokens": "at most this many tokens per self-written prompt",
    "prompt_seed": "seed of the built-in prompts",
    "max_prompt_tokens": "prompts longer than this are skipped",
    "max_new_tokens": "tokens the target writes per answer (at most)",
    "temperatures": "temperatures the target answers at, cycled per batch, separated by '/' (0 = greedy)",
    "gen_batch": "prompts answered together (transformers: one padded batch per shard; speculant: sequences "
                 "decoding at once, continuous batching, and prompts per shard)",
    "answer_batches": "answer only the first N batches (a random subset of the prompts; default: all)",
    "gen_dtype": "dtype the target answers in through transformers (speed only): float32 or bfloat16",
    "engine": "who answers: speculant (the batched engine over the target's deployed weights; the top-k and, "
              "for feature drafters, the target's states come out of the decoding forwards), transformers, or "
              "auto (speculant when the target loads quantized)",
    "answers": "target: the target writes its answers (Direct Alignment); dataset: it reads the prompts' own "
               "answers (builtin:sharegpt's replies) in one forward each, its top-k and states from that forward: "
               "several times the data rate on a CPU, on text the target did not write",
    "quantization": "the target's weights when speculant answers (none, int8, int4, q4, file, q8); default: the "
                    "packaged target's own (file for the 1.5B Qwen)",
    "topk": "target log-probabilities kept per answer token (the teacher)",
    "kind": "token: a token-level drafter; feature: a feature (EAGLE) drafter that also reads the target's final "
            "hidden states (exported to OUT/feature-<loss>/draft); eagle3: EAGLE-3 (Li et al. 2025), a feature "
            "drafter reading a low, a middle and a high layer (--taps default 2/L//2/L-3), trained with the "
            "training-time test over at least 3 draft depths (--unroll >= 3), no regression loss (exported to "
            "OUT/eagle3-<loss>/draft); confu: ConFu (Qin et al. 2026), EAGLE-3 plus a future vector the target "
            "computes for a contemplate token over a learned soft prompt, trained through the frozen target "
            "(--soft, --mixture, --window; --init may name an EAGLE-3 drafter to grow from; exported to "
            "OUT/confu-<loss>/draft); model: the draft model --draft names (e.g. a smaller sibling with the "
            "target's tokenizer, as Direct Alignment does) fine-tuned whole but for its embedding and LM head, "
            "exported in bfloat16 with its tokenizer to OUT/model-<loss>/draft, a directory --draft takes as it is",
    "train_last": "--kind model: fine-tune only the draft model's last N decoder layers and its final norm (a step "
                  "then costs the earlier layers' forward only); default: every layer",
    "draft": "--kind model: the draft model to fine-tune (a packaged name, directory or .gguf file whose tokenizer "
             "is the target's); default: none",
    "layers": "target layers the drafter starts from, separated by '/'",
    "taps": "feature drafters: target layers whose outputs they also read (EAGLE-3 style), separated by '/'",
    "regression": "feature drafters: weight of the hidden-state regression loss (EAGLE)",
    "unroll": "feature drafters: training passes (EAGLE-3's training-time test): pass d reads the drafter's own "
              "states and attends as its (d+1)-th draft token does",
    "loss": "distillation loss: fkl, tvd, tvd++, or none (export the untrained initialisation)",
    "steps": "optimizer steps",
    "batch_size": "answers per step",
    "lr": "peak learning rate (default: 0.002; 3e-5 for --kind model, a pretrained model fine-tuned whole)",
    "warmup": "linear warm-up steps",
    "precision": "drafter training precision: auto (bf16 autocast on CPUs with native bf16), fp32 or bf16",
    "keep": "VocabTrim set trained over and drafted from when sampling (most frequent answer tokens)",
    "validation_fraction": "answers held out for validation",
    "seed": "data order and sampling seed",
    "threads": "torch CPU threads; default: left to torch",
    "extra_data": "more run directories, comma-separated (same target; for feature kinds with states of the same "
                  "--taps), whose answers also train the drafter: training only, the run's own held-out answers "
                  "validate, and requests it holds out are left out of them (e.g. a --answers dataset run beside one "
                  "with the target's own answers); default: none",
    "init": "an exported drafter (RUN/<kind>-<loss>/draft, e.g. the one speculant ships for the target) to start "
            "from instead of the target's layers: same --kind, --taps and number of --layers; training continues it "
            "on this run's data (a fresh optimizer and schedule); default: none",
    "soft": "confu: soft-prompt key/value entries per target layer (only contemplate tokens see them)",
    "mixture": "confu: contemplate embeddings mixed by a router over the target's last state (1: one embedding)",
    "window": "confu: rows one contemplate token serves in training (future-prediction replication), and the "
              "spacing of the anchors sampled per answer",
    "store": "how the exported drafter's own matrices are stored: int8 (one scale per row, half of bf16) or q4 "
             "(4-bit codes with a float16 scale and minimum per 32 inputs, the q4 kernel's kind: under a third of "
             "bf16, e.g. to keep a 1.5B target's EAGLE-3 drafter within a package's size); a drafter's numerics "
             "change what it proposes, never what is emitted",
    "group_by_length": "each batch a random run of answers of similar length (a batch costs its longest: less "
                       "padding) instead of a uniform draw",
}


def _check_layers(target_dir, layers: list[int], taps: list[int]) -> None:
    """--layers and --taps must name layers of the target (read from its config, before any work)."""
    from transformers import AutoConfig

    n = getattr(AutoConfig.from_pretrained(str(target_dir), local_files_only=True), "num_hidden_layers", None)
    for name, values in (("layers", layers), ("taps", taps)):
        if n is not None and any(not 0 <= i < n for i in values):
            raise ValueError(f"--{name}: the target has layers 0..{n - 1}, got {'/'.join(map(str, values))}")
    if not layers:
        raise ValueError("--layers: at least one target layer to start the drafter from")


def _check_draft_prompts(args: argparse.Namespace) -> None:
    """``train draft`` must have prompts to answer: ``--prompts`` sources (files, built-in sets) with at least one, or ``--num-prompts``
    built-in ones (0 only with ``--self-prompts``); a one-line ValueError naming the option otherwise."""
    from ..data.prompts import load_prompts
    from ..train.drafter.answers_stage import has_answer

    dataset = getattr(args, "answers", "target") == "dataset"
    if args.prompts is not None:
        answered = False
        for source in args.prompts.split(","):
            if not source.startswith("builtin:") and not Path(source).is_file():
                raise ValueError(f"--prompts: file {source!r} does not exist")
            try:
                rows = load_prompts(source)
            except ValueError as exc:
                raise ValueError(f"--prompts: {exc}") from None
            answered = answered or any(has_answer(r) for r in rows)
        if dataset and not answered:
            raise ValueError("--answers dataset: none of the --prompts rows carries an \"answer\" (builtin:sharegpt's "
                             "do: the chat model's reply)")
        return
    if dataset:
        raise ValueError("--answers dataset reads the prompts' own answers: give --prompts whose rows carry one "
                         "(e.g. builtin:sharegpt)")
    if args.num_prompts < 0:
        raise ValueError(f"--num-prompts must be >= 0, got {args.num_prompts}")
    if args.num_prompts == 0 and args.self_prompts == 0:
        raise ValueError("--num-prompts 0: no prompts to answer; give --num-prompts N (N >= 1), a --prompts "
                         "file, or --self-prompts N (prompts the target writes)")


def _run_train_draft(args: argparse.Namespace) -> int:
    """``train draft``: answers, training and export, each resuming an interrupted run; prints the export."""
    import shlex

    from ..core.checks import check_positive_int
    from ..models.attached import EXPORT_STORAGES
    from ..models.loading import resolve_model
    from ..models.loading import check_quantization
    from ..train.drafter.answers_stage import run_answers, run_features
    from ..train.drafter.checks import (
        ANSWERS,
        ENGINES,
        FEATURE_KINDS,
        KINDS,
        DraftRunConfig,
        check_draft,
        check_extra_data,
        check_init,
        resolve_kind,
    )
    from ..train.drafter.run import run_training
    from ..train.drafter.card import write_drafter_card
    from ..train.losses import LOSSES

    if args.store not in EXPORT_STORAGES:
        raise ValueError(f"--store: unknown storage {args.store!r}; known: {', '.join(EXPORT_STORAGES)}")
    if args.loss not in (*LOSSES, "none"):
        raise ValueError(f"--loss: unknown loss {args.loss!r}; known: {', '.join(LOSSES)}, none")
    check_positive_int("steps", args.steps)
    check_positive_int("unroll", args.unroll)
    for name in ("soft", "mixture", "window"):
        check_positive_int(name, getattr(args, name))
    check_positive_int("self-prompt-tokens", args.self_prompt_tokens)
    if args.self_prompts < 0:
        raise ValueError(f"--self-prompts must be >= 0, got {args.self_prompts}")
    if args.kind not in KINDS:
        raise ValueError(f"--kind: unknown drafter kind {args.kind!r}; known: {', '.join(KINDS)}")
    if args.engine not in ENGINES:
        raise ValueError(f"--engine: unknown engine {args.engine!r}; known: {', '.join(ENGINES)}")
    if args.answers not in ANSWERS:
        raise ValueError(f"--answers: {args.answers!r} is not one of {', '.join(ANSWERS)}")
    check_quantization(args.quantization)
    _check_layers(resolve_model(args.target), args.layers, args.taps)  # a clear error before any work
    _check_draft_prompts(args)  # before the run directory is made: a refused run leaves nothing behind
    if args.data_only and args.train_only:
        raise ValueError("--data-only and --train-only exclude each other")
    cfg = resolve_kind(dataclass_from_args(DraftRunConfig, args))
    check_extra_data(cfg)  # before any work: the other runs must fit this one
    check_init(cfg)  # and the drafter to continue must be one this run trains
    if cfg.kind == "model":
        check_draft(cfg)  # and the model to fine-tune must draft the target's token ids
    if args.train_only:
        if not (Path(cfg.out) / "answers").is_dir():
            raise ValueError(f"--train-only: {cfg.out} has no answers yet (run without --train-only first)")
    else:
        run_answers(cfg)
        if cfg.kind in FEATURE_KINDS:
            run_features(cfg)
    if args.data_only:
        print(cfg.out)
        return 0
    export = run_training(cfg)
    command = "speculant train " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    write_drafter_card(cfg.out, export, command or f"speculant train draft {cfg}", name=args.name)
    print(export)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``speculant train``'s actions and their options on ``p``."""
    from ..train.bundled.distill_data import DistillDataConfig
    from ..train.drafter.checks import DraftRunConfig
    from ..train.bundled.pretrain import TrainConfig

    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=Parser)
    prep = sub.add_parser("prepare", help="build the corpus, train the tokenizer, tokenise the splits",
                          formatter_class=Formatter)
    prep.add_argument("--out", required=True, help="data directory to write")
    prep.add_argument("--vocab-size", type=int, default=16384, help="BPE vocabulary size (default: %(default)s)")
    model = sub.add_parser("model", help="pretrain (or distil) a model on a prepared data directory",
                           formatter_class=Formatter)
    add_dataclass_arguments(model, TrainConfig, skip={"extra"}, docs=_TRAIN_DOCS, deferred=_TEACHER_ONLY)
    model.add_argument("--name", default=None, help="model name for the model card (default: the preset)")
    calibrate = sub.add_parser("calibrate", help="VocabTrim: store a split's token frequencies with a draft model",
                               formatter_class=Formatter)
    calibrate.add_argument("--model", required=True, help="draft model directory (vocab_trim.json is written there)")
    calibrate.add_argument("--data", required=True, help="data directory written by 'speculant train prepare'")
    calibrate.add_argument("--split", default="distill",
                           help="calibration split, best the target's own text from 'train distill-data' "
                           "(default: %(default)s)")
    calibrate.add_argument("--default-size", type=positive_int, default=None,
                           help="kept tokens drafters use by default (default: none, the full head)")
    calibrate.add_argument("--default-size-sampling", type=nonnegative_int, default=None,
                           help="kept tokens drafters use by default when sampling (temperature > 0), where the "
                           "target's mass outside the kept set costs acceptance; 0 = the full head (default: "
                           "--default-size)")
    draft = sub.add_parser("draft", help="make a drafter for any target (HF directory, GGUF file, packaged name): "
                           "the target answers instruction prompts, a few of its layers learn those answers",
                           formatter_class=Formatter,
                           description=textwrap.fill(
                               "Direct Alignment (Goel et al. 2024) for any target: (1) instruction prompts "
                               "(built in, or --prompts FILE.jsonl with {\"messages\": [...]} or {\"prompt\": "
                               "...} rows), (2) the target's answers through its chat template with its top-k "
                               "distribution, (3) a drafter made of a few of the target's layers, sharing its "
                               "embedding and LM head, fine-tuned with --loss, (4) export to OUT/<loss>/draft "
                               "with vocab_trim.json and MODEL_CARD.md. Every stage resumes where an interrupted "
                               "run stopped.", width=100))
    add_dataclass_arguments(draft, DraftRunConfig, skip=set(), docs=_DRAFT_DOCS)
    draft.add_argument("--name", default=None, help="model name for the model card (default: the export folder)")
    draft.add_argument("--data-only", action="store_true", help="stop after the data stages (prompts, the target's "
                       "answers and, for feature drafters, its states) and print the run directory; a later run "
                       "without it trains")
    draft.add_argument("--train-only", action="store_true", help="skip the data stages: train on the answers (and "
                       "states) the run directory holds now, e.g. while another process is still answering")
    distill = sub.add_parser("distill-data", help="collect the target's completions of training prompts "
                             "(distillation data for a drafter)", formatter_class=Formatter)
    add_dataclass_arguments(distill, DistillDataConfig, skip=set(), docs=_DISTILL_DATA_DOCS)


# options of 'train model' that only matter when distilling from --teacher (refused without it)
_TEACHER_ONLY = frozenset({"kd_loss", "kd_weight"})
# options of 'train model' that count something: 0 would fail later (a division, a modulo) or train nothing
_TRAIN_COUNTS = ("steps", "batch_size", "seq_len", "long_seq_len", "ckpt_every", "eval_batches")


def _check_train_model(args: argparse.Namespace) -> None:
    """Refuse bad 'train model' options with one line, before any work (data, device, counts, distillation)."""
    from ..core.checks import check_positive_int, resolve_device
    from ..train.losses import LOSSES
    from ..train.bundled.pretrain import PRESETS

    resolve_device(args.device)
    _check_data_dir(args.data)
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    for name in _TRAIN_COUNTS:
        check_positive_int(option_name(name), getattr(args, name))
    given = [option_name(name) for name in sorted(_TEACHER_ONLY) if getattr(args, name) is not None]
    if given and not args.teacher:
        raise ValueError(f"{' and '.join(given)}: no effect without --teacher (they set the distillation from a "
                         "teacher model): add --teacher MODEL, or drop them")
    if args.kd_loss is not None and args.kd_loss not in LOSSES:
        raise ValueError(f"--kd-loss: unknown loss {args.kd_loss!r}; known: {', '.join(LOSSES)}")


def run(args: argparse.Namespace) -> int:
    """Run the chosen ``speculant train`` action; returns the exit code (bad input raises ValueError)."""
    import shlex

    from ..models.loading import check_model_dir, resolve_model
    from ..train.card import write_model_card
    from ..train.bundled.data import prepare
    from ..train.bundled.pretrain import TrainConfig

    if args.action == "prepare":
        out = prepare(args.out, vocab_size=args.vocab_size)
        print(out)
        return 0
    if args.action == "calibrate":
        from ..train.calibrate import write_calibration

        _check_data_dir(args.data)
        model_dir = check_model_dir(resolve_model(args.model))
        print(write_calibration(model_dir, args.data, args.split, args.default_size, args.default_size_sampling))
        return 0
    if args.action == "distill-data":
        from ..train.bundled.distill_data import DistillDataConfig, generate_distill_data

        _check_data_dir(args.data)
        args.teacher = str(check_model_dir(resolve_model(args.teacher)))
        print(generate_distill_data(dataclass_from_args(DistillDataConfig, args)))
        return 0
    if args.action == "draft":
        return _run_train_draft(args)
    _check_train_model(args)
    for role in ("teacher", "init"):  # bundled names (default-target, ...) or directories
        if getattr(args, role):
            setattr(args, role, str(check_model_dir(resolve_model(getattr(args, role)))))
    cfg = dataclass_from_args(TrainConfig, args)
    from ..train.bundled.pretrain import train

    export = train(cfg)
    command = "speculant train " + " ".join(shlex.quote(a) for a in sys.argv[2:] if a) if len(sys.argv) > 2 else ""
    write_model_card(cfg.out, export, args.name or cfg.preset, command or f"speculant train model {cfg}")
    print(export)
    return 0
