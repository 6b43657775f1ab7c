"""Machine-load sampling: other processes count, excluded process trees do not."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from eval.machine import BusyMachineError, CpuWindow, MachineLoad, other_cpu_percent, require_quiet, sample_load

SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def _load(other: float) -> MachineLoad:
    return MachineLoad(loadavg_1m=3.5, cpu_count=2, other_cpu_percent=other, omp_num_threads="1",
                       torch_threads=1, sampled_at="2026-01-01T00:00:00+00:00")


def test_require_quiet_names_the_load_and_the_override():
    require_quiet(_load(10.0), allow_busy=False)
    require_quiet(_load(90.0), allow_busy=True)
    with pytest.raises(BusyMachineError, match=r"90\.0%.*--allow-busy"):
        require_quiet(_load(90.0), allow_busy=False)
    with pytest.raises(BusyMachineError):
        require_quiet(_load(10.0), allow_busy=False, max_other_cpu_percent=5.0)


def test_sample_fields(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    load = sample_load(seconds=0.2)
    assert load.cpu_count >= 1 and 0.0 <= load.other_cpu_percent <= 100.0
    assert load.omp_num_threads == "3" and load.torch_threads >= 1
    assert set(load.as_dict()) == {"loadavg_1m", "cpu_count", "other_cpu_percent", "omp_num_threads",
                                   "torch_threads", "sampled_at"}
    with pytest.raises(ValueError):
        sample_load(seconds=0)


def test_other_cpu_percent_arithmetic():
    assert other_cpu_percent(busy_s=3.0, ours_s=1.0, elapsed_s=2.0, cpus=2) == 50.0
    assert other_cpu_percent(1.0, 1.2, 2.0, 2) == 0.0          # tick noise never goes negative
    assert other_cpu_percent(4.1, 0.0, 2.0, 2) == 100.0        # nor above the whole machine


def test_excluded_process_tree_counts_as_ours(monkeypatch):
    """A spinner under a shell (a grandchild of the excluded pid): its CPU is subtracted from the
    machine's busy time, so with the machine's busy time pinned, excluding the shell lowers
    "other" by exactly the spinner's share."""
    import eval.machine as machine

    clock = iter([100.0, 100.0, 101.5, 101.5])     # 1.5 busy CPU-seconds in both windows
    monkeypatch.setattr(machine, "_busy_seconds", lambda: next(clock))
    # detached: a shell (reparented away from this test, so not our descendant) running a spinner
    launcher = subprocess.run(
        ["/bin/sh", "-c", f"/bin/sh -c \"{sys.executable} -c '{SPIN.format(s=4)}'; true\" "
                          ">/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
    shell = int(launcher.stdout.strip())
    try:
        time.sleep(0.5)
        assert shell not in {p.pid for p in psutil.Process().children(recursive=True)}
        excluded, counted = CpuWindow([shell]).start(), CpuWindow().start()
        seen0: dict[int, float] = {}
        machine._tree_cpu_seconds([shell], seen0)
        time.sleep(1.0)
        seen1: dict[int, float] = {}
        machine._tree_cpu_seconds([shell], seen1)
        other_excluded, other_counted = excluded.stop(), counted.stop()
    finally:
        for proc in psutil.Process(shell).children(recursive=True) + [psutil.Process(shell)]:
            proc.kill()
    assert len(seen1) == 2 and shell in seen1          # the shell and the python spinner
    spun = sum(seen1.values()) - sum(seen0.values())
    assert spun > 0.01
    assert other_counted - other_excluded >= 100 * spun / (1.2 * 2 * (psutil.cpu_count() or 1))
