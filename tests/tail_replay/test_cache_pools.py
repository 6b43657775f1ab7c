"""TailReplayRadixCache on real SGLang pools (Full + Mamba components), built with SGLang's own
unit-test kit (`sglang.test.kits.unified_radix_cache`), driven the way the scheduler drives it:
match at admission (`Req.init_next_round_input`), lock, allocate the request's row and KV,
then `release_kv_cache` at finish (or `checkpoint` in between, as chunked prefill does).

The KV allocator hands out slots 1, 2, 3, ... in order (slot 0 is the padding slot), and so
does the recurrent-state allocator, so the tests assert exact slot ids.
"""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from array import array  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocation import ensure_mamba_capacity  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as kit  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402

from sglang_ext.tail_replay.branch_rules import continues_a_prompt  # noqa: E402
from sglang_ext.tail_replay.cache import (  # noqa: E402
    TailReplayMambaComponent,
    TailReplayRadixCache,
    answer_from,
    provenance_of,
)
from sglang_ext.tail_replay.config import BACKGROUND_PARAM_KEY, REQUEST_PARAM_KEY, TailReplayConfig  # noqa: E402
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan  # noqa: E402
from sglang_ext.tail_replay.provenance.bounds import UNKNOWN  # noqa: E402
from sglang_ext.tail_replay.request import plan_of, record_of  # noqa: E402
from sglang_ext.tail_replay.request_fields import background_mark  # noqa: E402
from tests.tail_replay.tree_walk import assert_slots_accounted, tree_nodes  # noqa: E402

MAMBA = ComponentType.MAMBA
FULL = ComponentType.FULL
#: W = max(ceil(0.1 * L), 4); matches shorter than 8 tokens are not reused approximately;
#: `exactness: "approximate"`, the mode these tests exercise (the default, "exact_first", resumes
#: from any exact state on the path: tests/tail_replay/test_provenance.py and the tests here that
#: pass it)
CONFIG = TailReplayConfig.of(budget=0.1, min_replay_tokens=4, max_replay_tokens=64, min_match_tokens=8,
                          exactness="approximate")
PAGE_SIZES = [1, 4]


