"""The ``speculant`` command line: ``speculant generate PROMPT --target DIR [--draft DIR --method SPEC ...]``.

Output conventions (``generate``):
  * stdout carries only the generated text, streamed as tokens are committed and followed by one newline; with
    ``--json`` it carries exactly one JSON object ``{"text", "token_ids", "stats"}`` and nothing else.
  * stderr carries the one-line statistics summary (not printed with ``--json``: the stats are in the JSON),
    library warnings, and errors.
  * Every bad input is one line ``speculant: error: <message>`` on stderr and exit code 2, never a traceback.

Subcommands are entries of :data:`COMMANDS` (name, one-line help, and a loader of the parts that need torch:
argument builder, runner, description), so ``bench``, ``kv-eval``, ``train`` and ``serve`` plug in the same way.
A subcommand's options are declared only when it is chosen, so ``speculant --help`` and ``speculant --version``
answer without importing torch. Defaults are read from the library (``generate``'s signature, the method
registry), never restated here. ``-v`` goes before or after the subcommand.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import logging
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from . import __version__

if TYPE_CHECKING:
    from .types import GenerationStats

__all__ = ["main", "build_parser", "default_model_dir", "COMMANDS", "Command", "Subcommand"]

PROG = "speculant"
log = logging.getLogger(__name__)

EXIT_BROKEN_PIPE = 141
"""Exit code when stdout's reader went away (``speculant ... | head``): 128 + SIGPIPE, as a shell reports it."""


@functools.cache
def _gen_defaults() -> dict[str, Any]:
    """generate()'s defaults: the single definition of max_new_tokens, temperature, top_k, top_p, seed, kv_block."""
    from .engine import generate

    return {name: p.default for name, p in inspect.signature(generate).parameters.items()}


def default_model_dir(role: str) -> Path | None:
    """The bundled default model directory for ``role`` (``"target"`` or ``"draft"``), or None when this
    installation ships none (then ``--target`` is required)."""
    from .loading import bundled_dir

    return bundled_dir(f"default-{role}")


class _UsageError(Exception):
    """A command-line mistake: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line (argparse prints usage plus an error by default)."""

    def error(self, message: str):
        raise _UsageError(f"{message} (see '{self.prog} --help')")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)


@dataclass(frozen=True)
class Subcommand:
    """What a subcommand needs torch for: ``add_arguments(parser)`` declares its options, ``run(args)`` returns
    the exit code and may raise ValueError for bad input; ``description`` and ``epilog`` are its help texts."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""
    epilog: str = ""


@dataclass(frozen=True)
class Command:
    """One subcommand: ``help`` is its line in ``speculant --help``; ``load()`` imports and returns the rest
    (:class:`Subcommand`), called only when the subcommand is chosen."""

    name: str
    help: str
    load: Callable[[], Subcommand]


def _module_command(module: str) -> Callable[[], Subcommand]:
    """A loader for a subcommand defined by a module with ``add_arguments``, ``run``, ``DESCRIPTION`` and
    optionally ``epilog()`` (``speculant.bench.cli``, ``speculant.kv.cli``)."""

    def load() -> Subcommand:
        m = importlib.import_module(module)
        epilog = getattr(m, "epilog", None)
        return Subcommand(m.add_arguments, m.run, m.DESCRIPTION, epilog() if epilog is not None else "")

    return load


# ---------------------------------------------------------------------------------------------- generate


def _int_at_least(minimum: int):
    """An argparse type for integers >= ``minimum``, with a one-line error."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    convert.__name__ = "int"
    return convert


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _methods_with_k() -> str:
    from .drafters.registry import NO_DEFAULT, methods

    return ", ".join(
        f"{m.name}: {m.keys['k'].default}" if m.keys["k"].default is not NO_DEFAULT else m.name
        for m in methods().values()
        if "k" in m.keys
    )


