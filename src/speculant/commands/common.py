"""What the ``speculant`` subcommands share: the one-line-error parser, the help formatter, the subcommand
descriptors (:class:`Command`, :class:`Subcommand`), option types, the model options (:func:`add_model_arguments`:
``--target/--draft/--method/--dtype/--quantization/--device/--threads/--kv-*``, declared once with one help text each, read back
by :func:`session_arguments` for :func:`speculant.plan.resolve`), and options declared from a dataclass's fields.

Light on purpose: :mod:`speculant.cli` imports this module to build ``speculant --help``, which must not import
torch, so every heavy import here is inside the function that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PROG",
    "Command",
    "Formatter",
    "Parser",
    "Subcommand",
    "UsageError",
    "add_dataclass_arguments",
    "add_device_argument",
    "add_model_arguments",
    "add_threads_argument",
    "dataclass_defaults",
    "dataclass_from_args",
    "default_model_dir",
    "int_at_least",
    "module_command",
    "nonnegative_int",
    "option_name",
    "positive_int",
    "positive_int_list",
    "session_arguments",
    "set_threads",
    "threads_option",
]

PROG = "speculant"


def default_model_dir(role: str) -> Path | None:
    """The bundled default model directory for ``role`` (``"target"`` or ``"draft"``), or None when this
    installation ships none (then ``--target`` is required)."""
    from ..models.loading import bundled_dir

    return bundled_dir(f"default-{role}")


# ---------------------------------------------------------------------------------------------- parsers


class UsageError(Exception):
    """A command-line mistake: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line (argparse prints usage plus an error by default)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def _print_message(self, message: str, file=None) -> None:
        """As argparse's, but a reader gone away is not swallowed: argparse ignores ``OSError`` here, so a help text
        longer than stdout's buffer (``speculant kv-eval --help | head -0``) ended 0 where a shorter one, failing at
        the final flush, ends 141; the command line turns ``BrokenPipeError`` into 141 either way."""
        if message:
            (file or sys.stderr).write(message)


class Formatter(argparse.RawDescriptionHelpFormatter):
    """The help layout of every ``speculant`` parser: descriptions kept as written, option names in 30 columns."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)


# ---------------------------------------------------------------------------------------------- descriptors


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


def module_command(module: str) -> Callable[[], Subcommand]:
    """A loader for a subcommand defined by a module with ``add_arguments``, ``run``, ``DESCRIPTION`` and
    optionally ``epilog()`` (``speculant.commands.generate``, ``speculant.commands.bench`` ...)."""

    def load() -> Subcommand:
        m = importlib.import_module(module)
        epilog = getattr(m, "epilog", None)
        return Subcommand(m.add_arguments, m.run, m.DESCRIPTION, epilog() if epilog is not None else "")

    return load


# ---------------------------------------------------------------------------------------------- option types


def int_at_least(minimum: int) -> Callable[[str], int]:
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


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def threads_option(text: str) -> int | str:
    """An argparse type for ``--threads``: ``auto`` or an integer >= 1, with a one-line error."""
    from ..core.threads import AUTO

    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {value}")
    return value


def dataclass_defaults(cls) -> dict:
    """``{field: default}`` of a settings dataclass (the defaults a command's options show)."""
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(cls)}