class Harness:
    """A TailReplayRadixCache on the kit's pools plus a minimal scheduler around it."""

    def __init__(self, page_size: int, config: TailReplayConfig = CONFIG, *, kv_size: int = 512,
                 mamba_size: int = 12, max_reqs: int = 8):
        cfg = CacheConfig(page_size=page_size, components=(FULL, MAMBA), kv_size=kv_size,
                          mamba_cache_size=mamba_size, max_num_reqs=max_reqs, max_context_len=256,
                          num_layers=2, full_attention_layer_ids=(1,), head_num=1, head_dim=8,
                          mamba_intermediate_size=32, mamba_num_heads=2, mamba_head_dim=16,
                          mamba_state_size=4)
        cache_class = type("TailReplayRadixCache", (TailReplayRadixCache,), {"tail_replay_config": config})
        # build_fixture constructs `UnifiedRadixCache`; the factory's class is a drop-in subclass.
        with mock.patch.object(kit, "UnifiedRadixCache", cache_class):
            self.cache, self.alloc, self.pool = kit.build_fixture(
                cfg, component_registry_override={MAMBA: TailReplayMambaComponent})
        assert isinstance(self.cache, TailReplayRadixCache)
        self.page_size = page_size
        self.kv_total = self.alloc.available_size()
        self.mamba_total = self.pool.mamba_allocator.available_size()
        self.running: list[Req] = []
        self._rid = 0

    # ---- scheduler steps

    def admit(self, tokens, overrides: dict | None = None) -> Req:
        """Admission: match (with the state copy-on-write), lock, row + KV for the extend."""
        req = self.request(tokens, overrides)
        req.init_next_round_input(self.cache)
        self.after_match(req)
        req.lock = self.cache.lock(req.last_node)
        assert ensure_mamba_capacity(self.pool, [req], self.cache)   # the scheduler's state reclaim
        assert self.pool.alloc([req]) is not None
        prefix = (self.cache.prefix_device_indices(req) if req.prefix_len
                  else torch.empty(0, dtype=torch.int64))
        new = self.alloc.alloc(len(tokens) - req.prefix_len)
        assert new is not None
        row = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        self.pool.write((req.kv.req_pool_idx, slice(0, len(tokens))), row.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(tokens)
        req.extend_end = len(tokens)
        self.running.append(req)
        return req

    def request(self, tokens, overrides: dict | None = None) -> Req:
        """A new request (not matched yet); `overrides` with `repair_of` / `audit_of` are the
        server's mark on its own background run (`background_mark`), not a request's fields."""
        self._rid += 1
        background = overrides is not None and any(key in overrides for key in ("repair_of", "audit_of"))
        custom = ({BACKGROUND_PARAM_KEY: background_mark(overrides)} if background
                  else {REQUEST_PARAM_KEY: overrides} if overrides is not None else None)
        return Req(rid=f"r{self._rid}", origin_input_text="", origin_input_ids=array("q", tokens),
                   sampling_params=SamplingParams(temperature=0, max_new_tokens=8, custom_params=custom))

    def after_match(self, req: Req) -> None:
        """The scheduler's steps between match and lock (HiCache's load-back, test_cache_hicache.py)."""

    def decode(self, req: Req, token: int) -> None:
        slot = self.alloc.alloc(1)
        assert slot is not None
        req.output_ids.append(token)
        n = req.kv.kv_committed_len
        self.pool.write((req.kv.req_pool_idx, slice(n, n + 1)), slot.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = n + 1

    def chunk_checkpoint(self, req: Req) -> None:
        """What chunked prefill does between chunks: publish [0, extend_end) while running."""
        checkpoint_kv_cache(req, self.cache)

    def finish(self, req: Req, output=()) -> None:
        for token in output:
            self.decode(req, token)
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)
        self.running.remove(req)

    def run(self, tokens, overrides: dict | None = None, output=()) -> Req:
        req = self.admit(tokens, overrides)
        self.finish(req, output)
        return req

    # ---- tree inspection

    def nodes(self):
        return tree_nodes(self.cache)

    def state_nodes(self) -> dict[int, int]:
        """{depth: state slot} for every node holding a recurrent state."""
        return {depth: int(node.component_data[MAMBA].value.item())
                for node, depth in self.nodes() if node.component_data[MAMBA].value is not None}

    def depth(self, node_id) -> int:
        return len(self.cache.path_device_indices(node_id))

    def full_lock(self, node_id) -> int:
        return self.cache.tree_core.node_by_id(node_id).component_data[FULL].lock_ref

    def tree_kv(self) -> list[int]:
        return self.cache.all_values_flatten().tolist()

    def assert_no_leak(self) -> None:
        """Every KV slot and state slot is free, held by the tree or held by a running request
        (exactly one of these), and the tree's evictable + protected sizes add up."""
        assert_slots_accounted(self.cache, self.pool, self.alloc, self.running, self.kv_total, self.mamba_total)
        self.cache.sanity_check()


def _first_token(h: Harness, node) -> int:
    """The first token of the conversation a node belongs to."""
    while node.parent is not None and node.parent is not h.cache.tree_core.root_node:
        node = node.parent
    return int(node.key.token_ids[0])


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


A = seq(1000, 40)


def floor_page(n: int, page: int) -> int:
    return n // page * page


# ---------------------------------------------------------------- approximate


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_shared_prefix_reuses_l_minus_w_with_the_tree_tail_kv(page):
    h = Harness(page)
    first = h.run(A)
    assert h.tree_kv() == seq(1, 40)          # position p sits in KV slot p + 1
    assert h.state_nodes() == {40: 1}         # the exact end state, in state slot 1
    h.assert_no_leak()

    req = h.admit(A[:30] + seq(5000, 10))
    matched = floor_page(30, page)            # 30 (page 1) or 28 (page 4)
    window = 4                                # max(ceil(0.1 * L), 4)
    prefix = floor_page(matched - window, page)  # 26 (page 1) or 24 (page 4)
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, matched, prefix, prefix)
    assert req.prefix_len == prefix
    assert h.cache.prefix_device_indices(req).tolist() == seq(1, prefix)
    # the replayed tail [L - W, L) reads the tree's exact KV
    assert record_of(req).kv_slots.tolist() == seq(prefix + 1, matched - prefix)
    # the lock covers the whole match, tail included
    assert h.depth(req.last_node) == matched and h.full_lock(req.last_node) == 1
    assert h.cache.full_protected_size() == matched
    # zero state at L - W: no copy from the tree, a fresh slot cleared before the forward
    assert req.kv.mamba_cow_src_index is None and req.kv.mamba_needs_clear
    assert int(req.kv.mamba_pool_idx) == 2
    h.assert_no_leak()

    h.finish(req)
    # the attention KV was stored in full; the approximate end state too, in the request's slot 2,
    # with its bound: no forward ran here (the gates were never seen), so the bound is UNKNOWN (1),
    # and so is every position the request computed past L; the shared path stays exact
    assert h.depth(req.last_node) == 40 and len(h.tree_kv()) == 40 + 40 - matched
    leaf = h.cache.tree_core.node_by_id(req.last_node)
    assert int(leaf.component_data[MAMBA].value.item()) == 2
    assert provenance_of(leaf).state == UNKNOWN
    assert provenance_of(leaf).kv.tolist() == [UNKNOWN] * (40 - matched) and len(leaf.key) == 40 - matched
    assert provenance_of(leaf.parent) is None and provenance_of(h.cache.tree_core.node_by_id(first.last_node)) is None
    assert h.cache.mamba_evictable_size() == 2 and h.pool.mamba_allocator.available_size() == h.mamba_total - 2
    assert first.last_node != req.last_node
    h.assert_no_leak()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_approximate_request_publishes_its_state_with_its_bound_at_a_chunk_boundary(page):
    h = Harness(page)
    h.run(A)
    req = h.admit(A[:36] + seq(6000, 12))       # 48 tokens, L = 36, W = 4 -> approximate
    assert plan_of(req).kind is HitKind.APPROXIMATE
    free_states = h.pool.mamba_allocator.available_size()
    h.chunk_checkpoint(req)
    # KV and a copy of the state (a fresh slot) published up to the chunk end, both approximate
    assert h.depth(req.last_node) == 48
    assert h.pool.mamba_allocator.available_size() == free_states - 1
    assert h.state_nodes() == {40: 1, 48: 3}
    leaf = h.cache.tree_core.node_by_id(req.last_node)
    assert provenance_of(leaf).state == UNKNOWN and provenance_of(leaf).kv.tolist() == [UNKNOWN] * 12
    h.assert_no_leak()
    h.finish(req, output=[7, 8, 9])
    assert h.depth(req.last_node) == floor_page(51, page)
    end = h.cache.tree_core.node_by_id(req.last_node)
    assert provenance_of(end).kv.tolist() == [UNKNOWN] * len(end.key)
    assert (48 in h.state_nodes()) and (page > 1 or h.state_nodes()[51] == 2)
    h.assert_no_leak()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_exact_request_publishes_its_state_at_a_chunk_boundary(page):
    # the contrast to the test above: a miss (exact, from zero) donates its state
    h = Harness(page)
    req = h.admit(seq(1, 48))
    assert plan_of(req).kind is HitKind.MISS
    h.chunk_checkpoint(req)
    assert h.state_nodes() == {48: 2}           # a fresh slot holds the copy; the request keeps 1
    assert int(req.kv.mamba_pool_idx) == 1
    h.assert_no_leak()
    h.finish(req)
    h.assert_no_leak()


