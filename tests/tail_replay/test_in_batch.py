"""In-batch prefix caching over Tail-Replay's plans (`waits_for_sibling`, patches/tail_replay/in_batch.py):
the pure rule, and SGLang's scheduler policy sorting a waiting queue on a Tail-Replay cache built on
real SGLang pools (the harness of test_cache_pools.py)."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

import pytest  # noqa: E402
from sglang.srt.managers.schedule_policy import CacheAwarePolicy, SchedulePolicy  # noqa: E402

from sglang_ext.tail_replay import waits_for_sibling  # noqa: E402
from sglang_ext.tail_replay.planner import HitKind  # noqa: E402
from sglang_ext.tail_replay.request import plan_of  # noqa: E402
from tests.tail_replay.test_cache_pools import CONFIG, Harness, seq  # noqa: E402


@pytest.mark.parametrize(("prefix_len", "shared_len", "grid", "waits"), [
    (0, 31, 1, False),      # stock's rule below the check threshold: shares fewer than 32
    (0, 32, 1, True),
    (32, 32, 64, True),     # stock's rule still (the grid does not enter it)
    (128, 159, 1, False),   # above it: 31 tokens beyond its own hit
    (128, 160, 1, True),
    (128, 191, 64, False),  # the sibling's states lie on the grid: 191 -> 128, nothing beyond
    (128, 192, 64, True),   # 192 - 128 = 64
    (320, 330, 64, False),  # shares its own hit and less than a grid step more
])
def test_waits_for_sibling(prefix_len, shared_len, grid, waits):
    assert waits_for_sibling(prefix_len, shared_len, grid, check=32, deprioritize=32) is waits


def test_a_negative_check_threshold_turns_the_rule_off():
    assert not waits_for_sibling(0, 1000, 1, check=-1, deprioritize=32)
    assert not waits_for_sibling(500, 1000, 1, check=-1, deprioritize=32)


def test_the_scheduler_defers_a_replayed_hit_behind_the_waiting_request_it_extends():
    """Three requests wait on a tree holding a 100-token prompt; each matches 90 tokens of it and
    plans an approximate hit of 81 (W = 9), above SGLang's check threshold, so stock's rule defers
    none. `second` extends `first` by 20 tokens: once `first` is prefilled it reuses 150, not 81,
    so it waits a round (sorted last); `third` shares only the tree's 90 tokens with `first`."""
    h = Harness(1, CONFIG)
    h.run(seq(1, 100))
    first_tokens = seq(1, 90) + seq(5000, 60)
    first, second, third = (h.request(t) for t in (first_tokens, first_tokens + seq(6000, 20),
                                                   seq(1, 90) + seq(7000, 30)))
    policy = SchedulePolicy("lpm", h.cache, False, False, False)
    queue = [first, second, third]
    policy.calc_priority(queue)
    assert [r.rid for r in queue] == [first.rid, third.rid, second.rid]
    for req in (first, second, third):
        assert plan_of(req).kind is HitKind.APPROXIMATE and req.prefix_len == 81
    assert policy._compute_prefix_matches([first, second, third], CacheAwarePolicy.LPM) == {second.rid}