def positive_int_list(text: str) -> list[int]:
    """An argparse type: ``"8,16"`` -> ``[8, 16]`` (each >= 1), with a one-line error."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _slash_list(item: type) -> Callable[[str], list]:
    """An argparse type for ``a/b/c`` lists of ``item``."""

    def convert(text: str) -> list:
        try:
            return [item(part) for part in text.split("/") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {item.__name__} values separated by '/', got {text!r}")

    convert.__name__ = f"{item.__name__} list"
    return convert


# ---------------------------------------------------------------------------------------------- shared options


def add_device_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--device``, shared by the subcommands that run models (checked by :func:`speculant.core.checks.resolve_device`)."""
    p.add_argument(
        "--device",
        metavar="DEVICE",
        default=None,
        help=f"run {what} on this device: cpu, cuda, cuda:N or mps; default: the best available (cuda if torch "
        "sees a GPU, else mps, else cpu)",
    )


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads``, shared by the subcommands that run models (applied by :func:`set_threads`)."""
    from ..core.threads import AUTO, DEFAULT_SPIN, SPIN_VAR, WAIT_POLICY_VAR

    p.add_argument("--threads", type=threads_option, metavar="N", default=AUTO,
                   help="torch CPU threads (torch.set_num_threads): N, or auto: the cores free when the model loads "
                   "(the usable cores minus those other processes keep busy, at least 1; OMP_NUM_THREADS, if set, "
                   "is kept), said with -v; default: auto. The command also sets "
                   f"{SPIN_VAR}={DEFAULT_SPIN} unless the environment sets it or {WAIT_POLICY_VAR} (idle threads "
                   "spin briefly, then sleep; set OMP_WAIT_POLICY=PASSIVE on a machine shared with other work)")


def _packaged_methods() -> str:
    """``name: method`` for each packaged model with a default method (for the help of ``--method``)."""
    from ..models.sources import PACKAGED

    return ", ".join(f"{m.name}: {m.default_method}" for m in PACKAGED.values() if m.default_method)


_BUNDLED = object()


def add_model_arguments(
    p: argparse.ArgumentParser,
    *,
    draft: bool = True,
    method: bool = True,
    kv: bool = True,
    target_default: Any = _BUNDLED,
    target_note: str | None = None,
) -> None:
    """The model options every subcommand that runs models shares, each declared here once with one help text:
    ``--target``, ``--draft`` (unless ``draft`` is False), ``--method`` (unless ``method`` is False: e.g. bench
    takes several with ``--methods``), ``--dtype``, ``--quantization``, ``--threads``, ``--device`` and ``--kv-policy/--kv-budget/
    --kv-block`` (unless ``kv`` is False). ``--target`` defaults to the bundled default-target when this
    installation ships it (else it is required), or to ``target_default`` with ``target_note`` as its help."""
    from ..drafters.registry import DEFAULT_METHOD
    from ..models.loading import DTYPES
    from ..models.sources import PACKAGED

    required = False
    if target_default is _BUNDLED:
        required = default_model_dir("target") is None
        target_default = None if required else "default-target"
        target_note = "required" if required else "default: the bundled default-target"
    p.add_argument(
        "--target",
        metavar="MODEL",
        required=required,
        default=target_default,
        help="target model: a packaged model name (" + ", ".join(PACKAGED) + "), a bundled name (default-target), "
        "a model directory (save_pretrained output), a .gguf file (converted once into a cache, see docs/models.md) or "
        f"a Hugging Face Hub id already in the local HF cache; {target_note}",
    )
    if draft:
        p.add_argument(
            "--draft",
            metavar="MODEL",
            default=None,
            help="draft model, same tokenizer as the target: a directory, a bundled name, or an attached drafter "
            "(sharing the target's embedding); needed by methods that draft with a model (chain, trees); default: "
            "the drafter speculant ships for the target (default-target: default-draft; smollm2-135m-instruct: "
            "smollm2-135m-instruct-draft), else none, and a method that needs one stops with an error",
        )
    if method:
        p.add_argument(
            "--method",
            metavar="SPEC",
            default=None,
            help="drafting method: NAME or NAME:key=value[:key=value...] (list values separated by '/'), e.g. ar, "
            "chain, chain:k=8; the methods are listed below; default: the method measured fastest for a packaged "
            "target with its shipped drafter (" + _packaged_methods() + f"), else {DEFAULT_METHOD}",
        )
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default=None,
        help="load the models in this dtype ('auto': the one in config.json; an attached drafter takes the "
        "target's); default: float32 (exact: greedy output token-identical to plain greedy decoding). bfloat16 "
        "is faster on CPUs with native bf16 but, with float weights, can "
        "round near-ties differently between a verification forward and a one-token forward; with quantized "
        "weights (--quantization int8/int4/q4) the forward is row independent and every dtype is exact",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "int8", "int4", "q4", "file", "q8"],  # speculant.core.quant.QUANTIZATIONS (not imported: no torch)
        default=None,
        help="weight quantization of the models loaded by name (the draft takes the target's kind): none (the "
        "float weights); int8 (per-row int8 weights, torch's int8 kernel); int4 (groups of 32 4-bit weights with "
        "a scale and minimum each, torch's int4 kernel, float activations); q4 (the same weights, scale and minimum "
        "in float16, times int8-quantized activations on speculant's own kernel); q8 (q4 with 8-bit codes); file "
        "(each matrix as precise as its GGUF file: 4-bit codes as q4, Q6_K as it is, 7 bits per weight on the same "
        "kernel; Q5_0, Q8_0 in 8-bit codes). int4, q4, file and q8 keep a GGUF file's own 4-bit "
        "codes (Q4_K, Q4_0, Q4_1). Every method decodes the same quantized model, so output stays lossless against plain "
        "decoding of it (bit for bit: a quantized forward is row independent). Speed: q4 is the fastest at 1 to "
        "16 tokens per forward, int4 and int8 lose their advantage beyond a few tokens (docs/results/); default: "
        "a packaged model's own format (file for the Qwen2.5-Coder target, q4 for its draft), else none",
    )
    add_threads_argument(p)
    add_device_argument(p, "the target and draft models" if draft else "the target model")
    if kv:
        from ..plan import generate_defaults

        p.add_argument(
            "--kv-policy",
            metavar="POLICY",
            default=None,
            help="evict the target's KV cache with this policy (keydiff, keydiff-raw, streaming, h2o, h2o-acc, "
            "tova, snapkv, knorm, random, speckv (scored by the draft's provisional answer: needs a draft-model "
            "method), wrappers caote:/fastcaote:/protect:, e.g. caote:h2o; options after the name set its fields, "
            "e.g. snapkv:window=32, snapkv:passes=2 or speckv:passes=2 (prefill twice: the second pass keeps what "
            "the question at the end of the prompt, and for speckv the draft's provisional answer, attends to)); "
            "needs --kv-budget",
        )
        p.add_argument(
            "--kv-budget",
            type=positive_int,
            metavar="N",
            default=None,
            help="keep at most N tokens per layer in the target's KV cache (block-wise prefill, then eviction "
            "back to N whenever decoding fills the block's room); needs --kv-policy",
        )
        p.add_argument(
            "--kv-block",
            type=positive_int,
            metavar="B",
            default=None,  # None: not given (generate()'s default applies; without eviction it is a no-op)
            help="prefill block size with --kv-budget (peak KV: N + B tokens per layer); default: "
            f"{generate_defaults()['kv_block']}",
        )


def session_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`speculant.plan.resolve` from the options of :func:`add_model_arguments`
    (those a parser did not declare are left out)."""
    names = ("draft", "method", "dtype", "quantization", "device", "threads", "kv_policy", "kv_budget", "kv_block")
    return {"target": args.target, **{n: getattr(args, n) for n in names if hasattr(args, n)}}