# ---------------------------------------------------------------- exact


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_full_hit_on_a_checkpoint_replays_nothing(page):
    h = Harness(page)
    h.run(A)
    req = h.admit(A + seq(7000, 8))
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 40, 40, 40)
    assert req.prefix_len == 40 and record_of(req).kv_slots is None
    assert req.kv.mamba_cow_src_index.tolist() == [1] and not req.kv.mamba_needs_clear
    h.finish(req)
    assert h.state_nodes() == {40: 1, 48: 2}   # the copy target the match allocated
    h.assert_no_leak()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_checkpoint_within_the_window_gives_exact_checkpoint(page):
    h = Harness(page)
    h.run(A)
    x = seq(2000, 12)
    # KV only past the checkpoint: this request keeps no state (per-request override)
    kv_only = h.run(A + x, overrides={"keep_checkpoints": False})
    assert plan_of(kv_only) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 40, 40, 40)
    assert h.state_nodes() == {40: 1} and len(h.tree_kv()) == 52
    h.assert_no_leak()

    # L = 44, W = max(ceil(4.4), 4) = 5: the checkpoint at 40 is 4 <= 5 back
    req = h.admit(A + x[:4] + seq(3000, 8))
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 44, 40, 40)
    assert req.prefix_len == 40 and record_of(req).kv_slots is None
    assert h.depth(req.last_node) == 40 and h.full_lock(req.last_node) == 1
    assert h.cache.prefix_device_indices(req).tolist() == seq(1, 40)
    assert req.kv.mamba_cow_src_index.tolist() == [1] and not req.kv.mamba_needs_clear
    h.assert_no_leak()
    h.finish(req)
    h.assert_no_leak()

    # L = 52, W = 6: the checkpoint is 12 back -> approximate from floor(46 / page) * page
    req = h.admit(A + x + seq(4000, 4))
    prefix = floor_page(46, page)
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, 52, prefix, prefix)
    assert record_of(req).kv_slots.tolist() == seq(prefix + 1, 52 - prefix)
    assert req.kv.mamba_cow_src_index is None
    h.finish(req)
    h.assert_no_leak()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_window_covering_the_match_replays_everything_from_zero(page):
    h = Harness(page, CONFIG.replaced(min_match_tokens=0))
    h.run(A)
    req = h.admit(A[:4] + seq(8000, 10))  # L = 4 = W
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_REPLAY, 4, 0, 0)
    assert req.prefix_len == 0
    assert record_of(req).kv_slots.tolist() == [1, 2, 3, 4]
    assert h.depth(req.last_node) == 4 and h.full_lock(req.last_node) == 1
    assert req.kv.mamba_cow_src_index is None and req.kv.mamba_needs_clear
    h.finish(req)
    # an exact replay's state is exact: it is stored (14 tokens; page 4 keeps none, see below)
    if page == 1:
        assert h.state_nodes() == {40: 1, 14: 2}
    h.assert_no_leak()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_short_match_without_checkpoint_is_a_miss(page):
    config = TailReplayConfig.of(budget=0.0, min_replay_tokens=2, max_replay_tokens=64, min_match_tokens=8)
    h = Harness(page, config)
    h.run(A)
    req = h.admit(A[:6] + seq(9000, 10))        # L = 6 (page 1) or 4 (page 4) < 8, W = 2
    assert plan_of(req) == ReplayPlan(HitKind.MISS, floor_page(6, page), 0, 0)
    assert req.prefix_len == 0 and record_of(req).kv_slots is None
    assert req.last_node == h.cache.root_node_handle()
    assert h.cache.full_protected_size() == 0
    h.finish(req)
    h.assert_no_leak()


def test_recompute_kv_mode_hands_out_no_tail_slots():
    h = Harness(1, TailReplayConfig.of(budget=0.1, min_replay_tokens=4, min_match_tokens=8, kv_mode="recompute"))
    h.run(A)
    req = h.admit(A[:30] + seq(5000, 10))
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, 30, 26, 26)
    assert record_of(req).kv_slots is None
    h.finish(req)
    h.assert_no_leak()


def test_request_overrides_change_the_plan():
    h = Harness(1)
    h.run(A)
    req = h.admit(A[:30] + seq(5000, 10), overrides={"budget": 0.5})
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, 30, 15, 15)
    assert record_of(req).kv_slots.tolist() == seq(16, 15)
    h.finish(req)
    req = h.admit(A[:30] + seq(6000, 10), overrides={"min_replay_tokens": 64, "max_replay_tokens": 64})
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_REPLAY, 30, 0, 0)
    h.finish(req)
    h.assert_no_leak()