def _add_device_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--device``, shared by the subcommands that run models (checked by :func:`speculant.checks.resolve_device`)."""
    p.add_argument(
        "--device",
        metavar="DEVICE",
        default=None,
        help=f"run {what} on this device: cpu, cuda, cuda:N or mps; default: the best available (cuda if torch "
        "sees a GPU, else mps, else cpu)",
    )


def _set_threads(threads: int | None) -> None:
    """``--threads``: torch CPU threads, left to torch when not given."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    from .drafters.registry import DEFAULT_METHOD
    from .loading import DTYPES
    from .sources import PACKAGED

    target_default = default_model_dir("target")
    d = _gen_defaults()
    p.add_argument(
        "prompt",
        metavar="PROMPT",
        help="the message, or '-' to read it from stdin. When the target's tokenizer has a chat template "
        "(instruct models), it is sent as the user's turn through that template and generation stops at the "
        "template's end-of-turn token; with --raw, or for a tokenizer without a template, it is plain text "
        "tokenized with the tokenizer's defaults (e.g. a BOS token)",
    )
    p.add_argument(
        "--system",
        metavar="TEXT",
        default=None,
        help="a system message put before PROMPT in the chat template (not with --raw)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="treat PROMPT as plain text to continue, even when the tokenizer has a chat template",
    )
    p.add_argument(
        "--target",
        metavar="MODEL",
        required=target_default is None,
        default=target_default,
        help="target model: a packaged model name (" + ", ".join(PACKAGED) + "), a bundled name (default-target), "
        "a model directory (save_pretrained output), a .gguf file (converted once into a cache, see README) or "
        "a Hugging Face Hub id already in the local HF cache; "
        + ("required" if target_default is None else "default: the bundled default-target"),
    )
    p.add_argument(
        "--draft",
        metavar="MODEL",
        default=None,
        help="draft model, same tokenizer as the target: a directory, a bundled name, or an attached drafter "
        "(sharing the target's embedding); needed by methods that draft with a model (chain, trees); default: "
        "the drafter speculant ships for the target (default-target: default-draft; smollm2-135m-instruct: "
        "smollm2-135m-instruct-draft), else none",
    )
    p.add_argument(
        "--method",
        metavar="SPEC",
        default=DEFAULT_METHOD,
        help="drafting method: NAME or NAME:key=value[:key=value...] (list values separated by '/'), e.g. ar, "
        "chain, chain:k=8; the methods are listed below; default: %(default)s",
    )
    p.add_argument(
        "--k",
        type=int,
        default=None,
        help="draft tokens per step; overrides the k of --method (default: the method's own, "
        + _methods_with_k()
        + ")",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        default=d["max_new_tokens"],
        help="at most this many new tokens (fewer if an end-of-sequence token comes first); default: %(default)s",
    )
    p.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        default=d["temperature"],
        help="sampling temperature, 0 for greedy decoding; the output distribution is exactly the target's "
        "(lossless); default: %(default)s",
    )
    p.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        default=d["top_k"],
        help="sample among the K most likely tokens only (applied to target and draft alike); default: no top-k "
        "filter",
    )
    p.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        default=d["top_p"],
        help="nucleus sampling: keep the most likely tokens up to probability mass P, 0 < P <= 1; default: no "
        "top-p filter",
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="S",
        default=d["seed"],
        help="random seed for reproducible sampling; default: none (different samples on every run)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default=None,
        help="load the models in this dtype ('auto': the one in config.json); default: float32 (exact: greedy "
        "output token-identical to plain greedy decoding). bfloat16 is faster on CPUs with native bf16 "
        "(benchmarks/results/forward_cost.json) but can round near-ties differently between a verification "
        "forward and a one-token forward",
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        default=None,
        help="torch CPU threads (torch.set_num_threads); default: left to torch",
    )
    _add_device_argument(p, "the target and draft models")
    p.add_argument(
        "--kv-policy",
        metavar="POLICY",
        default=None,
        help="evict the target's KV cache with this policy (keydiff, streaming, h2o, tova, snapkv, knorm, random, "
        "wrappers caote:/fastcaote:/protect:, e.g. caote:h2o); needs --kv-budget",
    )
    p.add_argument(
        "--kv-budget",
        type=_positive_int,
        metavar="N",
        default=None,
        help="keep at most N tokens per layer in the target's KV cache (block-wise prefill, then eviction after "
        "each verified step); needs --kv-policy",
    )
    p.add_argument(
        "--kv-block",
        type=_positive_int,
        metavar="B",
        default=None,  # None: not given (generate()'s default applies; given without eviction it is a no-op)
        help=f"prefill block size with --kv-budget (peak KV: N + B tokens per layer); default: {d['kv_block']}",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object {text, token_ids, stats} to stdout instead of streaming the text and "
        "a summary",
    )


