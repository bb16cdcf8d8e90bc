"""``threads="auto"`` and the OpenMP wait policy (:mod:`speculant.core.threads`): the choice from a mocked
``/proc/stat``, its log line, the ``--threads`` option, and the command line's wait policy set before torch."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculant.commands.common import threads_option
from speculant.core import threads as th

SRC = str(Path(__file__).resolve().parents[2] / "src")


def stat(*cpus: tuple[int, int]) -> str:
    """A ``/proc/stat`` text with one line per CPU from ``(busy, idle)`` jiffies (busy as user time)."""
    lines = [f"cpu  {sum(b for b, _ in cpus)} 0 0 {sum(i for _, i in cpus)} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {b} 0 0 {i} 0 0 0 0 0 0" for n, (b, i) in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 4"]) + "\n"


@pytest.fixture
def two_cores(monkeypatch):
    """A machine of two usable cores, no cgroup quota, no OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(th, "_allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(th, "_cgroup_quota", lambda root=None: None)


def reads(*texts: str):
    return iter(texts).__next__


# ---------------------------------------------------------------------------------------------- the choice


def test_auto_is_between_one_and_the_usable_cores():
    choice = th.choose_threads(sample_s=0.05, environ={})
    assert 1 <= choice.threads <= th.available_cores() <= (os.cpu_count() or 1)
    assert choice.cores == th.available_cores()


def test_one_busy_core_of_two_gives_one_thread(two_cores):
    # over the sample, cpu0 was busy throughout (100 of 100 jiffies) and cpu1 idle
    choice = th.choose_threads(sample_s=0, read=reads(stat((1000, 0), (0, 1000)), stat((1100, 0), (0, 1100))))
    assert (choice.threads, choice.cores) == (1, 2)
    assert choice.message == "threads: 1 of 2 cores (1 busy at start)"


def test_quiet_cores_all_used_and_a_light_neighbour_ignored(two_cores):
    quiet = th.choose_threads(sample_s=0, read=reads(stat((0, 0), (0, 0)), stat((0, 100), (0, 100))))
    assert quiet.threads == 2 and quiet.message == "threads: 2 of 2 cores (none busy at start)"
    light = th.choose_threads(sample_s=0, read=reads(stat((0, 0), (0, 0)), stat((20, 80), (0, 100))))
    assert light.threads == 2  # a fifth of one core: under BUSY_FRACTION
    both = th.choose_threads(sample_s=0, read=reads(stat((0, 0), (0, 0)), stat((100, 0), (100, 0))))
    assert both.threads == 1  # never fewer than one


def test_load_average_when_proc_stat_cannot_be_read(two_cores, monkeypatch):
    def unreadable() -> str:
        raise OSError("no /proc")

    monkeypatch.setattr(os, "getloadavg", lambda: (1.1, 0.5, 0.2))
    choice = th.choose_threads(sample_s=0, read=unreadable)
    assert choice.threads == 1 and choice.message == "threads: 1 of 2 cores (load average 1.1)"


def test_cgroup_quota_and_affinity_cap_the_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(th, "_allowed_cpus", lambda: [0, 1, 2, 3])
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert th._cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert th._cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert th._cgroup_quota(tmp_path) == 2.0
    monkeypatch.setattr(th, "_cgroup_quota", lambda root=None: 1.5)
    assert th.available_cores() == 2  # 1.5 cores of quota: two threads can use them


def test_omp_num_threads_is_kept(two_cores):
    choice = th.choose_threads(sample_s=0, environ={"OMP_NUM_THREADS": "3"})
    assert choice.threads is None and choice.message == "threads: torch's own (OMP_NUM_THREADS=3)"


def test_apply_logs_the_choice_once_and_sets_torch(two_cores, monkeypatch, caplog):
    import torch

    monkeypatch.setattr(th, "choose_threads", lambda: th.ThreadChoice(1, 2, "1 busy at start"))
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    th.auto_threads.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="speculant"):
            assert th.apply_threads("auto") == 1
            assert th.apply_threads("auto") == 1
        assert calls == [1, 1]
        lines = [r.getMessage() for r in caplog.records if r.name == th.__name__]
        assert lines == ["threads: 1 of 2 cores (1 busy at start)"]  # chosen and said once per process
        assert th.apply_threads(3) == 3 and th.apply_threads(None) is None and calls == [1, 1, 3]
    finally:
        th.auto_threads.cache_clear()


@pytest.mark.parametrize("bad", [0, -1, "x", "2", 1.5, True])
def test_bad_threads_value_is_one_line(bad):
    with pytest.raises(ValueError, match="threads must be 'auto', an integer >= 1 or None"):
        th.check_threads(bad)


def test_resolve_checks_threads():
    import speculant

    with pytest.raises(ValueError, match="threads must be 'auto'"):
        speculant.resolve(threads="many")


# ---------------------------------------------------------------------------------------------- the option


def test_threads_option_parses_auto_and_counts():
    assert threads_option("auto") == "auto" and threads_option("AUTO") == "auto"
    assert threads_option("2") == 2
    for bad, needle in (("0", "got 0"), ("x", "got 'x'"), ("-3", "got -3")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected 'auto' or an integer >= 1, {needle}"):
            threads_option(bad)


@pytest.mark.parametrize("value", ["0", "x"])
def test_threads_option_errors_are_one_line(capsys, value):
    from speculant import cli

    code = cli.main(["generate", "hello", "--threads", value])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculant: error: ") and "--threads" in lines[0], err
    assert "expected 'auto' or an integer >= 1" in lines[0]


def test_threads_default_is_auto():
    from speculant.commands import generate

    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    assert p.parse_args(["hello"]).threads == "auto"
    assert p.parse_args(["hello", "--threads", "auto"]).threads == "auto"


# ---------------------------------------------------------------------------------------------- the wait policy


def _after_help(env: dict[str, str]) -> list[str]:
    """``[OMP_WAIT_POLICY, GOMP_SPINCOUNT after speculant --help, whether torch was imported]`` in a fresh
    interpreter."""
    code = ("import os, sys\nfrom speculant import cli\ncli.main(['--help'])\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    base = {k: v for k, v in os.environ.items() if k not in (th.WAIT_POLICY_VAR, th.SPIN_VAR)}
    env = {**base, "PYTHONPATH": SRC, **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].split()


def test_cli_sets_the_spin_count_before_torch_only_when_no_wait_is_set():
    assert _after_help({}) == ["None", th.DEFAULT_SPIN, "False"]
    assert _after_help({th.WAIT_POLICY_VAR: "PASSIVE"}) == ["PASSIVE", "None", "False"]
    assert _after_help({th.SPIN_VAR: "0"}) == ["None", "0", "False"]


def test_set_default_wait_policy_keeps_the_users():
    env: dict[str, str] = {}
    assert th.set_default_wait_policy(env) == {th.SPIN_VAR: th.DEFAULT_SPIN} == env
    env = {th.WAIT_POLICY_VAR: "ACTIVE"}
    assert th.set_default_wait_policy(env) == {th.WAIT_POLICY_VAR: "ACTIVE"} == env
    env = {th.SPIN_VAR: "100"}
    assert th.set_default_wait_policy(env) == {th.SPIN_VAR: "100"} == env