# ---------------------------------------------------------------- keep_checkpoints=False


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_without_checkpoints_the_tree_never_holds_a_state(page):
    h = Harness(page, TailReplayConfig.of(budget=0.1, min_replay_tokens=4, min_match_tokens=8,
                                       keep_checkpoints=False))
    baseline = h.pool.mamba_allocator.available_size()
    first = h.run(A, output=[1, 2, 3])
    assert plan_of(first).kind is HitKind.MISS
    assert h.state_nodes() == {} and h.pool.mamba_allocator.available_size() == baseline

    # running requests hold exactly one slot each, the tree none
    reqs = [h.admit(A[:30] + seq(5000, 10)), h.admit(A + seq(6000, 5)), h.admit(A[:4] + seq(7000, 9))]
    assert [plan_of(r).kind for r in reqs] == [HitKind.APPROXIMATE, HitKind.APPROXIMATE, HitKind.MISS]
    assert h.pool.mamba_allocator.available_size() == baseline - 3
    h.chunk_checkpoint(reqs[1])
    assert h.state_nodes() == {} and h.pool.mamba_allocator.available_size() == baseline - 3
    h.assert_no_leak()
    for r in reqs:
        h.finish(r, output=[11, 12])
        assert h.state_nodes() == {}
        h.assert_no_leak()
    assert h.pool.mamba_allocator.available_size() == baseline
    assert h.cache.mamba_evictable_size() == 0 and h.cache.mamba_protected_size() == 0
    assert h.cache.all_mamba_values_flatten().numel() == 0
    # all the attention KV is cached: 43 + (42 - 30) + (47 - 40) + (15 - 4), page-floored
    assert h.cache.full_evictable_size() == floor_page(43, page) + sum(
        floor_page(n, page) - floor_page(m, page) for n, m in ((42, 30), (47, 40), (15, 4)))


# ---------------------------------------------------------------- page > 1: state depth


def test_a_stored_state_sits_at_the_depth_it_was_computed_at():
    """page 4 (no extra buffer): a 42-token request's end state has seen 42 tokens, but the
    tree only keeps 40 (page-aligned). Storing it at depth 40 hands later requests a state
    that has seen 2 tokens more than its position: an EXACT_CHECKPOINT that is not exact."""
    h = Harness(4)
    h.run(seq(1000, 42))
    for depth, _slot in h.state_nodes().items():
        assert depth == 42, f"a 42-token state is stored at depth {depth}"
    h.assert_no_leak()
    req = h.admit(seq(1000, 42) + [1, 2, 3])
    assert plan_of(req).kind is not HitKind.EXACT_CHECKPOINT, plan_of(req)


# ---------------------------------------------------------------- state pressure


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_state_pressure_frees_states_but_keeps_every_branch_kv(page):
    """Three state slots, eight branches, checkpoints kept: every finished request donates its
    end state, and each new request's slot comes from the least recently used state. The KV of
    every branch stays in the tree, so a later request on the oldest branch still hits all of it."""
    h = Harness(page, mamba_size=3, max_reqs=2)
    docs = [seq(10_000 * (i + 1), 40) for i in range(8)]
    for doc in docs:
        h.run(doc)
        assert len(h.state_nodes()) <= h.mamba_total
        h.assert_no_leak()
    assert sorted(h.tree_kv()) == seq(1, 8 * 40)       # no branch lost any KV
    held = [n for n, _ in h.nodes() if n.component_data[MAMBA].value is not None]
    assert len(held) == h.mamba_total                     # the pool is the limit, not the tree
    newest = [h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", d)))).last_device_node
              for d in docs[-3:]]
    assert sorted(n.id for n in held) == sorted(newest)   # least recently used states went first
    assert h.cache.mamba_evictable_size() == h.mamba_total

    req = h.admit(docs[0][:36] + seq(5000, 6))           # the oldest branch, its state long gone
    matched = floor_page(36, page)
    prefix = floor_page(matched - 4, page)
    assert plan_of(req) == ReplayPlan(HitKind.APPROXIMATE, matched, prefix, prefix)
    assert h.cache.prefix_device_indices(req).tolist() == seq(1, prefix)
    h.finish(req)
    assert sorted(h.tree_kv())[:8 * 40] == seq(1, 8 * 40)
    h.assert_no_leak()


def test_a_branch_point_is_tracked_only_where_stock_would_still_hold_the_kv():
    """The extra buffer's branch-point track (`mamba_branching_seqlen`: the match's end on the
    64-token grid, where no state sits that deep) takes the place of the request's own deepest
    state, and its insert stops there. A path whose state was freed keeps its KV here (stock frees
    it with its state): a match running into it branches off nothing unless a state lies below,
    so only the part of the match stock would still hold counts."""
    h = Harness(1, mamba_size=6)
    a = seq(10_000, 100)
    h.run(a)                                                   # KV and state at 100
    h.cache.evict(EvictParams(num_tokens=0, mamba_num=1))      # state pressure: the state goes
    assert h.state_nodes() == {} and len(h.tree_kv()) == 100

    def branching(tokens):
        req = h.request(tokens)
        req.init_next_round_input(h.cache)
        return req.mamba_branching_seqlen

    assert branching(a + seq(20_000, 30)) is None              # its next turn: tracks its own end
    assert branching(a[:70] + seq(21_000, 30)) is None         # nothing below the match holds a state
    b = a[:70] + seq(22_000, 40)
    h.run(b)                                                   # a state below 70 now (b's, at 110)
    assert h.state_nodes() == {110: h.state_nodes()[110]}
    assert branching(b[:75] + seq(23_000, 30)) == 64           # branches off b's path
    assert branching(a[:90] + seq(24_000, 30)) == 64           # stock holds a's path only up to 70
    h.assert_no_leak()


