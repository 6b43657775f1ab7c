"""The router's predicted hit depth against the served one (eval/replay/router.py): the smg
counters read around each request, and the run's summary."""

from __future__ import annotations

from eval.replay.router import RouterCounters, one_decision, prediction_line, prediction_summary


def _metrics(ratio_sum: float, count: int, branches: dict[str, int]) -> str:
    lines = ["# HELP smg_cache_aware_match_ratio Best prefix match ratio",
             "# TYPE smg_cache_aware_match_ratio histogram",
             'smg_cache_aware_match_ratio_bucket{le="0.5"} 1',
             f"smg_cache_aware_match_ratio_sum {ratio_sum}",
             f"smg_cache_aware_match_ratio_count {count}",
             'smg_worker_requests_total{worker="http://w0"} 9']
    lines += [f'smg_cache_aware_policy_branch_total{{branch="{b}"}} {n}' for b, n in branches.items()]
    return "\n".join(lines) + "\n"


def test_one_request_moves_the_sum_by_its_ratio_and_one_branch_by_one():
    before = RouterCounters.parse(_metrics(1.25, 3, {"tree_match": 2, "expected_wait_fallback": 1}))
    assert (before.ratio_sum, before.decisions) == (1.25, 3)
    assert before.branches == {"tree_match": 2, "expected_wait_fallback": 1}
    after = RouterCounters.parse(_metrics(2.0, 4, {"tree_match": 3, "expected_wait_fallback": 1}))
    assert one_decision(after.since(before)) == {"match_ratio": 0.75, "branch": "tree_match"}
    assert one_decision(before.since(before)) is None                  # no decision read: none recorded
    two = RouterCounters.parse(_metrics(2.5, 5, {"tree_match": 3, "expected_wait_fallback": 2}))
    assert one_decision(two.since(before)) is None                     # two decisions: not one request's
    assert RouterCounters.parse("sglang:prompt_tokens_total 5\n") == RouterCounters()


def test_summary_compares_predicted_and_served_depths():
    records = [
        {"ok": True, "prompt_tokens": 400, "cached_tokens": 256, "router": {"match_ratio": 0.8, "branch": "tree_match"}},
        {"ok": True, "prompt_tokens": 200, "cached_tokens": 192, "router": {"match_ratio": 0.5, "branch": "tree_match"}},
        {"ok": True, "prompt_tokens": 100, "cached_tokens": 0, "router": {"match_ratio": 0.0, "branch": "spill"}},
        {"ok": False, "prompt_tokens": 100, "cached_tokens": 0, "router": None},
    ]
    moved = RouterCounters(1.3, 4, {"tree_match": 2, "spill": 2})
    summary = prediction_summary(records, moved)
    assert summary["decisions"] == 4 and summary["branches"] == {"spill": 2, "tree_match": 2}
    assert summary["predicted_share_mean"] == 0.325
    assert summary["served_share_mean"] == round((256 / 400 + 192 / 200 + 0) / 3, 4)
    # predicted 320 vs 256 (+64: within the slack), 100 vs 192 (-92: shallower), 0 vs 0
    assert summary["per_request"] == 3 and summary["mean_abs_gap_tokens"] == round((64 + 92 + 0) / 3, 1)
    assert (summary["predicted_deeper"], summary["predicted_shallower"]) == (0, 1)
    line = prediction_line("tr", summary)
    assert "4 decisions (spill 2, tree_match 2)" in line and "predicted deeper on 0, shallower on 1" in line
    aggregate = prediction_summary([{**r, "router": None} for r in records], moved)
    assert "per_request" not in aggregate and "per request" not in prediction_line("tr", aggregate)


def test_a_cluster_is_stopped_like_the_servers_it_runs_beside():
    """The replay stops its servers side by side (`stop_servers`: `signal_stop`, then
    `finish_stop`); a cluster takes the same calls and stops whole on the first."""
    from unittest import mock

    from eval.harness import stop_servers
    from eval.replay.cluster import ClusterProcess

    proc = ClusterProcess.__new__(ClusterProcess)
    proc.cluster = mock.Mock()
    stop_servers([proc])
    proc.cluster.stop.assert_called_once_with()
