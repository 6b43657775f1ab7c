"""`--profile` (eval/replay/profile.py): py-spy's raw stacks split into forward and the rest, per
request, and two servers compared function by function."""

from __future__ import annotations

import pytest

from eval.replay.cli import build_parser
from eval.replay.inputs import ReplayError
from eval.replay.profile import (
    cpu_per_request,
    process_cpu_seconds,
    profile_differences,
    profile_lines,
    summarize_profile,
)
from eval.replay.runner import run

LOOP = "run_scheduler_process (scheduler.py:10);Scheduler.event_loop_normal (scheduler.py:20)"
FWD = "ModelRunner.forward_batch_generation (model_runner.py:30);Qwen3NextModel.forward (qwen3_next.py:40)"


def _raw(tmp_path, lines: list[tuple[str, int]]):
    path = tmp_path / "raw.txt"
    path.write_text("".join(f"{stack} {n}\n" for stack, n in lines))
    return path


def test_samples_split_into_forward_and_the_rest_per_request(tmp_path):
    raw = _raw(tmp_path, [
        (f"{LOOP};Scheduler.run_batch (scheduler.py:50);{FWD};EagerRunner._execute_decode (eager_runner.py:9)", 200),
        (f"{LOOP};Scheduler.run_batch (scheduler.py:50);{FWD};EagerRunner._execute_extend (eager_runner.py:8)", 100),
        (f"{LOOP};Scheduler.run_batch (scheduler.py:50);{FWD};accumulate_gdn_bound (patches/tail_replay/gdn_bound.py:7)", 20),
        (f"{LOOP};Scheduler.get_next_batch_to_run (scheduler.py:60);UnifiedRadixCache.match_prefix (unified_radix_cache.py:70)", 40),
        (f"{LOOP};Scheduler.get_next_batch_to_run (scheduler.py:61);plan_replay (sglang_ext/tail_replay/planner.py:90)", 10),
        (f"{LOOP};Scheduler.process_batch_result (scheduler.py:80)", 30),
    ])
    p = summarize_profile(raw, requests=4, rate=100)
    assert p["samples"] == 400
    ms = p["ms_per_request"]          # 1 sample = 10 ms, over 4 requests = 2.5 ms per request
    assert ms == {"sampled": 1000.0, "forward": 800.0, "outside_forward": 200.0, "forward_extend": 250.0,
                  "forward_decode": 500.0, "sglang_ext": 75.0}
    outside = dict(p["outside_forward"])
    # inclusive time outside the forward, lines folded into one name per function
    assert outside["Scheduler.event_loop_normal (scheduler.py)"] == 200.0
    assert outside["Scheduler.get_next_batch_to_run (scheduler.py)"] == 125.0
    assert outside["plan_replay (sglang_ext/tail_replay/planner.py)"] == 25.0
    assert "Scheduler.run_batch (scheduler.py)" not in outside       # all its samples are in the forward
    assert dict(p["sglang_ext"]) == {"accumulate_gdn_bound (patches/tail_replay/gdn_bound.py)": 50.0,
                                     "plan_replay (sglang_ext/tail_replay/planner.py)": 25.0}


def test_differences_from_the_baseline_largest_first_and_the_report_lines(tmp_path):
    base = summarize_profile(_raw(tmp_path, [(f"{LOOP};Scheduler.process_batch_result (scheduler.py:80)", 10),
                                             (f"{LOOP};{FWD}", 90)]), requests=1, rate=1000)
    (tmp_path / "b").mkdir()
    other = summarize_profile(_raw(tmp_path / "b", [(f"{LOOP};Scheduler.process_batch_result (scheduler.py:80)", 12),
                                                    (f"{LOOP};evict (radix.py:5)", 5), (f"{LOOP};{FWD}", 90)]),
                              requests=1, rate=1000)
    diff = profile_differences(other, base)
    assert diff[0] == ["Scheduler.event_loop_normal (scheduler.py)", 17.0, 10.0, 7.0]
    assert ["evict (radix.py)", 5.0, 0.0, 5.0] in diff
    assert ["Scheduler.process_batch_result (scheduler.py)", 12.0, 10.0, 2.0] in diff
    lines = "\n".join(profile_lines([{"server": "stock", "profile": base}, {"server": "tr", "profile": other}], "stock"))
    assert "| tr | 107.00 | 90.00: 0.00 / 0.00 | 17.00 | 0.00 |" in lines
    assert "- +5.000 `evict (radix.py)` (5.000 vs 0.000)" in lines
    assert profile_lines([{"server": "stock"}], "stock") == []      # nothing profiled: no section
    cpu = profile_lines([{"server": "stock", "process_cpu_ms_per_request": {"http": 3.0, "sglang::scheduler": 40.0}},
                         {"server": "tr", "process_cpu_ms_per_request": {"http": 5.5, "sglang::scheduler": 41.0}}], None)
    assert "| server | http | sglang::scheduler |" in cpu and "| tr | 5.5 | 41.0 |" in cpu


def test_process_cpu_is_read_per_role_and_divided_per_request():
    import os

    now = process_cpu_seconds(os.getpid())
    assert set(now) >= {"http"} and now["http"] > 0                 # this process stands in for a server
    assert cpu_per_request({"http": 1.0}, {"http": 1.5, "sglang::scheduler": 2.0}, 10) == \
        {"http": 50.0, "sglang::scheduler": 200.0}
    assert process_cpu_seconds(2 ** 22 + 12345) == {}                # no such process: nothing, no error


def test_profile_refuses_a_cluster_before_starting_anything(tmp_path):
    args = build_parser().parse_args(["--out", str(tmp_path / "out"), "--profile", "--workers", "2"])
    with pytest.raises(ReplayError, match="--profile .* --workers"):
        run(args)
    assert not (tmp_path / "out").exists()