def test_state_pressure_spares_the_checkpoint_a_planned_hit_copies():
    """A full state pool, and a request whose plan copies the least recently used state: the slot
    its own state needs comes from another state, never from the one it copies."""
    h = Harness(1, mamba_size=3, max_reqs=2)
    docs = [seq(10_000 * (i + 1), 40) for i in range(3)]
    for doc in docs:
        h.run(doc)
    oldest = h.cache.tree_core.node_by_id(h.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", docs[0])))).last_device_node)
    oldest_slot = int(oldest.component_data[MAMBA].value.item())
    assert h.pool.mamba_allocator.available_size() == 0
    req = h.admit(docs[0] + seq(7000, 8))
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 40, 40, 40)
    assert req.kv.mamba_cow_src_index.tolist() == [oldest_slot]
    assert oldest.component_data[MAMBA].value is not None
    assert int(oldest.component_data[MAMBA].value.item()) == oldest_slot
    held = [n for n, _ in h.nodes() if n.component_data[MAMBA].value is not None]
    assert len(held) == 2 and oldest in held              # another state made room
    assert sorted(h.tree_kv()) == seq(1, 3 * 40)
    h.finish(req)
    h.assert_no_leak()


@pytest.mark.parametrize("order", ["lru", "ends"])
def test_state_order_ends_frees_a_state_its_conversation_moved_past_first(order):
    """A paused conversation B (one turn) and an active one A (three turns: states at 40, 50, 60),
    four state slots. A new request needs a slot: SGLang's order ("lru") frees B's end state, the
    least recently used; "ends" frees A's state at 40, which A has moved past (its only child
    continues to the state at 50), so B's next turn still resumes exactly."""
    h = Harness(1, CONFIG.replaced(state_order=order), mamba_size=4, max_reqs=2)
    b, a = seq(20_000, 40), seq(30_000, 40)
    h.run(b)
    h.run(a)
    h.run(a + seq(31_000, 10))
    h.run(a + seq(31_000, 10) + seq(32_000, 10))
    def states() -> list[tuple[int, int]]:   # (conversation's first token, depth) of every state held
        return sorted((_first_token(h, n), d)
                      for n, d in h.nodes() if n.component_data[MAMBA].value is not None)

    assert states() == [(20_000, 40), (30_000, 40), (30_000, 50), (30_000, 60)]
    assert h.pool.mamba_allocator.available_size() == 0
    h.run(seq(40_000, 40))                                 # a new conversation: one state must go
    gone = {(20_000, 40)} if order == "lru" else {(30_000, 40)}
    assert states() == sorted({(20_000, 40), (30_000, 40), (30_000, 50), (30_000, 60)} - gone | {(40_000, 40)})
    req = h.admit(b + seq(21_000, 8))                      # B's next turn
    expected = HitKind.APPROXIMATE if order == "lru" else HitKind.EXACT_CHECKPOINT
    assert plan_of(req).kind == expected
    h.finish(req)
    h.assert_no_leak()


@pytest.mark.parametrize("order", ["lru", "approximate_first"])
def test_state_order_approximate_first_keeps_the_exact_states(order):
    """Four state slots: B's exact end state (least recently used), an approximate end state
    (a request that replayed past a state-less match; bound UNKNOWN), and two more exact ones. A
    new request needs a slot: SGLang's order ("lru") frees B's exact state, so B's next turn
    replays approximately where stock SGLang would resume exactly; "approximate_first" frees the
    approximate state and B's next turn resumes exactly."""
    h = Harness(1, CONFIG.replaced(state_order=order), mamba_size=4, max_reqs=2)
    b, a = seq(20_000, 40), seq(30_000, 40)
    h.run(b)
    h.run(a, {"keep_checkpoints": False})                  # a's KV, no state
    approx = h.run(a[:36] + seq(31_000, 12))               # L = 36, W = 4, no state: approximate
    assert plan_of(approx).kind is HitKind.APPROXIMATE
    h.run(seq(40_000, 40))
    h.run(seq(50_000, 40))

    def states() -> list[tuple[int, int, bool]]:   # (first token, depth, exact) of every state held
        return sorted((_first_token(h, n), d, provenance_of(n) is None)
                      for n, d in h.nodes() if n.component_data[MAMBA].value is not None)

    held = [(20_000, 40, True), (30_000, 48, False), (40_000, 40, True), (50_000, 40, True)]
    assert states() == held and h.pool.mamba_allocator.available_size() == 0
    h.run(seq(60_000, 40))                                 # a new conversation: one state must go
    gone = (20_000, 40, True) if order == "lru" else (30_000, 48, False)
    assert states() == sorted([s for s in held if s != gone] + [(60_000, 40, True)])
    req = h.admit(b + seq(21_000, 8))                      # B's next turn
    assert plan_of(req).kind is (HitKind.APPROXIMATE if order == "lru" else HitKind.EXACT_CHECKPOINT)
    h.finish(req)
    h.assert_no_leak()