class _TextStream:
    """Incremental detokenisation: decode every new id so far and write only the new suffix, holding back a
    trailing U+FFFD (an incomplete multi-byte character whose remaining bytes are in the next tokens)."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.written = ""

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _write_upto(self, text: str) -> None:
        if not text.startswith(self.written):  # decoding changed written text (rare, tokenizer-specific)
            log.debug("detokenisation changed already written text; continuing after it")
        piece = text[len(self.written) :]
        if piece:
            self.out.write(piece)
            self.out.flush()
            self.written = text

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        self._write_upto(self._text().rstrip("\ufffd"))

    def finish(self) -> str:
        """Write what was held back (an invalid trailing byte sequence stays U+FFFD) and the final newline."""
        text = self._text()
        self._write_upto(text)
        self.out.write("\n")
        self.out.flush()
        return text


def _summary(method: str, stats: GenerationStats) -> str:
    return (
        f"{PROG}: method={method} τ={stats.acceptance_length:.2f} tokens={stats.new_tokens} "
        f"tokens/s={stats.tokens_per_second:.1f} target_calls={stats.target_calls} "
        f"overhead={100 * stats.overhead_share:.1f}%"
    )


def _run_generate(args: argparse.Namespace) -> int:
    import torch

    from .attached import is_attached
    from .chat import chat_ids, has_chat_template, stop_ids
    from .checks import check_positive_int, resolve_device
    from .drafters.registry import build_drafter, get_method, parse_method
    from .engine import generate
    from .loading import (
        check_model_dir,
        default_draft_for,
        load_draft,
        load_model_dir,
        load_tokenizer,
        resolve_model,
        tokenizers_match,
    )
    from .types import SamplingParams

    # validate everything cheap before loading any model
    name, options = parse_method(args.method)
    if (args.kv_policy is None) != (args.kv_budget is None):
        raise ValueError("--kv-policy and --kv-budget go together (e.g. --kv-policy keydiff --kv-budget 256)")
    if args.kv_policy is not None:
        from .kv import parse_policy

        parse_policy(args.kv_policy)
    elif args.kv_block is not None:
        log.warning("--kv-block has no effect without eviction (--kv-policy and --kv-budget)")
    method = get_method(name)
    if args.k is not None:
        if "k" not in method.keys:
            raise ValueError(f"--k: method {name!r} takes no k (methods with k: {_methods_with_k()})")
        options["k"] = args.k
    if args.raw and args.system is not None:
        raise ValueError("--system needs the chat template: drop --raw")
    if method.needs_draft and args.draft is None:
        args.draft = default_draft_for(args.target)
    if method.needs_draft and args.draft is None:
        raise ValueError(f"method {name!r} needs a draft model: pass --draft DIR (or --method ar for plain decoding)")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    check_positive_int("max_new_tokens", args.max_new_tokens)
    device = resolve_device(args.device)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise ValueError("the prompt is empty: give some text")
    args.target = check_model_dir(resolve_model(args.target))
    if method.needs_draft:
        args.draft = check_model_dir(resolve_model(args.draft))
    _set_threads(args.threads)

    dtype = args.dtype if args.dtype is not None else torch.float32
    target, tokenizer = load_model_dir(args.target, dtype)
    target.to(device)
    draft_model, context = None, {}
    if method.needs_draft:
        draft_model = load_draft(args.draft, target, dtype).to(device)
        if not is_attached(args.draft):
            context["tokenizers_match"] = tokenizers_match(tokenizer, load_tokenizer(args.draft))
    drafter = build_drafter((name, options), draft_model, **context)
    if args.draft is not None and not method.needs_draft:
        if drafter is None:  # plain decoding: passing --draft to switch methods back and forth is fine
            log.info("method %r drafts nothing: --draft is not used", name)
        else:
            log.warning("method %r drafts without a model: --draft is not used", name)

    chat = has_chat_template(tokenizer) and not args.raw
    if args.system is not None and not chat:
        raise ValueError("--system: the target's tokenizer has no chat template")
    ids = chat_ids(tokenizer, prompt, system=args.system) if chat else tokenizer(prompt)["input_ids"]
    stream = None if args.json else _TextStream(tokenizer, sys.stdout)
    kv_block = {} if args.kv_block is None else {"kv_block": args.kv_block}
    gen = generate(
        target,
        ids,
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=stop_ids(tokenizer, target) if chat else None,
        stream=stream,
        kv_policy=args.kv_policy,
        kv_budget=args.kv_budget,
        **kv_block,
    )
    if args.json:
        text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        print(json.dumps({"text": text, "token_ids": gen.token_ids, "stats": gen.stats.as_dict()}))
    else:
        stream.finish()
        spec = name + "".join(f":{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in options.items())
        print(_summary(spec, gen.stats), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- train


def _slash_list(item: type):
    """An argparse type for ``a/b/c`` lists of ``item``."""

    def convert(text: str) -> list:
        try:
            return [item(part) for part in text.split("/") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {item.__name__} values separated by '/', got {text!r}")

    convert.__name__ = f"{item.__name__} list"
    return convert


def _option(field: str) -> str:
    """The command-line spelling of a dataclass field: ``kd_loss`` -> ``--kd-loss``."""
    return "--" + field.replace("_", "-")


def _add_dataclass_arguments(
    p: argparse.ArgumentParser, cls, skip: set[str], docs: dict[str, str], deferred: frozenset[str] = frozenset()
) -> None:
    """One ``--field-name`` option per dataclass field; the dataclass holds the defaults (not restated).

    ``deferred`` fields default to None on the command line (the help still shows the dataclass default), so the
    runner can tell an option given explicitly from one left out; :func:`_dataclass_from_args` then applies the
    dataclass default."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        hint = hints[f.name]
        if typing.get_origin(hint) is list:  # list[float] etc.: values separated by "/", as in method specs
            (item,) = typing.get_args(hint)
            kind = _slash_list(item)
            default = "/".join(str(v) for v in default) if default is not None else None
        else:
            types = [t for t in (typing.get_args(hint) or (hint,)) if t is not type(None)]
            kind = types[0] if types and types[0] in (int, float) else str
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        p.add_argument(
            _option(f.name),
            type=kind,
            default=None if f.name in deferred else default,
            required=required,
            help=docs.get(f.name, "") + ("" if required else f" (default: {default})".replace("%", "%%")),
        )


