"""TailReplayRadixCache with SGLang's host tier (HiCache L2) on real SGLang pools: a KV-only host
tier the planner plans over.

The harness of test_cache_pools.py, plus SGLang's own HiCache set-up (`init_hicache`, the CPU
engine's `direct` io backend and `page_first_direct` layout, patches/cpu/hicache.py)
and the scheduler's admission steps for a host hit: `init_load_back` with the match's
`best_match_node` / `host_hit_length`, the prefix growing by the count it returns, then the load
acknowledged (`loading_check`). Written KV values are markers, so a loaded slot's contents can be
compared with what the first request wrote.
"""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import drop_hicache_atexit_pin, write_backup  # noqa: E402

from sglang_ext.tail_replay.cache import provenance_of  # noqa: E402
from sglang_ext.tail_replay.config import TailReplayConfig  # noqa: E402
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan  # noqa: E402
from sglang_ext.tail_replay.request import plan_of, record_of  # noqa: E402
from tests.tail_replay.test_cache_pools import CONFIG, FULL, MAMBA, Harness, seq  # noqa: E402

A = seq(1000, 40)


class HostHarness(Harness):
    """The harness with SGLang's host tier attached (write-through on every insert)."""

    def __init__(self, page_size: int, config: TailReplayConfig = CONFIG, **kwargs):
        super().__init__(page_size, config, **kwargs)
        server_args = ServerArgs(model_path="dummy", page_size=page_size, hicache_io_backend="direct",
                                 hicache_mem_layout="page_first_direct", hicache_write_policy="write_through")
        set_global_server_args_for_scheduler(server_args)
        self.cache.init_hicache(server_args, self.cache.cache_init_params)
        self.cache.write_through_threshold = 1 << 30   # backups only where a test asks
        self.cache.load_back_threshold = 0
        self.kv_pool = self.alloc.get_kvcache()

    def close(self) -> None:
        drop_hicache_atexit_pin(self.cache)
        self.cache.release_host_resources()

    def mark(self, req) -> None:
        """Write marker K values into the request's KV slots: position p holds p + 1 in every
        element of layer 0's K (small integers: exact in a 16-bit KV dtype)."""
        row = self.pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)].long()
        k = self.kv_pool.full_kv_pool.k_buffer[0]
        for p, slot in enumerate(row.tolist()):
            k[slot] = float(p + 1)

    def k_markers(self, slots: torch.Tensor) -> list[float]:
        return self.kv_pool.full_kv_pool.k_buffer[0][slots.long()][:, 0, 0].tolist()

    def backup_all(self) -> None:
        """Write every device node's KV through to the host tier, and acknowledge it."""
        for node, _ in self.nodes():
            if node.component_data[FULL].value is not None and not node.backuped:
                assert write_backup(self.cache, node.id) > 0
        self.cache.writing_check(write_back=True)   # blocking: submit and acknowledge every write

    def demote_all(self) -> None:
        """Device pressure: every unlocked device leaf goes to the host tier (its KV stays there)."""
        self.cache.evict(EvictParams(num_tokens=self.kv_total))

    def after_match(self, req) -> None:
        """A host hit: `init_load_back` as the scheduler's admission calls it, the prefix grown by
        the count it returns, then the load acknowledged."""
        self.promised = req.host_hit_length
        if req.host_hit_length > 0 or req.mamba_host_hit_length > 0:   # Req.needs_host_load_back
            loaded, req.last_node = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
            req.prefix_len += loaded
            if self.cache.load_back_is_cache_owned():   # as the scheduler: the loaded KV is the tree's
                req.kv.cache_protected_len = req.prefix_len
            self.cache.ready_to_load_host_cache()
            for ack in list(self.cache.cache_controller.ack_load_queue):
                ack.finish_event.synchronize()
            self.cache.loading_check()