def set_threads(threads: int | str | None) -> int | None:
    """``--threads``: torch CPU threads, an int or ``auto`` (:func:`speculant.core.threads.apply_threads`; None:
    left to torch); returns the count set."""
    from ..core.threads import apply_threads

    return apply_threads(threads)


def option_name(field: str) -> str:
    """The command-line spelling of a dataclass field: ``kd_loss`` -> ``--kd-loss``."""
    return "--" + field.replace("_", "-")


def add_dataclass_arguments(
    p: argparse.ArgumentParser, cls: type, skip: set[str], docs: dict[str, str],
    deferred: frozenset[str] = frozenset(),
) -> None:
    """One ``--field-name`` option per dataclass field; the dataclass holds the defaults (not restated): the help
    is ``docs[field]`` plus ``(default: VALUE)``, unless the doc already says its default in words.

    ``deferred`` fields default to None on the command line (the help still shows the dataclass default), so the
    runner can tell an option given explicitly from one left out; :func:`dataclass_from_args` then applies the
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
        doc = docs.get(f.name, "")
        # a help text that says its default in words ("default: the built-in prompts") keeps only that one
        shown = required or "default:" in doc
        if hint is bool:  # a switch: --name / --no-name
            p.add_argument(option_name(f.name), action=argparse.BooleanOptionalAction,
                           default=None if f.name in deferred else default,
                           help=(doc + ("" if shown else f" (default: {'on' if default else 'off'})")).replace("%", "%%"))
            continue
        p.add_argument(
            option_name(f.name),
            type=kind,
            default=None if f.name in deferred else default,
            required=required,
            help=(doc + ("" if shown else f" (default: {default})")).replace("%", "%%"),
        )


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
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
