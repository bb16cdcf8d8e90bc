"""How many CPU threads torch uses, and how its idle threads wait: the one place that decides.

Why it matters: torch splits every matrix product over its thread pool and then waits at a barrier for the slowest
thread. When another process keeps one of the cores busy, the thread that shares that core runs only in the
scheduler's time slices, and every other thread waits for it at every barrier: with 2 threads on 2 cores and one
busy neighbour, plain decoding can run thirty times slower than with one thread.

Two remedies, both here:

- ``threads="auto"`` (the default of every ``speculant`` subcommand and of :func:`speculant.load`): as many threads
  as cores are free when the model loads (:func:`choose_threads`: the CPUs this process may run on, capped by a
  cgroup CPU quota, minus the cores other processes kept busy over a short sample of ``/proc/stat``, or the load
  average where there is none; at least 1), said in one INFO log line. Chosen once per process.
- how the OpenMP runtime under torch (this torch: GNU OpenMP, see ``torch.__config__.parallel_info()``) lets idle
  threads wait. Its own default spins for 300,000 rounds before sleeping, so threads compete for a busy core with
  the thread that has work; ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once, which protects against a
  neighbour that arrives after start but costs 25-35% on a quiet machine (a forward is hundreds of short parallel
  regions, and every one wakes sleeping threads). The ``speculant`` command sets ``GOMP_SPINCOUNT=20000``
  (:data:`DEFAULT_SPIN`) unless the environment sets a wait policy or a spin count: near the speed of spinning on
  a quiet machine, the same as passive with a neighbour present at start (``auto`` then picks fewer threads), and
  idle threads still go to sleep (a server at rest uses no CPU). The runtime reads these once, when torch is
  imported, so they can only be set before that (:func:`set_default_wait_policy`); Python users set them in their
  environment (docs/python-api.md, "Threads").

``benchmarks/threads_busy.py`` measures plain decoding for each setting with and without a busy neighbour.
Light on purpose (no torch at import): :mod:`speculant.cli` imports it before torch is loaded.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "AUTO",
    "DEFAULT_SPIN",
    "SPIN_VAR",
    "WAIT_POLICY_VAR",
    "ThreadChoice",
    "apply_threads",
    "auto_threads",
    "available_cores",
    "busy_cores",
    "check_threads",
    "choose_threads",
    "set_default_wait_policy",
]

log = logging.getLogger(__name__)

AUTO = "auto"
"""``threads=AUTO``: as many threads as cores are free at start (:func:`choose_threads`)."""

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"
"""The OpenMP runtime's wait-policy variable (ACTIVE: idle threads spin; PASSIVE: they sleep at once)."""

SPIN_VAR = "GOMP_SPINCOUNT"
"""GNU OpenMP's spin count: how many rounds an idle thread spins before it sleeps."""

DEFAULT_SPIN = "20000"
"""What the ``speculant`` command sets :data:`SPIN_VAR` to when the environment says neither a wait policy nor a
spin count: on a quiet machine nearly as fast as ACTIVE (idle threads spin) and clearly faster than PASSIVE
(they sleep at once), beside a busy neighbour with ``auto`` threads as fast as either, and with more threads
forced than there are free cores far less collapsed than the runtime's own default wait
(``benchmarks/threads_busy.py`` measures the three)."""

SAMPLE_S = 0.2
"""How long :func:`busy_cores` watches ``/proc/stat``: long enough for a few scheduler ticks (100 per second)."""

BUSY_FRACTION = 0.25
"""A core counts as busy once other processes use more than this share of it. Low on purpose: one thread too many
costs 10-30x (every barrier waits for the thread on the shared core), one too few at most the speed-up of that
thread."""

_STAT = Path("/proc/stat")
_CGROUP = Path("/sys/fs/cgroup")