@pytest.fixture
def host():
    made = []

    def make(page_size: int = 1, config: TailReplayConfig = CONFIG, **kwargs) -> HostHarness:
        h = HostHarness(page_size, config, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


KV_ONLY = CONFIG.replaced(keep_checkpoints=False)


def test_without_checkpoints_the_host_tier_holds_kv_only(host):
    h = host(config=KV_ONLY)
    first = h.admit(A)
    h.mark(first)
    h.finish(first)
    h.backup_all()
    for node, _ in h.nodes():
        assert node.backuped                                   # the KV went to the host
        assert node.component_data[MAMBA].host_value is None    # the state did not
    h.assert_no_leak()


@pytest.mark.parametrize("page", [1, 4])
def test_host_hit_loads_the_prefix_and_the_tail_it_reads(host, page):
    h = host(page)
    first = h.admit(A)
    h.mark(first)
    h.finish(first)
    h.backup_all()
    h.demote_all()
    assert all(node.component_data[FULL].value is None for node, _ in h.nodes())   # all on host
    assert h.state_nodes() == {}                               # and no state anywhere

    req = h.admit(A[:30] + seq(5000, 10))
    matched = 30 // page * page
    prefix = (matched - 4) // page * page                      # W = 4
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, matched, prefix, prefix)
    assert h.promised == prefix                                # SGLang adds this to the prefix
    assert req.prefix_len == prefix
    # the loaded prefix holds the first request's KV
    assert h.k_markers(h.cache.prefix_device_indices(req)) == [p + 1.0 for p in range(prefix)]
    # the replayed tail reads the tree's KV, loaded from the host too
    slots = record_of(req).kv_slots
    assert slots is not None and h.k_markers(slots) == [p + 1.0 for p in range(prefix, matched)]
    assert h.depth(req.last_node) == matched
    assert req.kv.mamba_cow_src_index is None                 # no state copied from anywhere
    h.finish(req)
    h.assert_no_leak()


def test_host_hit_that_does_not_extend_the_prefix_is_not_loaded(host):
    """The device holds all but the last 2 tokens the host holds; the window (4) covers them: the
    plan runs over the device hit alone and nothing is loaded."""
    h = host()
    first = h.admit(A)
    h.finish(first)
    h.backup_all()
    second = h.run(A[:38] + seq(7000, 6))                      # splits A at 38; the 2-token leaf
    h.backup_all()
    tail = next(node for node, depth in h.nodes() if depth == 40)
    h.cache._demote(tail.id, {FULL: 0, MAMBA: 0})
    req = h.admit(A)
    assert h.promised == 0
    plan = plan_of(req)
    assert plan.matched_tokens == 38 and req.prefix_len == plan.prefix_len
    del second


def _demote(h: HostHarness, depth: int) -> None:
    """Device pressure on one leaf: the node ending at `depth` keeps only its host copy."""
    node = next(node for node, d in h.nodes() if d == depth)
    h.cache._demote(node.id, {FULL: 0, MAMBA: 0})


def test_fresh_kv_over_a_host_only_node_keeps_the_larger_bound(host):
    """An approximate request computes tokens whose exact KV sits only on the host; SGLang's insert
    gives the node the request's device KV while its host copy stays: the node's bound must be
    the request's (else a later exact read takes approximate KV for exact)."""
    h = host(config=KV_ONLY)
    h.run(A)                                                   # exact, 40 tokens
    h.run(A[:20] + seq(7000, 8))                               # splits A at 20
    h.backup_all()
    _demote(h, 40)                                             # A[20:40] on the host only
    req = h.admit(A + seq(9000, 4), {"budget": 0.6})          # W = 24 over L = 40
    assert h.promised == 0                                     # W 12 reaches below the device hit (20)
    plan = plan_of(req)
    assert plan.kind is HitKind.APPROXIMATE and plan.matched_tokens == 20 and plan.prefix_len == 8
    h.finish(req)
    node = next(node for node, d in h.nodes() if d == 40)
    assert node.component_data[FULL].value is not None and node.backuped   # device KV + host copy
    prov = provenance_of(node)
    assert prov is not None and prov.kv_max() > 0             # the request's bound, not "exact"
    h.assert_no_leak()


def test_a_load_back_that_loads_nothing_serves_the_request_as_a_miss(host):
    """SGLang loads all of a host hit or nothing (here: below its load-back threshold); the plan
    promised a longer prefix, so the request is served as a miss, exactly, and nothing leaks."""
    h = host()
    h.run(A)
    h.backup_all()
    h.demote_all()
    h.cache.load_back_threshold = 1000
    req = h.admit(A[:30] + seq(5000, 10))
    assert h.promised > 0
    assert plan_of(req) == ReplayPlan(HitKind.MISS, 30, 0, 0)
    assert req.prefix_len == 0 and record_of(req).kv_slots is None
    h.assert_no_leak()
    h.finish(req)
    h.assert_no_leak()