def test_the_state_a_plan_resumes_from_is_the_most_recently_used():
    """Stock SGLang's match touches the state it ends at, the one the request copies. Here the
    match runs to the end of the KV: B's exact state at 40 sits under an approximate one at 56
    (a request that replayed past 48), and an `exact_first` request matching to 56 resumes from 40.
    The state at 40 is the one it used, so it is younger than the one at 56 in the state LRU (a
    branch-point state that every first turn resumes from must not age as if unused)."""
    h = Harness(1, mamba_size=6, max_reqs=2)
    b = seq(20_000, 40)
    h.run(b)                                                           # exact state at 40
    h.run(b + seq(21_000, 8), {"keep_checkpoints": False})             # KV to 48, no state
    approx = h.run(b + seq(21_000, 8) + seq(22_000, 8))                # L = 48, 48 - 40 > W = 5
    assert plan_of(approx).kind is HitKind.APPROXIMATE
    req = h.admit(b + seq(21_000, 8) + seq(22_000, 8) + seq(23_000, 8), {"exactness": "exact_first"})
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 56, 40, 40)
    h.finish(req)

    depth_of = {node.id: d for node, d in h.nodes()}
    lru = h.cache.tree_core.lru_lists[MAMBA]
    order, node = [], lru.get_lru_no_lock()                            # least recently used first
    while node is not None:
        order.append((depth_of[node.id], provenance_of(node) is None))
        node = lru.get_prev_no_lock(node)
    assert order == [(56, False), (40, True), (64, True)]
    h.assert_no_leak()


# ---------------------------------------------------------------- shared-state repair


def test_an_approximate_state_conversations_branch_from_asks_for_its_repair_once():
    """A's KV without a state; a request replays past it (approximate) and leaves its end state at
    48 (bound > 0). Its conversation's next turn resumes there: a conversation's own state, not
    shared. A second continuation passes it while a state sits further down its one child: still
    not shared. A third finds the tree branching below it: it asks for the state's repair, once
    (the node is marked). The repair run (exact, over the 48 tokens) replaces the state with an
    exact one, and the next continuation resumes exactly."""
    from sglang_ext.tail_replay.repair import repair_overrides

    h = Harness(1)
    a = seq(30_000, 40)
    h.run(a, {"keep_checkpoints": False})
    base = a[:36] + seq(31_000, 12)
    first = h.run(base)
    assert plan_of(first).kind is HitKind.APPROXIMATE and record_of(first).shared_repair is None
    asked = []
    for start in (32_000, 33_000, 34_000, 35_000):
        req = h.run(base + seq(start, 8))
        assert plan_of(req).kind is HitKind.APPROXIMATE_CHECKPOINT and plan_of(req).prefix_len == 48
        asked.append(record_of(req).shared_repair)
    assert asked == [None, None, 48, None]   # own state; a state below its one child; shared; marked
    state_node = next(n for n, d in h.nodes() if d == 48)
    assert provenance_of(state_node).state > 0
    repair = h.run(base, repair_overrides("r-shared", "shared_state"))
    assert plan_of(repair).kind is HitKind.MISS and record_of(repair).shared_repair is None
    assert provenance_of(state_node) is None or provenance_of(state_node).state == 0.0   # exact now
    after = h.run(base + seq(36_000, 8))
    assert plan_of(after).kind is HitKind.EXACT_CHECKPOINT and plan_of(after).prefix_len == 48
    assert record_of(after).shared_repair is None
    h.assert_no_leak()


def test_the_tree_knows_where_an_answer_begins_through_splits_and_which_matches_end_in_a_prompt():
    """A finished request's leaf is marked where its generated answer begins (the prompt's 40
    tokens, then its 6 output tokens: this harness computes every output token's KV); splits
    keep the mark with the tokens. A request whose match ends inside that prompt branches off a
    prompt (a prefix two prompts share: the shared-state repair's branch rule may ask); the
    conversation's next turn, whose match ends where the answer begins, does not."""
    h = Harness(1)
    a = seq(30_000, 40)
    h.run(a, output=seq(90_000, 6))
    depth_of = lambda d: next(n for n, depth in h.nodes() if depth == d)   # noqa: E731
    assert answer_from(depth_of(46)) == 40
    inside = h.admit(a[:30] + seq(31_000, 10))           # its match ends at 30, inside the prompt
    assert plan_of(inside).matched_tokens == 30
    assert answer_from(depth_of(30)) is None and answer_from(depth_of(46)) == 10
    assert continues_a_prompt(depth_of(30))
    h.finish(inside)
    next_turn = h.admit(a + seq(32_000, 8))              # the same conversation: prompt + a new turn
    assert plan_of(next_turn).matched_tokens == 40
    assert answer_from(depth_of(40)) is None and answer_from(depth_of(46)) == 0
    assert not continues_a_prompt(depth_of(40))
    h.finish(next_turn, output=seq(91_000, 3))
    assert answer_from(depth_of(51)) == 8                # its own answer, after its 48-token prompt
    assert continues_a_prompt(depth_of(40))             # a prompt goes on there now (the new turn's)
    h.assert_no_leak()


