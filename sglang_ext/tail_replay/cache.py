"""SGLang adapter: a UnifiedRadixCache whose Mamba component lets matches run as deep as the
attention KV, and a planner decision per request (`--radix-cache-backend tail_replay`).

What changes against SGLang 0.5.23's `UnifiedRadixCache` + `MambaComponent`:
- match: every node is valid for the Mamba component, so a hit is as long as the full-attention
  KV hit (L). The planner then sets the request's prefix length: a checkpoint at C (exact), or
  L - W with a zeroed linear state (approximate), or 0.
- provenance (`tail_replay.provenance`): every node the tree gets from a request carries the bound
  of its KV per token, every stored state its bound; approximate end states are stored too (with
  their bound: a conversation's next turn resumes from them), and fresh KV of a smaller bound
  replaces an approximate node's on insert (where no request holds that node).
- shared-state repair (`tail_replay.repair`): a request whose matched path ends its states at an
  approximate one that conversations branch from asks for that state's exact recomputation.
- caching: with keep_checkpoints=False no state is inserted; the attention KV always is.
The per-request decision goes into the request's record (`tail_replay.request`): its config
(resolved once, at the first match), the plan (a ReplayPlan) and, for exact-KV replay, `kv_slots`:
the tree's KV slots of the replayed tail, read by `patches/tail_replay_batch.py` /
`tail_replay_attention.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.cache_action import FreeDeviceKV
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import (
    CacheTransferPhase,
    EvictLayer,
    LRURefreshPhase,
    PrepareLoadBackResult,
    PreparePrefetchResult,
    TreeComponent,
)
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_exec, mamba_cache_chunk_size, mamba_checkpoint_grid

from sglang_ext.tail_replay import own_tail, provenance
from sglang_ext.tail_replay.config import BACKEND_NAME, TailReplayConfig, request_overrides, server_config
from sglang_ext.tail_replay.metrics import record_stored_bound
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan, plan_replay
from sglang_ext.tail_replay.provenance import CarryBound, NodeProvenance, PathProvenance
from sglang_ext.tail_replay.repair import SHARED_REPAIR_RESEND_S, branch_repair_due, shared_repair_due
from sglang_ext.tail_replay.request import HostLoad, TailReplayRequest, attach, bounds_of, computed_from, plan_of, record_of

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult

__all__ = ["BACKEND_NAME", "TailReplayRadixCache", "TailReplayMambaComponent", "tail_replay_cache_factory",
           "provenance_of"]

#: the attribute of a tree node holding its NodeProvenance (absent: strictly exact)
PROVENANCE_ATTR = "sglang_ext_provenance"
#: the attribute of a tree node whose state's shared-state repair was asked for: when (monotonic s;
#: removed when the node takes another state)
_SHARED_REPAIR_ATTR = "sglang_ext_shared_repair_at"
#: the attribute of a tree node whose tokens from this offset on are the generated answer of the
#: request that inserted it (absent: prompt tokens only, or inserted without a request)
_ANSWER_FROM_ATTR = "sglang_ext_answer_from"


def answer_from(node: Any) -> int | None:
    """Where, within a tree node's tokens, the inserting request's generated answer begins (None:
    none of them is one)."""
    return getattr(node, _ANSWER_FROM_ATTR, None)


def provenance_of(node: Any) -> NodeProvenance | None:
    """A tree node's provenance, or None (strictly exact KV, and state if it holds one)."""
    return getattr(node, PROVENANCE_ATTR, None)


def _set_provenance(node: Any, prov: NodeProvenance | None) -> None:
    if prov is not None and prov.kv is not None and not bool((prov.kv > 0).any()):
        prov = NodeProvenance(None, prov.state)
    if prov is None or (prov.kv is None and prov.state == 0.0):
        if hasattr(node, PROVENANCE_ATTR):
            delattr(node, PROVENANCE_ATTR)
        return
    setattr(node, PROVENANCE_ATTR, prov)


def request_config(base: TailReplayConfig, req: Any) -> TailReplayConfig:
    """The server's config with the request's `custom_params["tail_replay"]` overrides
    (validated when the request arrived, see patches/tail_replay_request.py). Resolved once per
    request: `record_for` keeps the result on the request's record."""
    return request_overrides(base, getattr(req.sampling_params, "custom_params", None))


def record_for(base: TailReplayConfig, req: Any) -> TailReplayRequest:
    """The request's record; created, with its config resolved, on first use."""
    record = record_of(req)
    return record if record is not None else attach(req, request_config(base, req))