def _set_state(h: HostHarness, slot: int, marker: float) -> None:
    cache = h.pool.mamba_pool.mamba_cache
    cache.temporal[:, slot] = marker
    for conv in cache.conv:
        conv[:, slot] = marker


def _state_marker(h: HostHarness, slot) -> float:
    return float(h.pool.mamba_pool.mamba_cache.temporal[:, int(slot)].flatten()[0])


def test_with_checkpoints_a_host_state_resumes_its_conversation_exactly(host):
    """States go to the host with their node (stock SGLang's host tier); a request whose plan starts
    from a checkpoint that is on the host only gets that state copied into its slot, and resumes
    exactly from it (no replay)."""
    h = host()
    first = h.admit(A)
    h.mark(first)
    h.finish(first)
    assert h.state_nodes() == {40: 1}
    _set_state(h, 1, 7.0)
    h.backup_all()
    node = next(node for node, d in h.nodes() if d == 40)
    assert node.component_data[MAMBA].host_value is not None      # the state went to the host
    h.demote_all()
    assert h.state_nodes() == {}                                   # ... and lives only there

    req = h.admit(A + seq(9000, 4))
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 40, 40, 40)
    assert h.promised == 40 and req.prefix_len == 40
    assert h.k_markers(h.cache.prefix_device_indices(req)) == [p + 1.0 for p in range(40)]
    assert _state_marker(h, req.kv.mamba_pool_idx) == 7.0        # the checkpoint's state, loaded
    assert not req.kv.mamba_needs_clear and req.kv.mamba_cow_src_index is None
    h.finish(req)
    h.assert_no_leak()


def test_state_only_on_the_host_under_device_kv_is_loaded_without_kv(host):
    """Device state pressure freed the state but not its KV (Tail-Replay frees states alone); its host
    copy still serves an exact resume: SGLang's load-back copies the state, no KV moves."""
    h = host()
    first = h.run(A)
    _set_state(h, 1, 5.0)
    h.backup_all()
    node = next(node for node, d in h.nodes() if d == 40)
    component = h.cache.components[MAMBA]
    tracker = {FULL: 0, MAMBA: 0}
    frees = {FULL: [], MAMBA: []}
    h.cache.tree_core._evict_component_and_detach_lru(node, component, frees, {FULL: [], MAMBA: []}, [],
                                                      tracker=tracker)
    for value in frees[MAMBA]:
        h.pool.mamba_allocator.free(value)
    assert node.component_data[FULL].value is not None and node.component_data[MAMBA].value is None
    req = h.admit(A + seq(9000, 4))
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 40, 40, 40)
    # SGLang counts the checkpoint node's resident KV as the load (so a failed load is seen)
    assert h.promised == 40 and req.prefix_len == 40
    assert _state_marker(h, req.kv.mamba_pool_idx) == 5.0
    h.finish(req)
    h.assert_no_leak()
    del first


def test_a_state_load_that_fails_is_seen_and_served_as_a_miss(host, monkeypatch):
    """The state's KV is on the device, its state on the host only; the controller's load fails:
    the count SGLang sees falls short of the promise (so its admission runs again from the new
    prefix), the request is a miss, and nothing leaks."""
    h = host()
    h.run(A)
    h.backup_all()
    node = next(node for node, d in h.nodes() if d == 40)
    frees = {FULL: [], MAMBA: []}
    h.cache.tree_core._evict_component_and_detach_lru(node, h.cache.components[MAMBA], frees,
                                                      {FULL: [], MAMBA: []}, [], tracker={FULL: 0, MAMBA: 0})
    for value in frees[MAMBA]:
        h.pool.mamba_allocator.free(value)
    monkeypatch.setattr(h.cache.cache_controller, "load", lambda *args, **kwargs: None)
    req = h.admit(A + seq(9000, 4))
    assert h.promised > 0 and req.prefix_len == 0
    assert plan_of(req).kind is HitKind.MISS
    h.assert_no_leak()
    h.finish(req)
    h.assert_no_leak()