def _dataclass_from_args(cls, args: argparse.Namespace):
    """``cls(**options)`` from the parsed options named like its fields; an option left at None whose field has
    another default (a deferred option that was not given) is left out, so the dataclass default applies."""
    import dataclasses

    kwargs = {}
    for f in dataclasses.fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is None and f.default is not None:
            continue
        kwargs[f.name] = value
    return cls(**kwargs)


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
    "threads": "torch CPU threads",
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
    "threads": "torch CPU threads",
}


_DRAFT_DOCS = {
    "target": "the target: a packaged name (e.g. smollm2-135m-instruct), model directory, .gguf file or Hub id",
    "out": "run directory (prompts, answers, checkpoints; the drafter lands in OUT/<loss>/draft); an existing run "
           "resumes",
    "prompts": "JSONL prompts file, rows {\"messages\": [...]} (chat template applied) or {\"prompt\": \"...\"}; "
               "default: the built-in instruction prompts",
    "num_prompts": "number of built-in prompts",
    "prompt_seed": "seed of the built-in prompts",
    "max_prompt_tokens": "prompts longer than this are skipped",
    "max_new_tokens": "tokens the target writes per answer (at most)",
    "temperatures": "temperatures the target answers at, cycled per batch, separated by '/' (0 = greedy)",
    "gen_batch": "prompts answered together",
    "answer_batches": "answer only the first N batches (a random subset of the prompts; default: all)",
    "gen_dtype": "dtype the target answers in (speed only): float32 or bfloat16",
    "topk": "target log-probabilities kept per answer token (the teacher)",
    "layers": "target layers the drafter starts from, separated by '/'",
    "loss": "distillation loss: tvd++, tvd, fkl, or none (export the untrained initialisation)",
    "steps": "optimizer steps",
    "batch_size": "answers per step",
    "lr": "peak learning rate",
    "warmup": "linear warm-up steps",
    "precision": "drafter training precision: auto (bf16 autocast on CPUs with native bf16), fp32 or bf16",
    "keep": "VocabTrim set trained over and drafted from when sampling (most frequent answer tokens)",
    "validation_fraction": "answers held out for validation",
    "seed": "data order and sampling seed",
    "threads": "torch CPU threads",
}