class TailReplayMambaComponent(MambaComponent):
    """Mamba component that never limits a match and stores only exact states."""

    def __init__(self, cache, params):
        # MambaComponent asserts page_size == 1 without the extra buffer, because only a
        # sequence-end state exists there. Tail-Replay reuses page-aligned prefixes without
        # any state, so it keeps the rest of the setup and drops that check.
        TreeComponent.__init__(self, cache, params)
        self.mamba_cache_chunk_size = mamba_cache_chunk_size()
        self.mamba_checkpoint_grid = mamba_checkpoint_grid(params.page_size)
        self.mamba_max_states_per_path = get_exec().mamba.mamba_max_states_per_path
        self._mamba_pool_host = None

    @property
    def config(self) -> TailReplayConfig:
        return self.cache.tail_replay_config

    def create_match_validator(self, match_device_only: bool = False) -> Callable[[Any], bool]:
        return lambda node: True

    def finalize_match_result_in_tree_core(self, result, params, value_chunks, best_value_len):
        """SGLang's branch-point checkpoint (extra_buffer): the request tracks its state at the end
        of the KV match (on the checkpoint grid) when no state sits that deep, so the next request
        that branches there resumes from a state, as on stock SGLang (whose match ends at the
        deepest state; here it runs as deep as the KV). The state is stored with the request's
        bound there (exact, or approximate).

        The match counts only as deep as KV stock SGLang would still hold (`_kept_by_stock`):
        a branch-point state is tracked in place of the request's own deepest state, and the
        request's insert then stops there (the extra buffer inserts up to the tracked state).
        Where the match runs into KV whose state was freed and below which no state is left
        (stock drops such a path with its last state; here state pressure keeps the KV), the
        request is not branching off anything: it tracks, and inserts, as deep as its own
        prompt, as on stock."""
        if params.req is not None and record_for(self.config, params.req).config.repair_kind == "shared_state":
            return result._replace(mamba_branching_seqlen=None)   # the run keeps its end state only
        node, depth, state_depth = result.last_device_node, result.device_prefix_len, 0   # a node here, not an id
        while node is not None and node is not self.tree_core.root_node:
            if node.component_data[self.component_type].value is not None:
                state_depth = depth
                break
            depth -= len(node.key)
            node = node.parent
        grid = self.mamba_checkpoint_grid
        aligned = result.full_kv_hit_length // grid * grid
        if aligned > state_depth and not result.host_hit_length:   # only then can the part stock holds matter
            aligned = self._depth_kept_by_stock(result) // grid * grid
        return result._replace(mamba_branching_seqlen=aligned if aligned > state_depth else None)

    def _depth_kept_by_stock(self, result) -> int:
        """How deep the match runs in KV stock SGLang would still hold: up to the deepest matched
        node `_kept_by_stock` (the deepest state on the path is one). Reads only."""
        node, depth, below = result.last_device_node, result.device_prefix_len, None
        while node is not None and node is not self.tree_core.root_node:
            if self._kept_by_stock(node, below):
                return depth + (result.full_kv_hit_length - result.device_prefix_len)
            below = node
            depth -= len(node.key)
            node = node.parent
        return depth

    def _kept_by_stock(self, node: Any, known_stateless: Any = None) -> bool:
        """Whether stock SGLang would still hold `node`'s KV: a state (device or host) sits on it
        or somewhere below it (stock frees a leaf whole with its state, and then the KV-only
        nodes that become leaves). `known_stateless`: a child already searched. Reads only."""
        ct = self.component_type
        stack = [node]
        while stack:
            n = stack.pop()
            data = n.component_data[ct]
            if data.value is not None or data.host_value is not None:
                return True
            stack.extend(c for c in n.children.values() if c is not known_stateless)
        return False

    def finalize_match_result_in_cache(self, params, result):
        plan = plan_of(params.req) if params.req is not None else None
        if plan is None or plan.from_checkpoint:
            return super().finalize_match_result_in_cache(params, result)
        if params.cow_mamba and params.req.kv.holds_mamba:
            params.req.kv.mamba_cow_src_index = None
            params.req.kv.mamba_needs_clear = True   # replay starts from the zero state
        return result

    def _stores_state(self, req: Any, token_ids_len: int) -> bool:
        """States, exact or approximate (with their bound, see `commit_insert_component_data`),
        where the tree can hold them: without the extra buffer the state is the sequence-end state,
        and the key is cut to whole pages on insert."""
        record = record_for(self.config, req)
        lands_on_its_depth = self.cache.enable_mamba_extra_buffer or token_ids_len % self.cache.page_size == 0
        return record.config.keep_checkpoints and lands_on_its_depth

    def prepare_for_caching_req(self, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> int:
        withheld = not self._stores_state(req, token_ids_len)
        record_for(self.config, req).state_withheld = withheld
        if not withheld:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        insert_params.mamba_value = None   # the attention KV is still inserted in full
        return token_ids_len

    def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
        """The new leaf's KV gets the inserting request's bounds at its positions, and a mark where
        the request's generated answer begins in it (`answer_from`); a state the tree takes gets
        the request's bound at its depth. An existing state of a larger bound is replaced by the
        request's (unless locked). May mutate: the node's provenance, answer mark and state, its
        shared-state repair mark (cleared when it takes a state)."""
        record = self.cache.inserting_record()
        depth = result.prefix_len + (len(node.key) if is_new_leaf else 0)
        if is_new_leaf:
            prompt_len = self.cache.inserting_prompt_len()
            if prompt_len is not None and prompt_len < depth:
                setattr(node, _ANSWER_FROM_ATTR, max(prompt_len - result.prefix_len, 0))
            kv = bounds_of(record, result.prefix_len, depth)
            _set_provenance(node, NodeProvenance(kv, 0.0))
            record_stored_bound("kv", float(kv.max()) if kv.numel() else 0.0)
        if params.mamba_value is None:
            return
        state_bound = float(bounds_of(record, depth - 1, depth)[0]) if depth > 0 else 0.0
        cd = node.component_data[self.component_type]
        old = provenance_of(node)
        if not is_new_leaf and cd.value is not None and old is not None and old.state > state_bound \
                and cd.lock_ref == 0 and cd.host_value is None:
            self._free_mamba_value(cd.value)   # the tree's state was worse: take the request's
            cd.value = params.mamba_value
            self.tree_core.lru_lists[self.component_type].reset_node_mru(node)
        else:
            had_state = cd.value is not None
            super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
            if had_state:
                return   # the tree keeps its own state (and its bound)
            if cd.host_value is not None and old is not None:
                state_bound = max(state_bound, old.state)   # the host copy is the node's state too
        if hasattr(node, _SHARED_REPAIR_ATTR):
            delattr(node, _SHARED_REPAIR_ATTR)   # another state: a repair may be asked for it
        prov = provenance_of(node) or NodeProvenance()
        _set_provenance(node, NodeProvenance(prov.kv, state_bound))
        record_stored_bound("state", state_bound)

    def redistribute_on_node_split(self, new_parent, child):
        """Each half keeps its own tokens' bounds and answer mark; the state (at the child's end)
        its bound."""
        super().redistribute_on_node_split(new_parent, child)
        prov = provenance_of(child)
        if prov is not None:
            head, rest = prov.split(len(new_parent.key))
            _set_provenance(new_parent, head)
            _set_provenance(child, rest)
        mark = answer_from(child)
        if mark is not None:
            if mark < len(new_parent.key):
                setattr(new_parent, _ANSWER_FROM_ATTR, mark)
                setattr(child, _ANSWER_FROM_ATTR, 0)
            else:
                setattr(child, _ANSWER_FROM_ATTR, mark - len(new_parent.key))

    def update_component_on_insert_overlap(self, node, prefix_len, total_prefix_len, value_slice, params,
                                           result, cache_actions):
        """Fresh KV of a smaller bound replaces an approximate node's: the node takes the request's
        slots and its own are freed, where no request holds the node (else the request reads the
        node's KV from now on, and carries its taint). Only over a node wholly past what the
        request already shares with the tree. May mutate: the node's KV value and provenance, the
        inserting request's floor."""
        consumed = super().update_component_on_insert_overlap(
            node, prefix_len, total_prefix_len, value_slice, params, result, cache_actions)
        prov = provenance_of(node)
        record = self.cache.inserting_record()
        if prov is None or prov.kv is None or params.prev_prefix_len > total_prefix_len \
                or total_prefix_len < computed_from(record):
            return consumed
        ours = bounds_of(record, total_prefix_len, total_prefix_len + prefix_len)
        if not bool((ours < prov.kv[:prefix_len]).any()) or float(ours.max()) > prov.kv_max():
            return consumed
        full = node.component_data[ComponentType.FULL]
        if full.lock_ref > 0 or self.tree_core.enable_hicache or prefix_len != len(node.key):
            if record is not None:
                record.floor = max(record.floor, provenance.TAINT)
            return consumed
        cache_actions.append(FreeDeviceKV([full.value]))
        full.value = value_slice.clone()
        _set_provenance(node, NodeProvenance(ours, prov.state))
        return 0   # the request's slots are the node's now: none of them is a duplicate

    # HiCache. With `keep_checkpoints: false` the host tier holds attention KV only: no state is
    # backed up, loaded back or evicted there, and every host hit is a KV hit the planner plans
    # over. With checkpoints, states go to the host as on stock SGLang (written through with their
    # node, evicted with the host LRU), and one is loaded back only into a plan that starts from
    # that very checkpoint (`TailReplayRadixCache.state_load_node`): SGLang would copy the best
    # match's host state whatever depth the plan starts from. The storage tier (L3) stays KV-only.
    @property
    def host_states(self) -> bool:
        """Whether states go to the host tier (HiCache on, the server keeps checkpoints)."""
        return bool(self.tree_core.enable_hicache) and self.config.keep_checkpoints

    def needs_incremental_backup(self, node: Any) -> bool:
        return self.host_states and super().needs_incremental_backup(node)

    def build_hicache_transfers(self, node: Any, phase: Any, **kwargs: Any) -> Any:
        if not self.host_states or phase in (CacheTransferPhase.BACKUP_STORAGE, CacheTransferPhase.PREFETCH):
            return None
        if phase == CacheTransferPhase.LOAD_BACK and node.id != self.cache.state_load_node:
            return None
        return super().build_hicache_transfers(node, phase, **kwargs)

    def prepare_load_back(self, node_id: Any, *, req: Any = None) -> PrepareLoadBackResult:
        if not self.host_states or node_id != self.cache.state_load_node:
            return PrepareLoadBackResult()
        return super().prepare_load_back(node_id, req=req)

    def prepare_prefetch(self, node_id: Any, *, prefetch_tokens: int = 0) -> PreparePrefetchResult:
        return PreparePrefetchResult()

    def drive_host_eviction(self, num_tokens, tracker, device_frees, host_frees, cache_actions) -> None:
        if self.host_states:
            super().drive_host_eviction(num_tokens, tracker, device_frees, host_frees, cache_actions)

    def recover_after_unevict(self, node, prefix_len, total_prefix_len, params, result, cache_actions) -> None:
        """An insert gave a host-only node the request's fresh device KV (SGLang's unevict), and
        its host copy stays the node's too: the node's bounds become the larger of the two
        per token. May mutate: the node's provenance."""
        super().recover_after_unevict(node, prefix_len, total_prefix_len, params, result, cache_actions)
        ours = bounds_of(self.cache.inserting_record(), total_prefix_len, total_prefix_len + len(node.key))
        prov = provenance_of(node) or NodeProvenance()
        kv = ours if prov.kv is None else torch.maximum(prov.kv, ours)
        _set_provenance(node, NodeProvenance(kv, prov.state))

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        """State pressure frees states, never attention KV.

        SGLang's walk over the state LRU hands back a whole device leaf (its attention KV too)
        when the least recently used state sits on a leaf, because without Tail-Replay a leaf's KV
        is useless once its state is gone. Here the KV is what makes a hit, so every state is freed
        the way SGLang already frees states on inner nodes: the state alone; the node, its KV and
        its place in the KV eviction order stay. Locked states (a running request's checkpoint,
        the one a planned exact-checkpoint hit is about to copy) are skipped by the LRU walk.
        With HiCache the same holds: a state with a host copy lives on there (SGLang's host LRU
        takes it), one without is gone, as any device state SGLang frees.

        May mutate: this component's walk cursor, the victim's state value and LRU membership,
        `tracker`, `device_frees`.
        """
        if tracker[self.component_type] >= self._evict_device_request_cnt:
            return None
        victim = self._next_state_victim()
        if victim is None:
            return None
        self.tree_core._evict_component_and_detach_lru(
            victim, self, target=EvictLayer.DEVICE, tracker=tracker, device_frees=device_frees,
            host_frees=host_frees, cache_actions=cache_actions)
        self.tree_core._update_evictable_leaf_sets(victim)
        return None

    def _next_state_victim(self) -> Any:
        """The next unlocked device state to free in this walk, or None: SGLang's order, least
        recently used first (with the session radix cache, its partitioned cursor). The one
        place a policy may reorder states (`--radix-eviction-policy sae` does, see
        patches/sae_state_eviction.py). May mutate: the walk cursor."""
        lru = self.tree_core.lru_lists[self.component_type]
        by_session = self.tree_core.enable_session_radix_cache
        goes_first = self._goes_first.get(self.config.state_order)
        if goes_first is not None and not by_session:
            victim = self._first_unlocked_state(lru, goes_first)
            if victim is not None:
                return victim
        if self._evict_device_cursor is not None and not lru.in_list(self._evict_device_cursor):
            self._evict_device_cursor = lru.cursor_next() if by_session else lru.get_lru_no_lock()
        victim = self._evict_device_cursor
        if victim is None or not lru.in_list(victim):
            return None
        # step on now: freeing the victim unlinks it, the cursor (or its sentinel) stays put
        self._evict_device_cursor = lru.cursor_next() if by_session else lru.get_prev_no_lock(victim)
        return victim

    def _first_unlocked_state(self, lru: Any, goes_first: Callable[[Any, Any], bool]) -> Any:
        """The least recently used unlocked state whose node `goes_first(self, node)`, or None
        (then SGLang's order runs). Reads only."""
        node = lru.get_lru_no_lock()
        while node is not None:
            data = node.component_data[self.component_type]
            if data.value is not None and data.lock_ref == 0 and goes_first(self, node):
                return node
            node = lru.get_prev_no_lock(node)
        return None

    def _is_superseded(self, node: Any) -> bool:
        """State order "ends": its conversation has moved past this state (the node continues in
        exactly one child, and a state sits further down that single line before any branch).
        Conversation ends (leaves) and branch points (two children or more) are kept."""
        return _continues_to_a_state(node, self.component_type)

    def _is_approximate(self, node: Any) -> bool:
        """State order "approximate_first": the state does not count as exact (its bound above
        `exact_threshold`), so exact states (the ones stock SGLang would hold and serve exact hits
        from) outlive approximate ones."""
        prov = provenance_of(node)
        return prov is not None and not provenance.counts_exact(prov.state, self.config.exact_threshold)

    #: `state_order` -> which states go first under state pressure (then least recently used)
    _goes_first: dict[str, Callable[[Any, Any], bool]] = {"ends": _is_superseded, "approximate_first": _is_approximate}

    def cleanup_after_caching_req(self, req: Any, is_finished: bool, insert_result: Any = None,
                                  insert_params: Any = None) -> None:
        record = record_of(req)
        withheld = record is not None and record.state_withheld
        if record is not None:
            record.state_withheld = False
        if withheld and is_finished:
            self.cache.req_to_token_pool.free_mamba_cache(req)   # the request's state dies with it
            return
        super().cleanup_after_caching_req(req, is_finished, insert_result, insert_params)


class TailReplayRadixCache(UnifiedRadixCache):
    tail_replay_config: TailReplayConfig = TailReplayConfig()
    #: HiCache: the node whose host state the running load-back may copy into its request (the
    #: checkpoint its plan starts from), else None: no host state is copied
    state_load_node: Any = None
    #: the record of the request whose `checkpoint_into_tree` is running (None: an insert without
    #: a request, whose KV counts as exact)
    _inserting: TailReplayRequest | None = None
    #: the prompt length of the request whose `checkpoint_into_tree` is running (None: no request)
    _inserting_prompt: int | None = None

    def inserting_record(self) -> TailReplayRequest | None:
        return self._inserting

    def inserting_prompt_len(self) -> int | None:
        return self._inserting_prompt

    def _finalize_match_result(self, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        if params.req is not None and not self._is_storage_probe(params):
            result = self._apply_replay_plan(params.req, result)
        return super()._finalize_match_result(params, result)

    def _is_storage_probe(self, params: MatchPrefixParams) -> bool:
        """SGLang's storage (L3) prefetch matches the request without a state copy
        (`Scheduler._prefetch_kvcache`: cow_mamba False) to learn where the tree's KV ends on
        device + host: it fetches the pages after that and inserts them under the matched node.
        That match must be the tree's own, not a plan's prefix: a plan's prefix ends up to W tokens
        short of the node it returns, so the fetch would look its pages up under keys chained from
        the wrong depth and find nothing (and graft anything found at the wrong depth). The
        request's record is left alone: its plan is made by the admission's match."""
        return self.enable_storage and not params.cow_mamba

    def write_backup_storage(self, node_id: Any) -> None:
        """The storage tier (L3) gets strictly exact KV only. Its pages carry no provenance, so the
        server that prefetches them (this one after a restart, or another one) reads them as exact
        computations. A node whose path holds KV of bound > 0 stays on the device and host tiers
        (so do its descendants: a storage hit is a contiguous prefix from the root)."""
        prov = self.path_provenance(node_id)
        if prov.first_inexact < prov.matched:
            return
        super().write_backup_storage(node_id)

    def _path(self, node_id) -> list[Any]:
        """The matched path's nodes, root first (root excluded)."""
        core = self.tree_core
        node, root = core.node_by_id(node_id), core.root_node
        path = []
        while node is not root and node is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def path_provenance(self, node_id) -> PathProvenance:
        """Provenance of the path from the root to `node_id` (its KV bounds and its states: on the
        device, and on the host where states go there)."""
        host = self.components[ComponentType.MAMBA].host_states
        return provenance.path_provenance([
            (len(n.key), provenance_of(n), _holds_state(n, host), n.id) for n in self._path(node_id)])

    def _state_on_host(self, planned: _Planned) -> bool:
        """Whether the plan starts from a checkpoint whose state is on the host only."""
        if not planned.plan.from_checkpoint:
            return False
        node = self.tree_core.node_by_id(planned.start_state.node_id)
        return node.component_data[ComponentType.MAMBA].value is None

    def _node_at_depth(self, node_id, depth: int) -> Any:
        """The id of the path's node that ends at `depth` (page-aligned), splitting the node that
        spans it; the root for 0."""
        if depth == 0:
            return self.tree_core.root_node.id
        end = 0
        for node in self._path(node_id):
            end += len(node.key)
            if end == depth:
                return node.id
            if end > depth:
                head, action = self.tree_core._split_node(node.key, node, len(node.key) - (end - depth))
                if action is not None:   # HiCache: a pending write-through follows the split
                    self._apply_cache_actions([action])
                return head.id
        return node_id

    def _plan(self, record: TailReplayRequest, matched: int, last_node: Any) -> _Planned:
        """The plan over the path's first `matched` tokens (`last_node` ends there). Reads the tree;
        may split the node at the strict mode's cut."""
        config = record.config
        prov = self.path_provenance(last_node)
        if config.strict and prov.first_inexact < matched:   # read only strictly exact KV
            matched = prov.first_inexact // self.page_size * self.page_size
            last_node = self._node_at_depth(last_node, matched)
        exact_state = prov.deepest_exact_state(config.threshold, config.strict)
        approx_state = None if config.strict else prov.deepest_approximate_state(config.threshold)
        plan = plan_replay(matched, exact_state.depth if exact_state else None, self.page_size, config,
                           (approx_state.depth, approx_state.bound) if approx_state else None)
        start_state = exact_state if plan.kind is HitKind.EXACT_CHECKPOINT else approx_state
        return _Planned(plan, start_state, prov, last_node)

    def _apply_replay_plan(self, req: Any, result: MatchResult) -> MatchResult:
        """Plan the request's hit; SGLang's match result is rewritten to the plan's prefix. With
        HiCache, the host tier is used where it makes the prefix longer (the plan then runs over
        the device + host KV hit) or holds the state a checkpoint plan starts from; SGLang's
        load-back brings what the plan reads to the device before the forward (`init_load_back`)."""
        record = record_for(self.tail_replay_config, req)
        device_len = result.device_prefix_len
        record.host_load = None
        if result.host_hit_length > 0:
            planned = self._plan(record, device_len + result.host_hit_length, result.best_match_node)
            if planned.plan.prefix_len > device_len:
                self._note_shared_repair(record, planned, len(req.origin_input_ids))
                return self._apply_host_plan(req, record, result, planned)
        planned = self._plan(record, device_len, result.last_device_node)
        self._note_shared_repair(record, planned, len(req.origin_input_ids))
        if self._state_on_host(planned):
            return self._apply_host_plan(req, record, result, planned)
        plan, start_state, prov, last_node = planned
        config = record.config
        self._touch_start_state(planned)
        record.set_plan(plan, *_carry(plan, start_state, prov, config.kv_mode))
        record.kv_slots = self._tail_kv_slots(plan, config, last_node)
        own_tail.begin(record, plan, config.kv_mode)   # recompute: the request keeps its tail KV
        if plan.from_checkpoint:
            last_node = start_state.node_id
        elif plan.kind is HitKind.MISS:
            last_node = self.root_node_handle(req.extra_key)
        return result._replace(device_prefix_len=plan.prefix_len, last_device_node=last_node,
                               last_host_node=last_node, best_match_node=last_node,
                               host_hit_length=0, mamba_host_hit_length=0)

    def _touch_start_state(self, planned: _Planned) -> None:
        """The state a plan resumes from becomes the most recently used one, as on stock SGLang,
        whose match touches the state it ends at because that is the state the request copies.
        Here the match runs to the end of the KV (`create_match_validator` accepts every node), so
        SGLang's touch lands on whatever state sits there, or on none; a state the plan resumes
        from above it (an exact state below a deeper approximate one, a branch-point state) would
        otherwise age as if unused and go first under state pressure. SGLang's own touch (the Mamba
        component's `refresh_lru` at `MATCH_END`) is applied to that state. May mutate: the device
        state LRU's order (nothing when the state is on the host only)."""
        if planned.plan.from_checkpoint:
            node = self.tree_core.node_by_id(planned.start_state.node_id)
            self.components[ComponentType.MAMBA].refresh_lru(LRURefreshPhase.MATCH_END, node, self.root_node)

    def _note_shared_repair(self, record: TailReplayRequest, planned: _Planned, prompt_len: int) -> None:
        """Shared-state repair (tail_replay/repair.py); asks at most once per request (an ask made
        at an earlier match of the same request, one that waited for room, stands until it is
        sent with the request's first output, `patches/tail_replay_meta.py`). Two rules:

        - at the branch (`branch_repair_due`): under the extra buffer (stock SGLang keeps a state
          where a request branches off the tree), a request whose plan is approximate and whose
          match ends where the tree goes on and its prompt goes on differently asks for the exact
          state at the checkpoint-grid depth below its match (`_branch_repair_depth`), where stock
          SGLang's miss would have kept it, so that the next conversation that branches there
          resumes exactly, as on stock.
        - below a shared approximate state (`shared_repair_due`): when the matched path's deepest
          state does not count as exact and conversations branch from it (the tree branches below
          its node before any other state, `_branches_below`), the request asks for its repair.
          The repair run's exact state lands at its end, or under the extra buffer on the
          checkpoint grid below it.

        Once an exact state sits as deep as a repair's would land, nothing is asked. Once per
        node: the node the state lands on is marked when asked, and asked again only after
        `SHARED_REPAIR_RESEND_S` (if the repair never landed); a state stored on the node clears
        the mark (`commit_insert_component_data`). May mutate: the record's `shared_repair`, a
        node's mark, the tree's node boundaries (the node at the branch rule's depth is split
        off, so that the mark sits where the state will land)."""
        if record.shared_repair is not None:
            return
        depth = self._branch_repair_depth(record, planned, prompt_len)
        if depth is not None:
            node = self.tree_core.node_by_id(self._node_at_depth(planned.last_node, depth))
        else:
            prov = planned.prov
            if not prov.states:
                return
            deepest = prov.states[0]
            node = self.tree_core.node_by_id(deepest.node_id)
            if not shared_repair_due(record.config, bound=deepest.bound,
                                     branches=_branches_below(node, ComponentType.MAMBA)):
                return
            grid = self._repair_grid()
            lands = deepest.depth // grid * grid
            if lands == 0 or self._exact_state_as_deep(record, prov, lands):
                return   # nothing to land, or it has landed: an exact state as deep as a repair's would be
            depth = deepest.depth
        now = time.monotonic()
        if now - getattr(node, _SHARED_REPAIR_ATTR, -math.inf) < SHARED_REPAIR_RESEND_S:
            return
        setattr(node, _SHARED_REPAIR_ATTR, now)
        record.shared_repair = depth

    def _repair_grid(self) -> int:
        """Where a repair run's state lands below its end: the extra buffer's checkpoint grid (its
        end state without the extra buffer)."""
        return self.components[ComponentType.MAMBA].mamba_checkpoint_grid if self.enable_mamba_extra_buffer else 1

    @staticmethod
    def _exact_state_as_deep(record: TailReplayRequest, prov: PathProvenance, depth: int) -> bool:
        exact = prov.deepest_exact_state(record.config.exact_threshold, strict=False)
        return exact is not None and exact.depth >= depth

    def _branch_repair_depth(self, record: TailReplayRequest, planned: _Planned, prompt_len: int) -> int | None:
        """The branch rule of `_note_shared_repair`: the depth of the exact state to ask for (the
        match's end on the checkpoint grid), or None. Only where the repair run keeps a state
        there (the extra buffer, on a server that keeps checkpoints). The tree branches at the
        match's end when the matched path goes on past it (SGLang's match splits the node it ends
        in, so the last matched node has children) and so does the request's prompt (its match did
        not stop at the end of what SGLang matches: the prompt but its last token, in whole
        pages), and a path going on past it is another request's prompt (`_continues_a_prompt`):
        where every path going on is an earlier request's generated answer, the request is that
        conversation's next turn (or a retry), which branches off its own history, not off a
        prefix that conversations share (its own states are `repair: true`'s). Reads only."""
        plan = planned.plan
        matched, approximate = plan.matched_tokens, not plan.state_is_exact
        # the children are scanned last, and only for an approximate plan (this runs at every match)
        branches_here = (approximate and 0 < matched < (prompt_len - 1) // self.page_size * self.page_size
                         and _continues_a_prompt(self.tree_core.node_by_id(planned.last_node)))
        keeps = self.enable_mamba_extra_buffer and self.tail_replay_config.keep_checkpoints
        if not branch_repair_due(record.config, approximate=approximate, branches_here=branches_here,
                                 keeps_branch_states=keeps):
            return None
        grid = self._repair_grid()
        depth = matched // grid * grid
        if depth == 0 or self._exact_state_as_deep(record, planned.prov, depth):
            return None
        return depth

    def _apply_host_plan(self, req: Any, record: TailReplayRequest, result: MatchResult,
                         planned: _Planned) -> MatchResult:
        """A plan that reads the host tier: its prefix reaches past the device hit into host KV,
        or it starts from a checkpoint whose state is on the host only. SGLang's load-back (at
        admission, `init_load_back`) loads the path down to `load_end` (the tail too, when the plan
        reads the tail's KV from the tree or keeps its own recomputed tail: the path stays locked
        below it) and the checkpoint's state into the request's slot, and adds `host_hit_length`
        to the device prefix; the tail's KV slots are read after the load."""
        plan, start_state, prov, last_node = planned
        config = record.config
        self._touch_start_state(planned)
        load_end = plan.matched_tokens if plan.reuses_tail_kv else plan.prefix_len
        target = self._node_at_depth(last_node, load_end)
        device_len, device_node = result.device_prefix_len, result.last_device_node
        if load_end <= device_len:
            # only the state is on the host (its KV is on the device): SGLang counts the checkpoint
            # node's own KV as loaded, so that a load-back that loads nothing is seen (the count
            # falls short of the promise) and the request is admitted again as a miss
            checkpoint = self.tree_core.node_by_id(target)
            device_len, device_node = plan.prefix_len - len(checkpoint.key), checkpoint.parent.id
        state_node = start_state.node_id if self._state_on_host(planned) else None
        record.set_plan(plan, *_carry(plan, start_state, prov, config.kv_mode))
        record.kv_slots = None
        own_tail.begin(record, plan, config.kv_mode)
        record.host_load = HostLoad(device_len, plan.prefix_len, load_end, state_node)
        return result._replace(device_prefix_len=device_len, last_device_node=device_node,
                               last_host_node=target, best_match_node=target,
                               host_hit_length=plan.prefix_len - device_len,
                               mamba_host_hit_length=1 if state_node is not None else 0)

    def init_load_back(self, params: Any) -> Any:
        """SGLang's load-back of host-tier KV at admission; for a host plan, the count it reports is
        the plan's prefix growth (SGLang adds it to the request's prefix), and the tail's KV slots
        are read off the loaded path. SGLang loads all of it or nothing: if nothing was loaded (the
        count falls short of the promise, so SGLang admits the request again from its prefix), the
        request is served as a miss (exact; the tree is unchanged)."""
        req = params.req
        record = record_of(req) if req is not None else None
        host = record.host_load if record is not None else None
        if host is None:
            return super().init_load_back(params)
        record.host_load = None
        self.state_load_node = host.state_node
        try:
            loaded = super().init_load_back(params)
        finally:
            self.state_load_node = None
        if loaded is None:
            return None
        count, node = loaded
        state_loaded = host.state_node is None or \
            self.tree_core.node_by_id(host.state_node).component_data[ComponentType.MAMBA].value is not None
        if count == host.load_end - host.device_len and state_loaded:
            record.kv_slots = self._tail_kv_slots(record.plan, record.config, node)
            if host.state_node is not None:   # the request's slot holds the checkpoint's state now
                req.kv.mamba_cow_src_index, req.kv.mamba_needs_clear = None, False
            return host.prefix_len - host.device_len, node
        miss = ReplayPlan(HitKind.MISS, record.plan.matched_tokens, 0, 0)
        record.set_plan(miss)
        record.kv_slots = None
        own_tail.begin(record, miss, record.config.kv_mode)
        req.prefix_len = 0
        if req.kv.holds_mamba:
            req.kv.mamba_cow_src_index, req.kv.mamba_needs_clear = None, True
        return 0, self.root_node_handle(req.extra_key)

    # kv_mode "recompute": the request's recomputed tail KV stays its own (own_tail.py); the
    # insert reads the request's record for the provenance of what it inserts
    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        self._inserting, self._inserting_prompt = record_of(req), len(req.origin_input_ids)
        try:
            with own_tail.claiming(self, req):
                super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            if self._keeps_kv_past_the_state(req, up_to):
                self._insert_kv_past_the_state(req, up_to)
        finally:
            self._inserting, self._inserting_prompt = None, None

    def _keeps_kv_past_the_state(self, req: Any, up_to: int) -> bool:
        """Whether a finished request's KV past its tree state still waits to be inserted.

        Under the extra buffer SGLang inserts a finished request only up to the last state it
        tracked (a chunk boundary of its prefill, or of its decode's track interval) and frees the
        KV after it: on stock SGLang that KV cannot be reused without a state at its end. Here it
        can (a plan resumes from the state and recomputes, or replays), and without the extra
        buffer the tree gets a request's whole KV anyway; so the rest is inserted as KV alone
        (`_insert_kv_past_the_state`). Only for the Full + Mamba components (no SWA window to keep),
        and not with the session radix cache (it registers the first insert's end as the session's
        leaf). Reads only."""
        return (req.finished() and self.enable_mamba_extra_buffer and not self.disable and req.kv.holds_kv
                and not req.skip_radix_cache_insert and not self.enable_session_radix_cache
                and {c.component_type for c in self._components_tuple} == {ComponentType.FULL, ComponentType.MAMBA}
                and up_to // self.page_size * self.page_size > req.kv.cache_protected_len)

    def _insert_kv_past_the_state(self, req: Any, up_to: int) -> None:
        """Insert [cache_protected_len, up_to) of a finished request's KV with no state, after
        SGLang's own insert stopped at the request's last tracked state; then, as SGLang's insert
        does, the request's row takes the tree's slots and its lock moves to the new end. The
        request's release frees what is left past it (`release_kv_cache`). A recompute tail
        (`own_tail`) is claimed over this insert as over the first one. May mutate: the tree, the
        request's KV row, lock, `cache_protected_len`, `cache_inserted_len`, `last_node`."""
        token_ids = req.full_untruncated_fill_ids[:up_to]
        key = RadixKey(token_ids, req.extra_key, is_bigram=self.tree_core.is_eagle,
                       cache_salt=req.cache_salt).page_aligned(self.page_size)
        values = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(key)].to(dtype=torch.int64, copy=True)
        params = InsertParams(key=key, value=values, prev_prefix_len=req.kv.cache_protected_len,
                              inserted_len=req.kv.cache_inserted_len, priority=req.priority or 0,
                              session_id=req.session_id, rotation_base=req.kv_rotation_base)
        with own_tail.claiming(self, req):
            result = self.insert(params)
        if result.rotation_tail_declined:
            return
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, len(key))
        new_last_node = result.last_device_node
        new_indices = self.path_device_indices(new_last_node)
        protected = req.kv.cache_protected_len
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, len(new_indices))),
                                     new_indices[protected:])
        self.unlock(req.lock)
        req.lock = self.lock(new_last_node, skip_lock_components=(
            (ComponentType.MAMBA,) if envs.SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK.get() else ()))
        req.kv.cache_protected_len = len(new_indices)
        req.last_node = new_last_node

    def insert(self, params):
        return own_tail.insert(self, params, super().insert)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        own_tail.release(self, req)
        super().on_release(req, checkpointed=checkpointed)

    def _tail_kv_slots(self, plan: ReplayPlan, config: TailReplayConfig, last_node_id: Any) -> torch.Tensor | None:
        """The tree's KV slots of [prefix_len, L), read off the matched path bottom-up (O(W));
        `last_node_id` ends at depth L."""
        if config.kv_mode != "exact" or not plan.reuses_tail_kv:
            return None
        node, depth, chunks = self.tree_core.node_by_id(last_node_id), plan.matched_tokens, []
        while depth > plan.prefix_len:
            chunks.append(node.component_data[ComponentType.FULL].value)
            depth -= len(node.key)
            node = node.parent
        return torch.cat(chunks[::-1])[plan.prefix_len - depth:].clone()