def test_a_shared_state_repair_is_asked_again_only_after_the_resend_delay():
    from sglang_ext.tail_replay import branch_rules

    h = Harness(1)
    a = seq(30_000, 40)
    h.run(a, {"keep_checkpoints": False})
    base = a[:36] + seq(31_000, 12)
    h.run(base)
    h.run(base + seq(32_000, 8), {"keep_checkpoints": False})
    h.run(base + seq(33_000, 8), {"keep_checkpoints": False})    # two ways below the state at 48
    asked = [record_of(h.run(base + seq(34_000 + i, 4), {"keep_checkpoints": False})).shared_repair
             for i in range(2)]
    assert asked == [48, None]
    with mock.patch.object(branch_rules.time, "monotonic",
                           return_value=branch_rules.time.monotonic() + branch_rules.SHARED_REPAIR_RESEND_S + 1):
        assert record_of(h.run(base + seq(36_000, 4), {"keep_checkpoints": False})).shared_repair == 48
    off = h.run(base + seq(37_000, 4), {"keep_checkpoints": False, "repair_shared": False})
    assert record_of(off).shared_repair is None
    h.assert_no_leak()


def test_a_state_stored_again_after_its_eviction_may_be_repaired_again():
    """The shared state at 48 is asked for, then freed under state pressure (four slots) before
    any repair; a later replay stores a new approximate state there, and the next request that
    finds the tree branching below it asks again (the mark went with the old state)."""
    h = Harness(1, mamba_size=4, max_reqs=2)
    a = seq(30_000, 40)
    h.run(a, {"keep_checkpoints": False})
    base = a[:36] + seq(31_000, 12)
    h.run(base)
    for start in (32_000, 33_000):
        h.run(base + seq(start, 8), {"keep_checkpoints": False})
    assert record_of(h.run(base + seq(34_000, 4), {"keep_checkpoints": False})).shared_repair == 48
    for start in (40_000, 50_000, 60_000, 70_000):
        h.run(seq(start, 40))                              # four new conversations: the state at 48 goes
    assert 48 not in h.state_nodes()
    again = h.run(base)                                    # a replay to 48 stores an approximate state there
    assert plan_of(again).kind is HitKind.APPROXIMATE
    state_node = next(n for n, d in h.nodes() if d == 48 and n.component_data[MAMBA].value is not None)
    assert provenance_of(state_node).state > 0 and len(state_node.children) == 3
    assert record_of(h.run(base + seq(36_000, 4), {"keep_checkpoints": False})).shared_repair == 48
    h.assert_no_leak()


# ---------------------------------------------------------------- the request record


def test_one_record_per_request_with_its_config_resolved_once():
    """Tail-Replay keeps its per-request state in one record under one attribute of `Req`, and
    resolves the request's overrides once, at its match, not again at each caching step."""
    from sglang_ext.tail_replay import RECORD_ATTR, TailReplayRequest
    from sglang_ext.tail_replay import matching as cache_module

    h = Harness(1)
    h.run(A)
    calls = []
    original = cache_module.request_overrides

    def counting(base, custom_params, *args):
        calls.append(custom_params)
        return original(base, custom_params, *args)

    with mock.patch.object(cache_module, "request_overrides", counting):
        req = h.admit(A + [7, 8], {"budget": 0.5, "min_replay_tokens": 0})
        h.chunk_checkpoint(req)   # caching between chunks ...
        h.finish(req, output=[9])   # ... and at finish read the record's config
    assert len(calls) == 1
    record = record_of(req)
    assert isinstance(record, TailReplayRequest) and getattr(req, RECORD_ATTR) is record
    assert record.config == CONFIG.replaced(budget=0.5, min_replay_tokens=0)
    assert plan_of(req) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 40, 40, 40)
    assert not [name for name in vars(req) if name.startswith("tail_replay")]   # no loose attributes
    h.assert_no_leak()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_a_match_walks_its_path_once(page):
    """The matched path is walked once per match (the branch-point track's finalizer in the tree
    core) and handed on: the planner, the tail's KV slots and the repair rules read that walk."""
    from sglang_ext.tail_replay.provenance.tree import MatchedPath

    h = Harness(page)
    h.run(A)
    h.run(A[:30] + seq(6000, 10))                      # the tree branches at 30 (28)
    fresh = []
    original = MatchedPath.walk.__func__

    def counting(cls, tree_core, node, known=None):
        path = original(cls, tree_core, node, known)
        if known is None or path.nodes[:len(known.nodes)] != known.nodes:
            fresh.append(len(path.nodes))               # walked from scratch
        return path

    with mock.patch.object(MatchedPath, "walk", classmethod(counting)):
        req = h.admit(A[:36] + seq(7000, 10), {"exactness": "exact"})
    assert len(fresh) == 1 and fresh[0] >= 2, fresh
    assert plan_of(req).matched_tokens == floor_page(36, page)
    h.finish(req)
    h.assert_no_leak()


# ---------------------------------------------------------------- fail closed


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_a_request_served_past_its_plan_inserts_untracked_kv_never_exact(page):
    """A request another wing serves after its match (LinearKV's assembly drops the Tail-Replay
    plan) computed what it inserts in a way no record tracks: its new KV and state enter the tree
    as UNTRACKED, and an exact request later reads none of it."""
    from sglang_ext.tail_replay.provenance.bounds import UNTRACKED

    h = Harness(page)
    h.run(A)
    tokens = A[:30] + seq(5000, 10)
    req = h.admit(tokens, {"exactness": "exact"})
    record_of(req).drop_plan()
    h.finish(req, output=[9])
    leaf = h.cache.tree_core.node_by_id(req.last_node)
    prov = provenance_of(leaf)
    assert prov is not None and bool((prov.kv == UNTRACKED).all()), prov
    if leaf.component_data[MAMBA].value is not None:
        assert prov.state == UNTRACKED
    again = h.admit(tokens + [9], {"exactness": "exact"})
    assert plan_of(again).matched_tokens <= floor_page(30, page)
    h.finish(again)
    h.assert_no_leak()