def _run_train_draft(args: argparse.Namespace) -> int:
    import shlex

    from .checks import check_positive_int
    from .loading import resolve_model
    from .train.draft import DraftRunConfig, run_answers, run_training
    from .train.drafter_card import write_drafter_card
    from .train.losses import LOSSES

    if args.loss not in (*LOSSES, "none"):
        raise ValueError(f"--loss: unknown loss {args.loss!r}; known: {', '.join(LOSSES)}, none")
    check_positive_int("steps", args.steps)
    resolve_model(args.target)  # a clear error before any work
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise ValueError(f"--prompts: file {args.prompts!r} does not exist")
    cfg = _dataclass_from_args(DraftRunConfig, args)
    run_answers(cfg)
    export = run_training(cfg)
    command = "speculant train " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    write_drafter_card(cfg.out, export, command or f"speculant train draft {cfg}", name=args.name)
    print(export)
    return 0


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from .train.distill_data import DistillDataConfig
    from .train.draft import DraftRunConfig
    from .train.pretrain import TrainConfig

    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    prep = sub.add_parser("prepare", help="build the corpus, train the tokenizer, tokenise the splits",
                          formatter_class=_Formatter)
    prep.add_argument("--out", required=True, help="data directory to write")
    prep.add_argument("--vocab-size", type=int, default=16384, help="BPE vocabulary size (default: %(default)s)")
    model = sub.add_parser("model", help="pretrain (or distil) a model on a prepared data directory",
                           formatter_class=_Formatter)
    _add_dataclass_arguments(model, TrainConfig, skip={"extra"}, docs=_TRAIN_DOCS, deferred=_TEACHER_ONLY)
    model.add_argument("--name", default=None, help="model name for the model card (default: the preset)")
    calibrate = sub.add_parser("calibrate", help="VocabTrim: store a split's token frequencies with a draft model",
                               formatter_class=_Formatter)
    calibrate.add_argument("--model", required=True, help="draft model directory (vocab_trim.json is written there)")
    calibrate.add_argument("--data", required=True, help="data directory written by 'speculant train prepare'")
    calibrate.add_argument("--split", default="distill",
                           help="calibration split, best the target's own text from 'train distill-data' "
                           "(default: %(default)s)")
    calibrate.add_argument("--default-size", type=_positive_int, default=None,
                           help="kept tokens drafters use by default (default: none, the full head)")
    calibrate.add_argument("--default-size-sampling", type=_nonnegative_int, default=None,
                           help="kept tokens drafters use by default when sampling (temperature > 0), where the "
                           "target's mass outside the kept set costs acceptance; 0 = the full head (default: "
                           "--default-size)")
    draft = sub.add_parser("draft", help="make a drafter for any target (HF directory, GGUF file, packaged name): "
                           "the target answers instruction prompts, a few of its layers learn those answers",
                           formatter_class=_Formatter,
                           description=textwrap.fill(
                               "Direct Alignment (Goel et al. 2024) for any target: (1) instruction prompts "
                               "(built in, or --prompts FILE.jsonl with {\"messages\": [...]} or {\"prompt\": "
                               "...} rows), (2) the target's answers through its chat template with its top-k "
                               "distribution, (3) a drafter made of a few of the target's layers, sharing its "
                               "embedding and LM head, fine-tuned with --loss, (4) export to OUT/<loss>/draft "
                               "with vocab_trim.json and MODEL_CARD.md. Every stage resumes where an interrupted "
                               "run stopped.", width=100))
    _add_dataclass_arguments(draft, DraftRunConfig, skip=set(), docs=_DRAFT_DOCS)
    draft.add_argument("--name", default=None, help="model name for the model card (default: the export folder)")
    distill = sub.add_parser("distill-data", help="collect the target's completions of training prompts "
                             "(distillation data for a drafter)", formatter_class=_Formatter)
    _add_dataclass_arguments(distill, DistillDataConfig, skip=set(), docs=_DISTILL_DATA_DOCS)