class _Planned(NamedTuple):
    plan: ReplayPlan
    start_state: Any        # the PathState the plan resumes from (a checkpoint plan), else None or unused
    prov: PathProvenance
    last_node: Any          # the node id at depth plan.matched_tokens


def _holds_state(node: Any, host: bool) -> bool:
    """Whether the node holds a state: on the device, or, where states go to the host, there."""
    data = node.component_data[ComponentType.MAMBA]
    return data.value is not None or (host and data.host_value is not None)


def _continues_to_a_state(node: Any, component_type: Any) -> bool:
    """Whether `node` continues in exactly one child and a state sits further down that single
    line before it branches or ends."""
    while len(node.children) == 1:
        node = next(iter(node.children.values()))
        if node.component_data[component_type].value is not None:
            return True
    return False


def _continues_a_prompt(node: Any) -> bool:
    """Whether a path going on below `node` (which ends where a match ended) goes on with prompt
    tokens: some child's first token is not a generated answer's (`answer_from` is not 0)."""
    return any(answer_from(child) != 0 for child in node.children.values())


def _branches_below(node: Any, component_type: Any) -> int:
    """How many ways the tree branches below `node` before its next state: the children of the
    first node down its single-child line that has other than one child; 1 when a state sits on
    that line first (a conversation that moved past `node`), 0 when the line ends in a leaf."""
    while len(node.children) == 1:
        node = next(iter(node.children.values()))
        if node.component_data[component_type].value is not None:
            return 1
    return len(node.children)


