"""The ``speculant`` command line: the entry point, its parser and the registry of subcommands.

Each subcommand is a module of :mod:`speculant.commands` (``generate``, ``train``, ``bench``, ``kv-eval``,
``serve``) named in :data:`COMMANDS` with its one-line help; its module (options, runner, help texts) is imported
only when the subcommand is chosen, so ``speculant --help`` and ``speculant --version`` answer without importing
torch. ``-v`` goes before or after the subcommand. ``speculant bench serve`` (:data:`BENCH_SERVE`, the load
generator for a running server) is dispatched before the parser: ``bench`` itself takes no subcommands.

Output conventions shared by every subcommand: stdout carries the result, stderr the library's warnings
(``speculant: WARNING: ...``) and errors. Every bad input is one line ``speculant: error: <message>`` on stderr and
exit code 2, never a traceback; a stdout closed by its reader exits 141, an interrupt 130.

Before anything imports torch, :func:`main` sets the OpenMP wait policy unless the environment sets one
(:mod:`speculant.core.threads`: idle threads sleep rather than spin against a busy neighbour).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from . import __version__
from .commands.common import (
    PROG,
    Command,
    Formatter,
    Parser,
    Subcommand,
    UsageError,
    default_model_dir,
    module_command,
)
from .core.threads import set_default_wait_policy

__all__ = ["main", "build_parser", "default_model_dir", "COMMANDS", "Command", "Subcommand", "PROG",
           "EXIT_BROKEN_PIPE"]

EXIT_BROKEN_PIPE = 141
"""Exit code when stdout's reader went away (``speculant ... | head``): 128 + SIGPIPE, as a shell reports it."""

COMMANDS: list[Command] = [
    Command("generate", "generate text from a prompt with speculative decoding",
            module_command("speculant.commands.generate")),
    Command("train", "train the bundled models: prepare the data, then pretrain or distil a model",
            module_command("speculant.commands.train")),
    Command("bench", "benchmark drafting methods against plain decoding and transformers' generate",
            module_command("speculant.commands.bench")),
    Command("kv-eval", "evaluate KV-cache eviction policies under a memory budget",
            module_command("speculant.commands.kv_eval")),
    Command("serve", "serve a model over HTTP with OpenAI's API (speculant bench serve load-tests it)",
            module_command("speculant.commands.serve")),
]

BENCH_SERVE = Command("bench serve", "load-test a running OpenAI-compatible server (speculant serve)",
                      module_command("speculant.commands.bench_serve"))
"""``speculant bench serve``: reached by :func:`_bench_serve_argv`, not through :data:`COMMANDS`."""


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
    parser = Parser(
        prog=PROG,
        formatter_class=Formatter,
        description="Lossless speculative decoding for Hugging Face causal LMs on one machine.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP + " (also after the COMMAND)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, action=_LazySubcommands)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, formatter_class=Formatter)
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
    _wait_policy()
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, so that a reader gone away is noticed now, not at interpreter exit
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE


def _wait_policy() -> None:
    """The OpenMP wait policy (:func:`speculant.core.threads.set_default_wait_policy`), set here because the
    runtime reads it when torch is imported, which a subcommand does later. Not when torch is already imported
    (``main`` called from Python): it would have no effect on this process, only leak into its children."""
    if "torch" not in sys.modules:
        set_default_wait_policy()


def _bench_serve_argv(argv: Sequence[str]) -> list[str] | None:
    """For ``speculant [OPTIONS] bench serve ARGS``: ``OPTIONS + ARGS``; else None."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return [*argv[:i], *argv[i + 2:]] if argv[i:i + 2] == ["bench", "serve"] else None
    return None


def _bench_serve_parser() -> argparse.ArgumentParser:
    p = Parser(prog=f"{PROG} {BENCH_SERVE.name}", formatter_class=Formatter)
    _declare(p, BENCH_SERVE)
    p.set_defaults(verbose=False)
    return p


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_serve = _bench_serve_argv(argv)
    if bench_serve is not None:
        parser, argv = _bench_serve_parser(), bench_serve
    else:
        parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
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
