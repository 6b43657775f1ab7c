"""What else the machine is doing while a benchmark times something.

Benchmarks call `sample_load` before each timed phase, store `MachineLoad.as_dict()` beside
their timings, and call `require_quiet` so that timings taken next to other CPU work are not
reported as if the machine were idle (unless the user says `--allow-busy`; then the numbers are
labelled as taken on a busy machine).

`other_cpu_percent` is the CPU time used by every process *except* the excluded ones (the
benchmark itself and the servers it started, with all their descendants) during a short sample,
as a percent of the whole machine (all cores together: 100 = every core busy for the whole
sample). It is computed from system-wide CPU times minus the excluded processes' own CPU times,
so it also counts processes that start or exit during the sample.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import psutil


@dataclass(frozen=True)
class MachineLoad:
    loadavg_1m: float            # os.getloadavg()[0] (counts our own processes too)
    cpu_count: int               # logical CPUs
    other_cpu_percent: float     # % of all cores used by processes other than ours during the sample
    omp_num_threads: str | None  # OMP_NUM_THREADS of this process's environment (None: unset)
    torch_threads: int           # torch.get_num_threads() in this process
    sampled_at: str              # ISO 8601, UTC

    def as_dict(self) -> dict:
        return asdict(self)


class BusyMachineError(RuntimeError):
    """Other processes use more CPU than a timing may tolerate; the message names the override."""


def _tree_cpu_seconds(pids: Iterable[int], seen: dict[int, float]) -> None:
    """Add user+system CPU seconds of each pid and its descendants to `seen` (pid -> seconds);
    a process that has exited is skipped."""
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            seen[proc.pid] = times.user + times.system


def _busy_seconds() -> float:
    """System-wide CPU seconds since boot that processes of this machine used (all cores): not
    idle, iowait, steal (the hypervisor's), nor guest time (already counted in user)."""
    t = psutil.cpu_times()
    left_out = ("idle", "iowait", "steal", "guest", "guest_nice")
    return sum(t) - sum(getattr(t, name, 0.0) for name in left_out)


def other_cpu_percent(busy_s: float, ours_s: float, elapsed_s: float, cpus: int) -> float:
    """CPU used by others as a percent of all cores over `elapsed_s`: (busy - ours) / (elapsed *
    cpus), clamped to [0, 100] (the counters tick in 10 ms steps), rounded to 0.1."""
    share = max(0.0, busy_s - ours_s) / (max(elapsed_s, 1e-9) * max(cpus, 1)) * 100.0
    return round(min(100.0, share), 1)


def _torch_threads() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of the project
        return 0
    return int(torch.get_num_threads())


class CpuWindow:
    """`other_cpu_percent` over a longer stretch (e.g. a whole timed replay) without sleeping:
    `start()` before, `stop()` after; same definition and exclusions as `sample_load`."""

    def __init__(self, exclude_pids: Iterable[int] = ()) -> None:
        self.excluded = sorted({os.getpid(), *exclude_pids})
        self._ours: dict[int, float] = {}
        self._busy = self._t0 = 0.0

    def start(self) -> CpuWindow:
        self._ours = {}
        _tree_cpu_seconds(self.excluded, self._ours)
        self._busy, self._t0 = _busy_seconds(), time.monotonic()
        return self

    def stop(self) -> float:
        busy, elapsed = _busy_seconds() - self._busy, time.monotonic() - self._t0
        ours_after: dict[int, float] = {}
        _tree_cpu_seconds(self.excluded, ours_after)
        ours = sum(ours_after[p] - self._ours.get(p, 0.0) for p in ours_after)
        return other_cpu_percent(busy, ours, elapsed, psutil.cpu_count() or 1)


def sample_load(exclude_pids: Iterable[int] = (), seconds: float = 1.0) -> MachineLoad:
    """Sample the machine for `seconds`; this process, `exclude_pids` and all their descendants
    (so any server this process started) do not count as "other" load. Blocks for `seconds`."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    window = CpuWindow(exclude_pids).start()
    time.sleep(seconds)
    other = window.stop()
    cpus = psutil.cpu_count() or 1
    return MachineLoad(
        loadavg_1m=float(os.getloadavg()[0]),
        cpu_count=int(cpus),
        other_cpu_percent=other,
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        torch_threads=_torch_threads(),
        sampled_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def is_busy(load: MachineLoad, max_other_cpu_percent: float = 25.0) -> bool:
    return load.other_cpu_percent > max_other_cpu_percent


def require_quiet(load: MachineLoad, allow_busy: bool, max_other_cpu_percent: float = 25.0) -> None:
    """Raise BusyMachineError when other processes used more than `max_other_cpu_percent` of the
    machine during the sample, unless `allow_busy` (the caller then labels its timings as busy)."""
    if allow_busy or not is_busy(load, max_other_cpu_percent):
        return
    raise BusyMachineError(
        f"the machine is busy: other processes used {load.other_cpu_percent:.1f}% of "
        f"{load.cpu_count} CPUs (limit {max_other_cpu_percent:g}%), load average "
        f"{load.loadavg_1m:.2f}; timings taken now would not be comparable. Wait for a quiet "
        f"machine, or pass --allow-busy to run anyway with the timings labelled as busy.")