def _carry(plan: ReplayPlan, start_state: Any, prov: PathProvenance, kv_mode: str) -> tuple[CarryBound | None, float]:
    """(the carry, the read floor) a plan starts with: an approximate replay carries from its
    replay start L - W with bound 1 (the dropped state), a checkpoint of bound > 0 from its depth
    with its bound; reading KV of bound > 0 (or, in kv_mode "recompute", its own replayed tail's
    KV) is a TAINT floor."""
    reads = plan.matched_tokens if plan.reuses_tail_kv and kv_mode == "exact" else plan.prefix_len
    floor = prov.read_floor(reads)
    if plan.kind is HitKind.APPROXIMATE:
        if kv_mode == "recompute" and plan.replayed_tokens:
            floor = max(floor, provenance.TAINT)
        return CarryBound(plan.prefix_len, 0.0), floor
    if plan.from_checkpoint and start_state is not None and start_state.bound > 0.0:
        return CarryBound(plan.prefix_len, provenance.log_of_bound(start_state.bound)), floor
    return None, floor


def tail_replay_cache_factory(ctx: Any) -> UnifiedRadixCache:
    """`--radix-cache-backend tail_replay`: SGLang calls this once per scheduler at start-up."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from sglang_ext.tail_replay.startup import check_scheduler_start

    config = server_config()
    check_scheduler_start(ctx, config)
    if not ctx.is_hybrid_ssm:
        raise ValueError("--radix-cache-backend tail_replay needs a hybrid model with linear-attention "
                         "or SSM layers (GDN, Mamba-2); this model has none")
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}),
        ComponentType.MAMBA: TailReplayMambaComponent,
    }
    cache_class = type("TailReplayRadixCache", (TailReplayRadixCache,), {"tail_replay_config": config})
    return create_unified_radix_cache(ctx, cache_class=cache_class)
