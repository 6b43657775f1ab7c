"""Belady with noisy arrival times (the information bound of docs/saecache.md, section 5)."""

from __future__ import annotations

import gzip
import json

import pytest

from eval.trace_sim.bound import NoisyBeladyPolicy
from eval.trace_sim.cli import main
from eval.trace_sim.testing import random_paths, run, trace_from_paths
from sglang_ext.eviction import BeladyPolicy, EntryInfo, RequestInfo


@pytest.mark.parametrize("seed", range(8))
def test_exact_arrival_times_make_it_belady(seed):
    trace = trace_from_paths(random_paths(seed, n_requests=12, alphabet=3, max_len=4))
    times = [r.time for r in trace.requests]
    for capacity in (2, 3, 5):
        exact = run(trace, NoisyBeladyPolicy(times, 0.0), capacity, check=True).stats.hit_blocks
        assert exact == run(trace, BeladyPolicy(), capacity).stats.hit_blocks, (seed, capacity)


@pytest.mark.parametrize("seed", range(10))
def test_the_victim_is_the_entry_whose_next_request_looks_farthest(seed):
    # two entries cached at t=0, read again by request 1 (t=10) and request 2 (t=20):
    # Belady evicts the second; the noisy oracle sees them due at 10*e1 and 20*e2.
    times = [0.0, 10.0, 20.0]
    policy = NoisyBeladyPolicy(times, log_sigma=2.0, seed=seed)
    now = RequestInfo(index=0, time=0.0, prompt_tokens=1, session=None)
    info = EntryInfo(n_blocks=1, n_tokens=1, start_token=0, token_type="user", compute_cost=1.0)
    for key, next_request in (("soon", 1), ("later", 2)):
        policy.admit(key, info, now, next_use=next_request)
        policy.set_evictable(key, True)
    looks_later = "later" if 20.0 * policy._error[2] > 10.0 * policy._error[1] else "soon"
    assert policy.victim(0.0) == looks_later


def test_never_read_again_stays_exact():
    policy = NoisyBeladyPolicy([0.0, 1e6], log_sigma=3.0)
    now = RequestInfo(index=0, time=0.0, prompt_tokens=1, session=None)
    info = EntryInfo(n_blocks=1, n_tokens=1, start_token=0, token_type="user", compute_cost=1.0)
    policy.admit("read", info, now, next_use=1)
    policy.admit("dead", info, now, next_use=2)  # the simulator's "never": len(requests)
    for key in ("read", "dead"):
        policy.set_evictable(key, True)
    assert policy.victim(0.0) == "dead"


@pytest.mark.parametrize("sigma", [-0.5, float("nan"), float("inf")])
def test_bad_sigma_is_refused(sigma):
    with pytest.raises(ValueError, match="log_sigma"):
        NoisyBeladyPolicy([0.0], sigma)


def test_bound_command_reports_lru_belady_and_each_sigma(tmp_path):
    folder = tmp_path / "traces" / "mooncake"
    folder.mkdir(parents=True)
    records = [{"timestamp": 1000 * i, "input_length": 512 * len(p), "output_length": 1,
                "hash_ids": [10 * k + b for k, b in enumerate(p)]}
               for i, p in enumerate(random_paths(3, n_requests=40, alphabet=4, max_len=5))]
    with gzip.open(folder / "conversation_trace.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    out = tmp_path / "out"
    main(["bound", "--trace", "mooncake-conversation", "--capacities", "0.3", "--sigmas", "0,3",
          "--traces-root", str(tmp_path / "traces"), "--out", str(out)])
    rows = {r["policy"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(rows) == ["lru", "belady", "belady-noisy(sigma=0)", "belady-noisy(sigma=3)"]
    assert rows["belady-noisy(sigma=0)"]["block_hit_ratio"] == rows["belady"]["block_hit_ratio"]
    assert rows["belady-noisy(sigma=3)"]["block_hit_ratio"] <= rows["belady"]["block_hit_ratio"]
    assert "belady-noisy(sigma=3)" in (out / "report.md").read_text()


def test_bound_command_refuses_negative_sigmas(capsys):
    with pytest.raises(SystemExit):
        main(["bound", "--sigmas", "1,-1", "--out", "unused"])
    assert "sigmas must be finite numbers >= 0" in capsys.readouterr().err