@pytest.mark.parametrize("dropped", [False, True])
def test_an_untracked_insert_never_relabels_an_approximate_node_on_overlap(dropped):
    """Fresh exact KV replaces an approximate node's on overlap (dropped=False); the same insert
    with its plan dropped (provenance unknown) leaves the node, and its approximate label, alone."""
    h = Harness(1)
    h.run(A)
    approx = h.run(A[:30] + seq(5000, 10))                 # its KV [30, 40) is approximate (UNKNOWN)
    node = h.cache.tree_core.node_by_id(approx.last_node)
    assert h.depth(approx.last_node) == 40 and provenance_of(node).kv_max() == UNKNOWN
    slots = node.component_data[FULL].value.tolist()
    req = h.admit(A[:30] + seq(5000, 10) + seq(8000, 4), {"exactness": "exact"})   # reads [0, 30) only
    assert plan_of(req).matched_tokens == 30
    if dropped:
        record_of(req).drop_plan()
    h.finish(req)
    prov = provenance_of(node)
    if dropped:
        assert prov.kv_max() == UNKNOWN and node.component_data[FULL].value.tolist() == slots
    else:
        assert prov is None or prov.kv is None   # the request's exact KV took the node's place
    h.assert_no_leak()


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_a_running_exact_request_never_takes_the_trees_inexact_kv_at_a_chunk_boundary(page):
    """Chunked prefill inserts a running request's KV; SGLang's insert frees the request's slots the
    tree holds already and rewrites its row to the tree's. Over an approximate node that the
    request cannot replace (another running request holds it; HiCache), an `exactness: "exact"`
    request would read that approximate KV from then on (the fuzzer's tr-nobuf / tr-nobuf-hicache
    violations: plans reading nothing inexact, answers off the no-cache server, a TAINT floor).
    It keeps its own KV instead, inserts when it finishes, and stays strictly exact."""
    h = Harness(page)
    h.run(A)
    x = seq(6000, 12)
    approx = h.admit(A[:36] + x)                    # L = 36 -> approximate; [36, 48) approximate KV
    assert plan_of(approx).kind is HitKind.APPROXIMATE
    h.chunk_checkpoint(approx)                      # published while it runs: it holds the node
    node = h.cache.tree_core.node_by_id(approx.last_node)
    assert provenance_of(node).kv_max() == UNKNOWN and h.full_lock(approx.last_node) >= 1

    tokens = A[:36] + x + seq(9000, 8)
    req = h.admit(tokens, {"exactness": "exact"})
    assert plan_of(req).matched_tokens <= 36        # the strict cut: it reads no approximate KV
    assert record_of(req).floor == 0.0
    own = h.pool.req_to_token[req.kv.req_pool_idx, 36:48].tolist()
    assert set(own).isdisjoint(node.component_data[FULL].value.tolist())
    h.chunk_checkpoint(req)
    assert h.pool.req_to_token[req.kv.req_pool_idx, 36:48].tolist() == own   # its own KV there
    assert record_of(req).floor == 0.0
    h.assert_no_leak()
    h.finish(req, output=[7])   # finished, it reads nothing more (its insert may share the node)
    h.finish(approx)
    h.assert_no_leak()


def test_kv_past_the_state_goes_first_under_a_kv_shortfall():
    """`kv_past_state.to_eviction_front` on SGLang's own tree and eviction (the default `lru`): the stateless leaf it demotes
    (as `KvPastTheState` inserts it: KV alone, past a state) is evicted before an older leaf that
    plain LRU takes first; a leaf holding a state, an inner node and the root are not moved."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    from sglang_ext.tail_replay.kv_past_state import demoted_go_first, to_eviction_front

    h = Harness(1)
    assert demoted_go_first(h.cache.tree_core)     # SGLang's default policy, `lru`
    old = h.run(seq(100, 40))                      # the older conversation, its state at its end
    base = h.run(seq(300, 40))                     # the newer one
    core = h.cache.tree_core
    state_leaf = core.node_by_id(base.last_node)
    assert state_leaf.component_data[MAMBA].value is not None and not to_eviction_front(core, state_leaf)
    # KV alone past the newer one's state, inserted last (LRU keeps it longest)
    tokens = seq(300, 40) + seq(900, 12)
    slots = torch.cat([h.cache.path_device_indices(base.last_node).to(torch.int64),
                       h.alloc.alloc(12).to(torch.int64)])
    result = h.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots, prev_prefix_len=40))
    tail = core.node_by_id(result.last_device_node)
    assert tail.component_data[MAMBA].value is None and len(tail.key) == 12
    assert not to_eviction_front(core, core.root_node) and not to_eviction_front(core, state_leaf)   # inner now
    assert to_eviction_front(core, tail)
    h.cache.evict(EvictParams(num_tokens=1))       # one KV shortfall: one leaf goes
    firsts = {int(node.key.token_ids[0]) for node, _ in h.nodes()}
    assert {100, 300} <= firsts and 900 not in firsts   # the moved tail went; the older leaf stayed
    assert old.last_node is not None
    h.assert_no_leak()
