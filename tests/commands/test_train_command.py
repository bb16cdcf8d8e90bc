"""Command-line mistakes: each is one line ``speculant: error: ...`` on stderr, exit code 2, nothing on stdout,
reported before any work. (``generate``'s bad input with models is in test_cli.py, the server's start-up errors in
test_serve.py.)"""

from __future__ import annotations

import pytest

from helpers import cli_error_line as assert_one_line_error
from speculant import cli


# ---------------------------------------------------------------------------------------------- train mistakes


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
