"""The README's examples cannot rot: every ```python block runs, every ``speculant ...`` command line parses, and
the help and the README name every KV policy.

Each Python block runs as written in a fresh interpreter (with a timeout), after the placeholders of
:data:`PLACEHOLDERS` are replaced: ``path/to/target`` and ``path/to/draft`` become the bundled pair
(``default-target`` / ``default-draft``), so those blocks run in the default suite. A block that names the packaged
real model (SmolLM2) is slow and runs only when its package is installed (skipped with the reason otherwise); a
block that talks to a server (``OpenAI(base_url=...)``) gets a ``speculant serve`` of the model it names, on a
free port. The command lines of every other block (unlabelled, ``bash``, ``sh`` or ``console``) are parsed by the
CLI's own parser, which declares each subcommand's options and converts them, without running anything.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import start_server, stop_server
from speculant import cli
from speculant.commands.common import UsageError
from speculant.models.loading import bundled_dir

README = Path(__file__).resolve().parents[2] / "README.md"
REAL_MODEL = "smollm2-135m-instruct"
PLACEHOLDERS = {"path/to/target": "default-target", "path/to/draft": "default-draft"}
"""Placeholder paths of the README's Python blocks -> the bundled models that stand in for them."""
SHELL = {"", "bash", "sh", "console", "shell"}
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    text: str

    @property
    def id(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced code blocks of ``text`` (a fence is a line of ```` ``` ```` with an optional language)."""
    blocks, open_at, lang, body = [], None, "", []
    for n, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if open_at is None and match:
            open_at, lang, body = n, match.group(1), []
        elif open_at is not None and line.rstrip() == "```":
            blocks.append(Block(lang, open_at, "\n".join(body) + "\n"))
            open_at = None
        elif open_at is not None:
            body.append(line)
    assert open_at is None, f"README.md:{open_at}: a code block is never closed"
    return blocks


def command_lines(block: str) -> list[list[str]]:
    """The ``speculant ...`` commands of a shell block as argv lists (continuations joined, comments and a
    trailing ``...`` (\"more options\") dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith("speculant "):
            out.append([a for a in shlex.split(line, comments=True)[1:] if a != "..."])
    return out


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))
PYTHON = [b for b in BLOCKS if b.lang == "python"]
COMMANDS = [(b, argv) for b in BLOCKS if b.lang in SHELL for argv in command_lines(b.text)]


def test_the_readme_has_examples():
    """The collection itself can fail: a changed fence style must not leave these tests with nothing to run."""
    assert len(PYTHON) >= 3 and len(COMMANDS) >= 15, (len(PYTHON), len(COMMANDS))
    assert readme_blocks("a\n```python\nx = 1\n```\n```\nspeculant generate hi \\\n  --k 2 ...\n```\n") == [
        Block("python", 2, "x = 1\n"), Block("", 5, "speculant generate hi \\\n  --k 2 ...\n")]
    lines = command_lines("make demo\nspeculant generate hi \\\n  --k 2 ...   # more\n")
    assert lines == [["generate", "hi", "--k", "2"]]


# ---------------------------------------------------------------------------------------------- Python blocks


def _real_model_missing() -> str | None:
    from speculant.models.sources import packaged_gguf

    try:
        packaged_gguf(REAL_MODEL)
    except ValueError as exc:
        return str(exc)
    return None


def _python_param(block: Block):
    marks = [pytest.mark.slow] if REAL_MODEL in block.text else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_python_param(b) for b in PYTHON])
def test_python_block_runs(block, tmp_path):
    code = block.text
    for placeholder, name in PLACEHOLDERS.items():
        if placeholder in code:
            path = bundled_dir(name)
            assert path is not None, f"the bundled {name} is missing from this checkout"
            code = code.replace(placeholder, str(path))
    assert "path/to/" not in code, f"{block.id}: a placeholder path with no stand-in in PLACEHOLDERS"
    if REAL_MODEL in code and (reason := _real_model_missing()):
        pytest.skip(reason)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(cli.__file__).parent.parent), os.environ.get("PYTHONPATH")) if p)}
    server = None
    try:
        if "OpenAI(" in code:  # a client example: serve the model it names, on a free port
            url = re.search(r'base_url="(http://[^"]+)/v1"', code)
            model = re.search(r'model="([^"]+)"', code)
            assert url and model, f"{block.id}: no base_url / model to serve"
            server, served = start_server(["--target", model.group(1)], tmp_path / "serve.log", env=env,
                                          ready=True)
            code = code.replace(url.group(1), served)
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True, timeout=600,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        if server is not None:
            stop_server(server)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{block.id} printed nothing"


# ---------------------------------------------------------------------------------------------- command lines


def _parse(argv: list[str]):
    """Parse ``speculant ARGV`` as :func:`speculant.cli.main` would, without running it."""
    bench_serve = cli._bench_serve_argv(argv)
    parser = cli._bench_serve_parser() if bench_serve is not None else cli.build_parser()
    try:
        return parser.parse_args(bench_serve if bench_serve is not None else argv)
    except SystemExit as exc:  # --help
        assert exc.code in (0, None), exc
        return None


@pytest.mark.parametrize("block,argv", [pytest.param(b, a, id=f"{b.id}:{a[0]}") for b, a in COMMANDS])
def test_command_line_parses(block, argv, capsys):
    try:
        args = _parse(argv)
    except UsageError as exc:
        pytest.fail(f"{block.id}: `speculant {shlex.join(argv)}` does not parse: {exc}")
    assert args is None or callable(args.run)


def test_a_wrong_command_line_fails_to_parse(capsys):
    """The check above can fail."""
    with pytest.raises(UsageError, match="--no-such-option"):
        _parse(["generate", "hi", "--no-such-option"])
    with pytest.raises(UsageError):
        _parse(["bench", "--temperature", "warm"])


# ---------------------------------------------------------------------------------------------- prose


def test_help_and_readme_list_every_kv_policy():
    """generate --help and the README name every policy of the KV registry (no drift between the three)."""
    from speculant.kv.registry import POLICIES, WRAPPERS

    sub = cli.build_parser(eager=True)._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(sub.format_help().split())
    readme = README.read_text(encoding="utf-8")
    for name in [*POLICIES, *WRAPPERS]:
        assert name in help_text, name
        assert f"`{name}" in readme, name