def test_a_host_state_is_copied_only_into_a_plan_that_starts_from_it(host):
    """SGLang's load-back copies the anchor node's host state into the request; Tail-Replay allows it
    only for the checkpoint the request's plan starts from."""
    h = host()
    h.run(A)
    h.backup_all()
    h.demote_all()
    node = next(node for node, d in h.nodes() if d == 40)
    component = h.cache.components[MAMBA]
    slot = torch.tensor([3])
    from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase

    assert h.cache.state_load_node is None
    assert component.build_hicache_transfers(node, CacheTransferPhase.LOAD_BACK, mamba_pool_idx=slot) is None
    h.cache.host_tier.state_load_node = node.id
    try:
        assert component.build_hicache_transfers(node, CacheTransferPhase.LOAD_BACK, mamba_pool_idx=slot)
    finally:
        h.cache.host_tier.state_load_node = None


# ---- the storage tier (L3): SGLang's prefetch probe and its backups

def test_the_storage_probe_sees_the_tree_match_and_makes_no_plan(host):
    """With a storage tier, SGLang's prefetch matches the request without a state copy to learn
    where the tree's KV ends (it fetches the pages after that, and grafts them under the node it
    matched): that match is the tree's own, as deep as the KV, and plans nothing. The admission's
    match then plans as before."""
    h = host(config=KV_ONLY)
    h.cache.enable_storage = True
    h.run(A)
    req = h.request(A + seq(5000, 10))
    req.init_next_round_input(h.cache, cow_mamba=False)        # Scheduler._prefetch_kvcache
    assert req.prefix_len + req.host_hit_length == 40
    assert sum(len(n.key) for n in h.cache.planner.walk(req.last_host_node).nodes) == 40   # the node it ends at
    assert record_of(req) is None or plan_of(req) is None      # no plan yet
    req.init_next_round_input(h.cache)                         # the admission's match
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, 40, 36, 36)
    assert req.prefix_len == 36


def test_only_strictly_exact_kv_is_backed_up_to_storage(host, monkeypatch):
    """Stored pages carry no provenance (whoever prefetches them reads them as exact), so a node
    goes to storage only when its path from the root is strictly exact."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    stored = []
    monkeypatch.setattr(UnifiedRadixCache, "write_backup_storage", lambda self, node_id: stored.append(node_id))
    h = host(config=KV_ONLY)
    h.run(A)                                                   # exact
    h.run(A + seq(9000, 8), {"budget": 0.5})                   # approximate: [40, 48) has a bound
    nodes = dict((node.id, depth) for node, depth in h.nodes())
    assert max(nodes.values()) == 48
    for node_id in nodes:
        h.cache.write_backup_storage(node_id)                  # what each write-through ack calls
    assert sorted(nodes[i] for i in stored) == sorted(d for d in nodes.values() if d <= 40)
    assert stored and all(nodes[i] <= 40 for i in stored)


def test_a_state_stored_over_an_approximate_host_copy_keeps_the_copys_bound(host):
    """An approximate end state (bound > 0) goes to the host, and device pressure frees its device
    copy alone. An exact request then ends at the same node and stores its exact state there: the
    node's state bound stays the host copy's (the host copy is the node's state too, and a later
    load-back may bring it in)."""
    h = host()
    h.run(A, {"keep_checkpoints": False})
    tokens = A[:36] + seq(31_000, 4)
    approx = h.run(tokens)
    assert plan_of(approx).kind is HitKind.APPROXIMATE
    node = next(node for node, d in h.nodes() if d == 40 and node.component_data[MAMBA].value is not None)
    bound = provenance_of(node).state
    assert bound > 0
    h.backup_all()
    assert node.component_data[MAMBA].host_value is not None
    component = h.cache.components[MAMBA]
    frees = {FULL: [], MAMBA: []}
    h.cache.tree_core._evict_component_and_detach_lru(node, component, frees, {FULL: [], MAMBA: []}, [],
                                                      tracker={FULL: 0, MAMBA: 0})
    for value in frees[MAMBA]:
        h.pool.mamba_allocator.free(value)
    assert node.component_data[MAMBA].value is None
    exact = h.run(tokens, {"exactness": "exact"})
    assert record_of(exact).plan.kind is not HitKind.APPROXIMATE
    assert node.component_data[MAMBA].value is not None           # the exact request's state
    assert provenance_of(node).state == bound
    h.assert_no_leak()