# options of 'train model' that only matter when distilling from --teacher (refused without it)
_TEACHER_ONLY = frozenset({"kd_loss", "kd_weight"})
# options of 'train model' that count something: 0 would fail later (a division, a modulo) or train nothing
_TRAIN_COUNTS = ("steps", "batch_size", "seq_len", "long_seq_len", "ckpt_every", "eval_batches")


def _check_train_model(args: argparse.Namespace) -> None:
    """Refuse bad 'train model' options with one line, before any work (data, device, counts, distillation)."""
    from .checks import check_positive_int, resolve_device
    from .train.losses import LOSSES
    from .train.pretrain import PRESETS

    resolve_device(args.device)
    _check_data_dir(args.data)
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    for name in _TRAIN_COUNTS:
        check_positive_int(_option(name), getattr(args, name))
    given = [_option(name) for name in sorted(_TEACHER_ONLY) if getattr(args, name) is not None]
    if given and not args.teacher:
        raise ValueError(f"{' and '.join(given)}: no effect without --teacher (they set the distillation from a "
                         "teacher model): add --teacher MODEL, or drop them")
    if args.kd_loss is not None and args.kd_loss not in LOSSES:
        raise ValueError(f"--kd-loss: unknown loss {args.kd_loss!r}; known: {', '.join(LOSSES)}")


def _run_train(args: argparse.Namespace) -> int:
    import shlex

    from .loading import check_model_dir, resolve_model
    from .train.card import write_model_card
    from .train.data import prepare
    from .train.pretrain import TrainConfig

    if args.action == "prepare":
        out = prepare(args.out, vocab_size=args.vocab_size)
        print(out)
        return 0
    if args.action == "calibrate":
        from .train.calibrate import write_calibration

        _check_data_dir(args.data)
        model_dir = check_model_dir(resolve_model(args.model))
        print(write_calibration(model_dir, args.data, args.split, args.default_size, args.default_size_sampling))
        return 0
    if args.action == "distill-data":
        from .train.distill_data import DistillDataConfig, generate_distill_data

        _check_data_dir(args.data)
        args.teacher = str(check_model_dir(resolve_model(args.teacher)))
        print(generate_distill_data(_dataclass_from_args(DistillDataConfig, args)))
        return 0
    if args.action == "draft":
        return _run_train_draft(args)
    _check_train_model(args)
    for role in ("teacher", "init"):  # bundled names (default-target, ...) or directories
        if getattr(args, role):
            setattr(args, role, str(check_model_dir(resolve_model(getattr(args, role)))))
    cfg = _dataclass_from_args(TrainConfig, args)
    from .train.pretrain import train

    export = train(cfg)
    command = "speculant train " + " ".join(shlex.quote(a) for a in sys.argv[2:] if a) if len(sys.argv) > 2 else ""
    write_model_card(cfg.out, export, args.name or cfg.preset, command or f"speculant train model {cfg}")
    print(export)
    return 0


def _generate_command() -> Subcommand:
    from .drafters.registry import describe_methods

    return Subcommand(
        _add_generate_arguments,
        _run_generate,
        description="Generate a continuation of PROMPT with the target model, losslessly accelerated by the "
        "drafting method. The text streams to stdout; a one-line summary (τ = tokens per target call, tokens, "
        "tokens/s, target calls, engine overhead share) goes to stderr. Generated text is shown with special "
        "tokens removed; --json gives the raw token ids.",
        epilog="methods:\n" + describe_methods(),
    )


