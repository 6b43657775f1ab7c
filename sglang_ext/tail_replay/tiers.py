"""The host and storage tiers (HiCache, `--hicache-storage-backend`) under Tail-Replay (SGLang
adapter): parts of `TailReplayMambaComponent` (`HostTierRules`) and `TailReplayRadixCache`
(`HostTierCache`).

With `keep_checkpoints: false` the host tier holds attention KV only: no state is backed up,
loaded back or evicted there, and every host hit is a KV hit the planner plans over. With
checkpoints, states go to the host as on stock SGLang (written through with their node, evicted
with the host LRU), and one is loaded back only into a plan that starts from that very checkpoint
(`HostTierCache.state_load_node`): SGLang would copy the best match's host state whatever
depth the plan starts from. The storage tier (L3) stays KV-only, and gets strictly exact KV only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import (
    CacheTransferPhase,
    PrepareLoadBackResult,
    PreparePrefetchResult,
)

from sglang_ext.tail_replay.matching import MatchPlanner, tail_kv_slots
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan
from sglang_ext.tail_replay.provenance.bounds import NodeProvenance
from sglang_ext.tail_replay.provenance.tree import MatchedPath, Planned, plan_carry, provenance_of, set_provenance
from sglang_ext.tail_replay.provenance.writes import InsertContext
from sglang_ext.tail_replay.request import HostLoad, TailReplayRequest, record_of

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult


class HostTierRules:
    """The Mamba component's host-tier rules (a part of `TailReplayMambaComponent`): which of
    SGLang's host-tier steps run for states. Needs the tree core, the server config's getter (its
    `keep_checkpoints`), the cache's `state_load_node()` (the checkpoint the running load-back may
    copy) and its `inserting()` (the running insert's `InsertContext`). Each `stock` argument is SGLang's own step; the rules
    mutate nothing but what that step does (and, after an unevict, the node's provenance)."""

    def __init__(self, tree_core: Any, config: Callable[[], Any], *, state_load_node: Callable[[], Any],
                 inserting: Callable[[], InsertContext]) -> None:
        self.tree_core = tree_core
        self.config = config
        self.state_load_node = state_load_node
        self.inserting = inserting

    @property
    def host_states(self) -> bool:
        """Whether states go to the host tier (HiCache on, the server keeps checkpoints)."""
        return bool(self.tree_core.enable_hicache) and self.config().knobs.keep_checkpoints

    def needs_incremental_backup(self, node: Any, stock: Callable[[Any], bool]) -> bool:
        return self.host_states and stock(node)

    def build_hicache_transfers(self, node: Any, phase: Any, stock: Callable[..., Any], **kwargs: Any) -> Any:
        """No state transfer without host states, none to storage or from a prefetch, and a load-back
        copies only the plan's own checkpoint (`state_load_node`)."""
        if not self.host_states or phase in (CacheTransferPhase.BACKUP_STORAGE, CacheTransferPhase.PREFETCH):
            return None
        if phase == CacheTransferPhase.LOAD_BACK and node.id != self.state_load_node():
            return None
        return stock(node, phase, **kwargs)

    def prepare_load_back(self, node_id: Any, req: Any, stock: Callable[..., PrepareLoadBackResult]) -> PrepareLoadBackResult:
        if not self.host_states or node_id != self.state_load_node():
            return PrepareLoadBackResult()
        return stock(node_id, req=req)

    @staticmethod
    def prepare_prefetch() -> PreparePrefetchResult:
        """The storage tier holds no states: a prefetch brings none."""
        return PreparePrefetchResult()

    def drive_host_eviction(self, stock: Callable[[], None]) -> None:
        if self.host_states:
            stock()

    def after_unevict(self, node: Any, total_prefix_len: int) -> None:
        """An insert gave a host-only node the request's fresh device KV (SGLang's unevict), and
        its host copy stays the node's too: the node's bounds become the larger of the two
        per token. May mutate: the node's provenance."""
        ours = self.inserting().bounds(total_prefix_len, total_prefix_len + len(node.key))
        prov = provenance_of(node) or NodeProvenance()
        kv = ours if prov.kv is None else torch.maximum(prov.kv, ours)
        set_provenance(node, NodeProvenance(kv, prov.state))


class HostTierCache:
    """The cache's host and storage tiers: plans that read the host tier, their load-back, the
    storage prefetch probe and the storage write. Needs the SGLang cache (its tree core, storage
    flag, root handles) and the match planner (path walks and splits, the start state's touch).
    May mutate: `state_load_node`, request records, the tree (a split at a plan's load end)."""

    def __init__(self, cache: Any, planner: MatchPlanner) -> None:
        self.cache = cache
        self.planner = planner
        #: HiCache: the node whose host state the running load-back may copy into its request (the
        #: checkpoint its plan starts from), else None: no host state is copied
        self.state_load_node: Any = None

    def is_storage_probe(self, params: MatchPrefixParams) -> bool:
        """SGLang's storage (L3) prefetch matches the request without a state copy
        (`Scheduler._prefetch_kvcache`: cow_mamba False) to learn where the tree's KV ends on
        device + host: it fetches the pages after that and inserts them under the matched node.
        That match must be the tree's own, not a plan's prefix: a plan's prefix ends up to W tokens
        short of the node it returns, so the fetch would look its pages up under keys chained from
        the wrong depth and find nothing (and graft anything found at the wrong depth). The
        request's record is left alone: its plan is made by the admission's match."""
        return self.cache.enable_storage and not params.cow_mamba

    def stores(self, node_id: Any) -> bool:
        """The storage tier (L3) gets strictly exact KV only. Its pages carry no provenance, so the
        server that prefetches them (this one after a restart, or another one) reads them as exact
        computations. A node whose path holds KV of bound > 0 stays on the device and host tiers
        (so do its descendants: a storage hit is a contiguous prefix from the root)."""
        prov = self.planner.path_provenance(node_id)
        return prov.first_inexact >= prov.matched

    def state_on_host(self, planned: Planned) -> bool:
        """Whether the plan starts from a checkpoint whose state is on the host only."""
        if not planned.plan.from_checkpoint:
            return False
        node = self.cache.tree_core.node_by_id(planned.start_state.node_id)
        return node.component_data[ComponentType.MAMBA].value is None

    def apply_host_plan(self, req: Any, record: TailReplayRequest, result: MatchResult,
                         planned: Planned) -> MatchResult:
        """A plan that reads the host tier: its prefix reaches past the device hit into host KV,
        or it starts from a checkpoint whose state is on the host only. SGLang's load-back (at
        admission, `init_load_back`) loads the path down to `load_end` (the tail too, when the plan
        reads the tail's KV from the tree or keeps its own recomputed tail: the path stays locked
        below it) and the checkpoint's state into the request's slot, and adds `host_hit_length`
        to the device prefix; the tail's KV slots are read after the load."""
        plan, start_state, prov, last_node, path = planned
        config = record.config
        self.planner.touch_start_state(planned)
        load_end = plan.matched_tokens if plan.reuses_tail_kv else plan.prefix_len
        target = self.planner.node_at_depth(path, load_end)
        device_len, device_node = result.device_prefix_len, result.last_device_node
        if load_end <= device_len:
            # only the state is on the host (its KV is on the device): SGLang counts the checkpoint
            # node's own KV as loaded, so that a load-back that loads nothing is seen (the count
            # falls short of the promise) and the request is admitted again as a miss
            checkpoint = self.cache.tree_core.node_by_id(target)
            device_len, device_node = plan.prefix_len - len(checkpoint.key), checkpoint.parent.id
        state_node = start_state.node_id if self.state_on_host(planned) else None
        record.set_plan(plan, *plan_carry(plan, start_state, prov, config.knobs.kv_mode),
                        host_load=HostLoad(device_len, plan.prefix_len, load_end, state_node))
        return result._replace(device_prefix_len=device_len, last_device_node=device_node,
                               last_host_node=target, best_match_node=target,
                               host_hit_length=plan.prefix_len - device_len,
                               mamba_host_hit_length=1 if state_node is not None else 0)

    def init_load_back(self, params: Any, stock: Callable[[Any], Any]) -> Any:
        """SGLang's load-back of host-tier KV at admission; for a host plan, the count it reports is
        the plan's prefix growth (SGLang adds it to the request's prefix), and the tail's KV slots
        are read off the loaded path. SGLang loads all of it or nothing: if nothing was loaded (the
        count falls short of the promise, so SGLang admits the request again from its prefix), the
        request is served as a miss (exact; the tree is unchanged)."""
        req = params.req
        record = record_of(req) if req is not None else None
        host = record.take_host_load() if record is not None else None
        if host is None:
            return stock(params)
        self.state_load_node = host.state_node
        try:
            loaded = stock(params)
        finally:
            self.state_load_node = None
        if loaded is None:
            return None
        count, node = loaded
        core = self.cache.tree_core
        state_loaded = host.state_node is None or \
            core.node_by_id(host.state_node).component_data[ComponentType.MAMBA].value is not None
        if count == host.load_end - host.device_len and state_loaded:
            path = MatchedPath.walk(core, core.node_by_id(node))   # the loaded path
            record.loaded(tail_kv_slots(record.plan, record.config.knobs.kv_mode, path))
            if host.state_node is not None:   # the request's slot holds the checkpoint's state now
                req.kv.mamba_cow_src_index, req.kv.mamba_needs_clear = None, False
            return host.prefix_len - host.device_len, node
        miss = ReplayPlan(HitKind.MISS, record.plan.matched_tokens, 0, 0)
        record.set_plan(miss)
        req.prefix_len = 0
        if req.kv.holds_mamba:
            req.kv.mamba_cow_src_index, req.kv.mamba_needs_clear = None, True
        return 0, self.cache.root_node_handle(req.extra_key)
