"""What a new user trips over (issue 17), where no model is needed: the command line's start-up (help and version
without torch, ``python -m speculant``, ``-v`` anywhere, a closed pipe), ``train`` option mistakes reported in one
line before any work, and the package's shape (lazy public names, ``py.typed``)."""

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


# ---------------------------------------------------------------------------------------------- train mistakes


def assert_one_line_error(capsys, argv: list[str], *needles: str) -> str:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculant: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if training starts: every mistake here must be reported before any work."""
    import speculant.train.bundled.pretrain

    def refuse(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(speculant.train.bundled.pretrain, "train", refuse)


@pytest.mark.parametrize("action", [["model", "--out", "run"], ["calibrate", "--model", "default-draft"],
                                    ["distill-data", "--teacher", "default-target"]])
def test_train_missing_data_dir(capsys, tmp_path, no_training, action):
    missing = str(tmp_path / "no-such-data")
    line = assert_one_line_error(capsys, ["train", action[0], "--data", missing, *action[1:]],
                                 f"--data: directory {missing!r} does not exist", "speculant train prepare")
    assert "Repo id" not in line


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--steps", "0"], ["--steps must be an integer >= 1, got 0"]),
        (["--batch-size", "0"], ["--batch-size must be"]),
        (["--ckpt-every", "0"], ["--ckpt-every must be"]),
        (["--kd-loss", "tvd"], ["--kd-loss: no effect without --teacher"]),
        (["--kd-loss", "fkl", "--kd-weight", "0.3"], ["--kd-loss and --kd-weight: no effect without --teacher"]),
        (["--preset", "huge"], ["unknown preset 'huge'"]),
        (["--device", "nope"], ["unknown device 'nope'"]),
    ],
)
def test_train_model_bad_options(capsys, tmp_path, no_training, extra, needles):
    run = tmp_path / "run"
    assert_one_line_error(capsys, ["train", "model", "--data", str(tmp_path), "--out", str(run), *extra], *needles)
    assert not run.exists()


def test_train_model_kd_options_with_teacher_pass_the_checks(tmp_path, monkeypatch):
    """--kd-loss with --teacher is fine, and options left out keep TrainConfig's defaults (not None)."""
    import speculant.train.bundled.pretrain
    from speculant.train.bundled.pretrain import TrainConfig

    seen = {}

    def fake_train(cfg):
        seen["cfg"] = cfg
        raise ValueError("stop here")

    monkeypatch.setattr(speculant.train.bundled.pretrain, "train", fake_train)
    base = ["train", "model", "--data", str(tmp_path), "--out", str(tmp_path / "run")]
    assert cli.main([*base, "--teacher", "default-target", "--kd-loss", "tvd"]) == 2
    assert seen["cfg"].kd_loss == "tvd" and seen["cfg"].kd_weight == TrainConfig.kd_weight
    assert cli.main(base) == 2
    assert seen["cfg"].kd_loss == TrainConfig.kd_loss and seen["cfg"].teacher is None


def test_help_and_readme_list_every_kv_policy():
    """generate --help and the README name every policy of the KV registry (no drift between the three)."""
    from pathlib import Path

    from speculant.cli import build_parser
    from speculant.kv.registry import POLICIES, WRAPPERS

    sub = build_parser(eager=True)._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(sub.format_help().split())
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for name in [*POLICIES, *WRAPPERS]:
        assert name in help_text, name
        assert f"`{name}" in readme, name