def check_threads(threads: int | str | None) -> int | str | None:
    """``threads`` if it is :data:`AUTO`, an int >= 1 or None (torch's own), else a one-line ValueError."""
    if threads is None or threads == AUTO:
        return threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be 'auto', an integer >= 1 or None (torch's own), got {threads!r}")
    return threads


def set_default_wait_policy(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :data:`SPIN_VAR` to :data:`DEFAULT_SPIN` in ``environ`` (default ``os.environ``) unless it already sets
    :data:`WAIT_POLICY_VAR` or :data:`SPIN_VAR` (the user's choice wins); returns those of the two that are set.
    Effective only before torch is imported (the OpenMP runtime reads them when it loads)."""
    env = os.environ if environ is None else environ
    if WAIT_POLICY_VAR not in env and SPIN_VAR not in env:
        env[SPIN_VAR] = DEFAULT_SPIN
    return {k: env[k] for k in (WAIT_POLICY_VAR, SPIN_VAR) if k in env}


def _cgroup_quota(root: Path = _CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None if none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _allowed_cpus() -> list[int]:
    """The CPU numbers this process may run on (its affinity mask; all of them where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def available_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (rounded up); at least 1."""
    cores = len(_allowed_cpus())
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def _cpu_times(text: str, cpus: Sequence[int]) -> tuple[int, int]:
    """``(busy, total)`` jiffies of ``cpus`` in a ``/proc/stat`` text (the ``cpu`` line if it has no per-CPU
    lines). Idle and iowait are idle; steal is busy (the hypervisor gave the core to someone else); guest time is
    already inside user time."""
    rows: dict[str, list[int]] = {}
    for line in text.splitlines():
        if line.startswith("cpu"):
            name, *fields = line.split()
            rows[name] = [int(v) for v in fields[:8]]
    wanted = [rows[f"cpu{c}"] for c in cpus if f"cpu{c}" in rows] or [rows["cpu"]]
    busy = total = 0
    for f in wanted:
        f = f + [0] * (8 - len(f))
        idle = f[3] + f[4]
        total += sum(f)
        busy += sum(f) - idle
    return busy, total


def busy_cores(cpus: Sequence[int], sample_s: float = SAMPLE_S,
               read: Callable[[], str] | None = None) -> float | None:
    """How many of ``cpus`` other processes kept busy over ``sample_s`` seconds of ``/proc/stat`` (``read``
    returns its text; tests pass their own), this process's own CPU time left out (of the real ``/proc/stat``
    only: a text passed in does not hold this process); None where it cannot be read."""
    own_counts = read is None
    read = read or _STAT.read_text
    try:
        wall0, own0 = time.monotonic(), time.process_time()
        busy0, total0 = _cpu_times(read(), cpus)
        time.sleep(sample_s)
        busy1, total1 = _cpu_times(read(), cpus)
        wall, own = time.monotonic() - wall0, time.process_time() - own0
    except (OSError, ValueError, KeyError, IndexError):
        return None
    if total1 <= total0:
        return None
    ncpu = len(cpus) or 1
    busy = (busy1 - busy0) / (total1 - total0) * ncpu - (own / wall if own_counts and wall > 0 else 0.0)
    return min(float(ncpu), max(0.0, busy))


# ---------------------------------------------------------------------------------------------- the choice


@dataclass(frozen=True)
class ThreadChoice:
    """What ``threads="auto"`` chose: ``threads`` (None: torch's own, because ``OMP_NUM_THREADS`` says it) of
    ``cores`` usable cores, and ``why`` (for the log line)."""

    threads: int | None
    cores: int
    why: str

    @property
    def message(self) -> str:
        """One log line, e.g. ``threads: 1 of 2 cores (1 busy at start)``."""
        if self.threads is None:
            return f"threads: torch's own ({self.why})"
        return f"threads: {self.threads} of {self.cores} core{'s' if self.cores != 1 else ''} ({self.why})"


def _whole(busy: float) -> int:
    """Busy cores counted whole: a core is busy from :data:`BUSY_FRACTION` of its time."""
    return max(0, math.ceil(busy - BUSY_FRACTION))


def choose_threads(sample_s: float = SAMPLE_S, read: Callable[[], str] | None = None,
                   environ: MutableMapping[str, str] | None = None) -> ThreadChoice:
    """The ``threads="auto"`` choice, now: ``OMP_NUM_THREADS`` if the environment sets it (the user chose; torch
    already follows it), else the usable cores (:func:`available_cores`) minus those other processes keep busy
    (:func:`busy_cores` over ``sample_s`` seconds, or the 1-minute load average where ``/proc/stat`` cannot be
    read), at least 1."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS"):
        return ThreadChoice(None, available_cores(), f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    cores = available_cores()
    busy = busy_cores(_allowed_cpus(), sample_s, read)
    if busy is not None:
        n = _whole(busy)
        why = f"{n} busy at start" if n else "none busy at start"
    else:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            return ThreadChoice(cores, cores, "no CPU load to read")
        n = _whole(load)
        why = f"load average {load:.1f}"
    return ThreadChoice(max(1, min(cores, cores - n)), cores, why)


@functools.cache
def auto_threads() -> ThreadChoice:
    """:func:`choose_threads` once per process, logged at INFO: later sessions keep the first choice (sampled
    again, the CPU load would count this process's own decoding)."""
    choice = choose_threads()
    log.info(choice.message)
    return choice


def apply_threads(threads: int | str | None) -> int | None:
    """Set torch's CPU threads: an int as given, :data:`AUTO` as :func:`auto_threads` chooses, None left to
    torch; returns the count set (None: nothing set). One-line ValueError for anything else."""
    threads = check_threads(threads)
    if threads == AUTO:
        threads = auto_threads().threads
    if threads is None:
        return None
    import torch  # here: the command line imports this module before torch

    torch.set_num_threads(threads)
    return threads