def _train_command() -> Subcommand:
    return Subcommand(
        _add_train_arguments,
        _run_train,
        description="Training pipeline. 'prepare' builds the corpus (this interpreter's standard library and "
        "pydoc topics, split by module), trains the byte-level BPE tokenizer and tokenises the splits; 'model' "
        "pretrains a Llama model (optionally distilling from a teacher), with a progress bar and resumable "
        "checkpoints, then exports a Hugging Face directory with a MODEL_CARD.md.",
    )


COMMANDS: list[Command] = [
    Command("generate", "generate text from a prompt with speculative decoding", _generate_command),
    Command("train", "train the bundled models: prepare the data, then pretrain or distil a model", _train_command),
    Command("bench", "benchmark drafting methods against plain decoding and transformers' generate",
            _module_command("speculant.bench.cli")),
    Command("kv-eval", "evaluate KV-cache eviction policies under a memory budget", _module_command("speculant.kv.cli")),
]


# ---------------------------------------------------------------------------------------------- entry point

_VERBOSE_HELP = "log progress (INFO) to stderr"


def _add_verbose_option(p: argparse.ArgumentParser) -> None:
    """``-v`` on a subcommand's parser and on its own subcommands' (``train model ... -v``). SUPPRESS: when not
    given there, the value of a ``-v`` before the subcommand stays."""
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _add_verbose_option(child)


def _declare(p: argparse.ArgumentParser, cmd: Command) -> None:
    """Give ``p`` the options and help texts of ``cmd`` (imports what the subcommand needs)."""
    parts = cmd.load()
    p.description = textwrap.fill(parts.description or cmd.help, width=100)
    p.epilog = parts.epilog or None
    parts.add_arguments(p)
    _add_verbose_option(p)
    p.set_defaults(run=parts.run)


class _LazySubcommands(argparse._SubParsersAction):
    """Subcommand dispatch that declares a subcommand's options when it is chosen, not when the parser is built:
    ``speculant --help`` and ``--version`` then run without importing torch (the options of ``generate``, ``bench``
    ... are read from the library, which needs it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, Command] = {}

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        cmd = self.pending.pop(values[0], None) if values else None
        if cmd is not None:
            _declare(self.choices[cmd.name], cmd)
        super().__call__(parser, namespace, values, option_string)


def build_parser(eager: bool = False) -> argparse.ArgumentParser:
    """The argument parser with one subparser per entry of :data:`COMMANDS`. A subcommand's options are declared
    when parsing reaches it; ``eager=True`` declares every subcommand's up front (imports torch)."""
    parser = _Parser(
        prog=PROG,
        formatter_class=_Formatter,
        description="Lossless speculative decoding for Hugging Face causal LMs on one machine.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP + " (also after the COMMAND)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, action=_LazySubcommands)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, formatter_class=_Formatter)
        if eager:
            _declare(p, cmd)
        else:
            sub.pending[cmd.name] = cmd
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (tests and wrappers swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _configure_logging(verbose: bool) -> None:
    """Show the library's warnings (INFO with ``-v``) on stderr as ``speculant: LEVEL: message``."""
    logger = logging.getLogger("speculant")
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _stdout_to_devnull() -> None:
    """After a broken pipe: point stdout's file descriptor at /dev/null, so that the flush at interpreter exit
    does not fail again (the recipe of the Python docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout replaced by an object without a file descriptor
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``speculant`` command line; returns the exit code (0 ok, 2 bad input, 130 interrupted,
    141 stdout closed by its reader, e.g. ``speculant generate ... | head``)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, so that a reader gone away is noticed now, not at interpreter exit
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except _UsageError as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    _configure_logging(args.verbose)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # stderr holds the summary or one error line, not loading bars
    try:
        return args.run(args)
    except BrokenPipeError:
        raise
    except (ValueError, OSError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        if bars:
            hf_logging.enable_progress_bar()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
