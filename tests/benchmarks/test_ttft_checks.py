"""The TTFT benchmarks' hit checks: what makes a measurement count as the hit it claims to be."""

from __future__ import annotations

from benchmarks.linearkv_ttft import check_hit
from benchmarks.ttft_tail_replay import check_tail_replay

HIT = {"kind": "approximate", "matched_tokens": 1024, "reused_tokens": 960, "replayed_tokens": 64}


def test_tail_replay_hit_with_its_state_bound_passes():
    rec = {"tail_replay": {**HIT, "state_bound": 0.27, "state_bound_per_layer": [0.0, 0.27]}, "cached_tokens": 960}
    assert check_tail_replay(rec, 1024, 64) == []


def test_tail_replay_wrong_window_or_no_hit_is_a_problem():
    assert check_tail_replay({"tail_replay": {**HIT, "replayed_tokens": 103}}, 1024, 64)
    assert check_tail_replay({"tail_replay": None, "cached_tokens": 0}, 1024, 64)


def test_linearkv_hit_counts_epic_heads_as_recomputed():
    rec = {"L": 1024, "rep": 0, "linearkv": {"chunks_hit": 2, "chunks_missed": 0, "reused_tokens": 992,
                                             "recomputed_tokens": 64, "state_source": "predecessor"}}
    assert check_hit(rec, 2, 512, 32, epic_k=16) == []
    assert check_hit(rec, 2, 512, 32) and check_hit({**rec, "linearkv": None}, 2, 512, 32, epic_k=16)


def test_linearkv_replay_hit_counts_its_tail_as_recomputed():
    rec = {"L": 1024, "rep": 0, "linearkv": {"chunks_hit": 2, "chunks_missed": 0, "reused_tokens": 960,
                                             "recomputed_tokens": 96, "state_source": "replay"}}
    assert check_hit(rec, 2, 512, 32, state="replay") == []            # 64 replayed + 32 question
    assert check_hit(rec, 2, 512, 32) and check_hit(rec, 2, 512, 32, state="replay-16")
