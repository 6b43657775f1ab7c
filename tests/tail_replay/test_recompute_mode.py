"""`kv_mode: "recompute"` on real SGLang pools (the harness of test_cache_pools.py): the request keeps
its recomputed tail KV [prefix_len, L) in its row through every chunk checkpoint and its decode; the
tree keeps its own exact KV there; the recomputed slots are freed when the request's row is released.

The KV allocator hands out slots 1, 2, 3, ... in order, so position p of the first request's
document sits in slot p + 1 and the tree's tail slots are known exactly.
"""

from __future__ import annotations

import pytest
import torch

from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.own_tail import own_slots, own_tail_end
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan
from sglang_ext.tail_replay.request import plan_of, record_of
from tests.tail_replay.test_cache_pools import A, Harness, floor_page, seq

RECOMPUTE = TailReplayConfig.of(budget=0.1, min_replay_tokens=4, min_match_tokens=8, kv_mode="recompute")
EXACT = TailReplayConfig.of(budget=0.1, min_replay_tokens=4, min_match_tokens=8, kv_mode="exact")


def row(h, req, lo, hi) -> list[int]:
    return h.pool.req_to_token[req.kv.req_pool_idx, lo:hi].tolist()


def test_own_tail_end_only_for_recompute_with_a_replayed_tail():
    approx = ReplayPlan(HitKind.APPROXIMATE, 30, 26, 26)
    assert own_tail_end(approx, "recompute") == 30
    assert own_tail_end(approx, "exact") is None
    assert own_tail_end(ReplayPlan(HitKind.EXACT_REPLAY, 30, 0, 0), "recompute") == 30
    assert own_tail_end(ReplayPlan(HitKind.EXACT_CHECKPOINT, 30, 28, 28), "recompute") is None
    assert own_tail_end(ReplayPlan(HitKind.MISS, 3, 0, 0), "recompute") is None
    assert own_tail_end(ReplayPlan(HitKind.APPROXIMATE, 30, 30, 30), "recompute") is None   # nothing replayed


@pytest.mark.parametrize("page", [1, 4])
def test_recompute_keeps_the_requests_tail_kv_through_chunks_and_decode(page):
    h = Harness(page, RECOMPUTE)
    h.run(A)                                    # the tree holds A in slots 1..40
    tokens = A[:30] + seq(5000, 10)
    req = h.admit(tokens)
    L = floor_page(30, page)
    P = floor_page(L - 4, page)
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, L, P, P)
    recomputed = row(h, req, P, L)              # fresh slots, not the tree's
    assert recomputed == seq(41, L - P)
    # chunked prefill: a checkpoint inside the tail, then one after it
    mid = P + page
    req.extend_end = mid
    h.chunk_checkpoint(req)
    assert row(h, req, P, L) == recomputed
    assert own_slots(req).tolist() == recomputed[:mid - P] and req.kv.cache_protected_len == mid
    h.assert_no_leak()
    req.extend_end = len(tokens)
    h.chunk_checkpoint(req)
    assert row(h, req, P, L) == recomputed      # the row still reads the recomputed tail KV
    assert row(h, req, 0, P) == seq(1, P)       # the shared prefix is the tree's
    assert own_slots(req).tolist() == recomputed
    assert h.cache.prefix_device_indices(req) is not None
    # the tree kept its exact KV for the tail, and took the new tokens from the request
    path = h.cache.path_device_indices(req.last_node).tolist()
    assert path[P:L] == seq(P + 1, L - P)
    assert path[L:] == row(h, req, L, len(path))
    h.assert_no_leak()
    for t in (7, 8, 9):
        h.decode(req, t)
    assert row(h, req, P, L) == recomputed      # decode still reads the recomputed tail KV
    free_before = h.alloc.available_size()
    h.finish(req)
    assert record_of(req).own_kv is None
    assert h.alloc.available_size() >= free_before + len(recomputed)
    h.assert_no_leak()
    assert not set(recomputed) & set(h.tree_kv())   # never inserted


def test_exact_mode_rewrites_the_tail_row_to_the_tree_slots():
    """The contrast: in exact mode the request's tail slots are duplicates the insert frees."""
    h = Harness(1, EXACT)
    h.run(A)
    req = h.admit(A[:30] + seq(5000, 10))
    assert row(h, req, 26, 30) == seq(41, 4)
    h.chunk_checkpoint(req)
    assert row(h, req, 26, 30) == seq(27, 4)    # the tree's slots
    assert own_slots(req) is None
    h.finish(req)
    h.assert_no_leak()


def test_recompute_exact_replay_owns_the_whole_replayed_match():
    h = Harness(1, RECOMPUTE)
    h.run(A)
    req = h.admit(A[:30] + seq(6000, 10), overrides={"min_replay_tokens": 64, "max_replay_tokens": 64})
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_REPLAY, 30, 0, 0)
    recomputed = row(h, req, 0, 30)
    h.finish(req, output=(1, 2))
    assert not set(recomputed) & set(h.tree_kv())
    h.assert_no_leak()


def test_recompute_slots_are_freed_when_released_unfinished():
    """Abort / retraction path: release_kv_cache(checkpoint=False) frees the own tail too."""
    from sglang.srt.mem_cache.common import release_kv_cache

    h = Harness(1, RECOMPUTE)
    h.run(A)
    req = h.admit(A[:30] + seq(5000, 10))
    h.chunk_checkpoint(req)
    assert own_slots(req) is not None
    release_kv_cache(req, h.cache, checkpoint=False)
    h.running.remove(req)
    h.assert_no_leak()


def test_recompute_many_requests_share_the_tree_and_leak_nothing():
    h = Harness(1, RECOMPUTE, kv_size=1024)
    h.run(A)
    reqs = [h.admit(A[:30 + i] + seq(7000 + 100 * i, 5)) for i in range(4)]
    for r in reqs:
        h.chunk_checkpoint(r)
    h.assert_no_leak()
    owned = [set(own_slots(r).tolist()) for r in reqs]
    assert all(not (a & b) for i, a in enumerate(owned) for b in owned[i + 1:])
    for r in reqs:
        h.finish(r, output=(1,))
        h.assert_no_leak()
    assert torch.equal(torch.tensor(h.tree_kv()[:40]), torch.tensor(seq(1, 40)))
