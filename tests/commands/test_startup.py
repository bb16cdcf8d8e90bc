"""The command line's start-up and the package's shape, where no model is needed: help and version
without torch, ``python -m speculant``, ``-v`` anywhere, a closed pipe, lazy public names, ``py.typed``."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys

import pytest

import speculant
from speculant import cli


def python(code: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python -c code`` (or ``python -m ...`` when ``code`` is ``-m``) in a fresh interpreter."""
    argv = [sys.executable, *(["-m"] if code == "-m" else ["-c", code]), *args]
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run(argv, text=True, timeout=120, **kwargs)


# ---------------------------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["-h"]])
def test_help_and_version_do_not_import_torch(argv):
    proc = python(f"import sys; from speculant.cli import main; code = main({argv!r}); "
                  "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("NO-TORCH 0"), proc.stdout
    assert ("speculant 0.1.0" if argv == ["--version"] else "generate") in proc.stdout


def test_import_speculant_is_light_and_names_resolve_on_use():
    # the submodules import under their own names and never shadow a public one (mock.patch on the package works)
    proc = python("import sys, speculant; light = 'torch' not in sys.modules; "
                  "speculant.generate; import speculant.core.verification, speculant.core.types\n"
                  "from unittest import mock\n"
                  "with mock.patch('speculant.generate') as g: patched = speculant.generate is g\n"
                  "print(light, 'torch' in sys.modules, callable(speculant.verify), patched, "
                  "type(speculant.core.engine).__name__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True", "True", "module"]


def test_public_names():
    assert set(speculant.__all__) == {*speculant._EXPORTS, "__version__"}
    for name in speculant.__all__:
        assert getattr(speculant, name) is not None, name
    assert set(speculant.__all__) <= set(dir(speculant))
    assert callable(speculant.verify)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        speculant.nope  # noqa: B018


def test_python_dash_m():
    proc = python("-m", "speculant", "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"speculant {speculant.__version__}", proc.stderr
    proc = python("-m", "speculant", "generate")
    assert proc.returncode == 2 and proc.stderr.startswith("speculant: error: ") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["kv-eval", "--help"]])
def test_output_into_a_closed_pipe_is_quiet(argv):
    """``speculant --help | head -0``: the reader is gone before the output is flushed; exit 141, nothing on
    stderr (stdout buffered, as it is into a pipe unless PYTHONUNBUFFERED is set)."""
    read, write = os.pipe()
    os.close(read)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        proc = python("-m", "speculant", *argv, stdout=write, env=env)
    finally:
        os.close(write)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE == 141
    assert proc.stderr == ""


def test_py_typed_is_shipped():
    assert (importlib.resources.files("speculant") / "py.typed").is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "generate", "hi"],
        ["generate", "hi", "-v"],
        ["generate", "-v", "hi"],
        ["train", "model", "--data", "d", "--out", "o", "--verbose"],
        ["train", "-v", "prepare", "--out", "o"],
        ["kv-eval", "-v"],
    ],
)
def test_verbose_before_or_after_the_subcommand(argv):
    args = cli.build_parser().parse_args(argv)
    assert args.verbose is True


def test_verbose_defaults_to_off():
    assert cli.build_parser().parse_args(["generate", "hi"]).verbose is False


def test_eager_parser_declares_every_subcommand():
    parser = cli.build_parser(eager=True)
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("generate", "train", "bench", "kv-eval"):
        assert any(a.dest not in ("help", "verbose") for a in sub.choices[name]._actions), name
