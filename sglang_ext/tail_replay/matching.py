"""The match planner (SGLang adapter: a part of `TailReplayRadixCache`): at each match it creates
the request's record (its config resolved once), walks the matched path once, asks the pure
planner (`planner.plan_replay`) for the hit and rewrites SGLang's match result to the plan's prefix.

Every node is valid for the Mamba component (`TailReplayMambaComponent.create_match_validator`),
so a hit is as long as the full-attention KV hit (L). The plan then sets the request's prefix
length: a checkpoint at C (exact), or L - W with a zeroed linear state (approximate), or 0. With
HiCache the host tier is used where it makes the prefix longer, or holds the state a checkpoint
plan starts from (`tiers.HostTierCache`); the shared-state repair asks are made here too
(`branch_rules.SharedRepairRules`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import LRURefreshPhase

from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan, exact_fallback, plan_replay, pressure_config, refused
from sglang_ext.tail_replay.provenance.bounds import PathProvenance
from sglang_ext.tail_replay.provenance.tree import MatchedPath, Planned, plan_carry
from sglang_ext.tail_replay.request import TailReplayRequest, attach, record_of
from sglang_ext.tail_replay.request_fields import request_overrides

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

    from sglang_ext.tail_replay.branch_rules import SharedRepairRules
    from sglang_ext.tail_replay.tiers import HostTierCache


def request_config(base: TailReplayConfig, req: Any) -> TailReplayConfig:
    """The server's config with the request's `custom_params["tail_replay"]` overrides
    (validated when the request arrived, see patches/tail_replay/request.py). Resolved once per
    request: `record_for` keeps the result on the request's record."""
    custom_params = getattr(req.sampling_params, "custom_params", None)   # with its arrival's pressure stamp
    return pressure_config(request_overrides(base, custom_params), custom_params)


def record_for(base: TailReplayConfig, req: Any) -> TailReplayRequest:
    """The request's record; created, with its config resolved, on first use."""
    record = record_of(req)
    return record if record is not None else attach(req, request_config(base, req))


def tail_kv_slots(plan: ReplayPlan, kv_mode: str, path: MatchedPath) -> torch.Tensor | None:
    """The tree's KV slots of the replayed tail [prefix_len, L) that an exact-KV replay reads, off
    the matched path (it reaches L); None where the plan reads none. Reads only."""
    if kv_mode != "exact" or not plan.reuses_tail_kv:
        return None
    return path.kv_slots(plan.prefix_len, plan.matched_tokens)


class MatchPlanner:
    """Plans each request's hit over the path it matched. Needs the SGLang cache it plans on (its
    tree core, page size, Mamba component, root handles, cache actions) and the server's config.
    May mutate: the running match's path, request records, the tree's node boundaries (a split
    at a plan's cut), the device state LRU's order (the state a plan resumes from)."""

    def __init__(self, cache: Any, config: TailReplayConfig) -> None:
        self.cache = cache
        self.config = config
        #: the matched path of the running match, walked once; None outside a match
        self.path: MatchedPath | None = None

    # ---- the path, walked once per match ------------------------------------------------------
    def begin_match(self) -> None:
        self.path = None

    def end_match(self) -> None:
        self.path = None

    def remember(self, path: MatchedPath) -> None:
        """The tree core's walk of the running match's path (the Mamba component's finalizer)."""
        self.path = path

    def matched_path(self, node_id: Any) -> MatchedPath:
        """The path from the root to `node_id`: the running match's walk, extended below its end
        where `node_id` lies deeper (a host hit). May mutate: the remembered path."""
        core = self.cache.tree_core
        self.path = MatchedPath.walk(core, core.node_by_id(node_id), self.path)
        return self.path

    def walk(self, node_id: Any) -> MatchedPath:
        """The path from the root to `node_id`: a fresh walk (outside a match). Reads only."""
        core = self.cache.tree_core
        return MatchedPath.walk(core, core.node_by_id(node_id))

    def path_provenance(self, node_id: Any) -> PathProvenance:
        """Provenance of the path from the root to `node_id` (its KV bounds and its states: on the
        device, and on the host where states go there). A fresh walk (outside a match)."""
        return self.walk(node_id).provenance(self._host_states())

    def node_at_depth(self, path: MatchedPath, depth: int) -> Any:
        """The id of the path's node that ends at `depth` (page-aligned), splitting the node that
        spans it; the root for 0. May mutate: the tree (a split), `path`."""
        cache = self.cache

        def split(node: Any, head_len: int) -> Any:
            head, action = cache.tree_core._split_node(node.key, node, head_len)
            if action is not None:   # HiCache: a pending write-through follows the split
                cache._apply_cache_actions([action])
            return head

        return path.node_at_depth(depth, cache.tree_core.root_node.id, split)

    def start_grid(self, config: TailReplayConfig) -> int:
        """The grid a replayed tail starts on: under the extra buffer, for a request whose states go
        into the tree (`keep_checkpoints`), SGLang's checkpoint grid; else the page. SGLang tracks a
        request's states at its prefix plus whole grid steps, so a start off the grid would put
        every state the request (and its conversation after it) tracks off the grid stock's states
        lie on, and the next turn would resume up to a grid step shallower than stock's. Reads only."""
        cache = self.cache
        if cache.enable_mamba_extra_buffer and config.knobs.keep_checkpoints:
            return cache.components[ComponentType.MAMBA].mamba_checkpoint_grid
        return cache.page_size

    def _host_states(self) -> bool:
        return self.cache.components[ComponentType.MAMBA].host_states

    # ---- the plan -----------------------------------------------------------------------------
    def record(self, req: Any) -> TailReplayRequest:
        """The request's record, created with its config resolved on first use."""
        return record_for(self.config, req)

    def plan(self, record: TailReplayRequest, matched: int, path: MatchedPath, last_node: Any,
             config: TailReplayConfig | None = None) -> Planned:
        """The plan over the path's first `matched` tokens (`path` and its node `last_node` end
        there), under the request's config (or `config`). Reads the tree; may split the node at the
        strict mode's cut."""
        config = config or record.config
        page = self.cache.page_size
        prov = path.provenance(self._host_states())
        if config.strict and prov.first_inexact < matched:   # read only strictly exact KV
            matched = prov.first_inexact // page * page
            last_node = self.node_at_depth(path, matched)
        exact_state = prov.deepest_exact_state(config.threshold, config.strict)
        approx_state = None if config.strict else prov.deepest_approximate_state(config.threshold)
        plan = plan_replay(matched, exact_state.depth if exact_state else None, self.start_grid(config), config,
                           (approx_state.depth, approx_state.bound) if approx_state else None)
        if plan.pressure == "beyond_tolerance":   # pressed, the approximate plan's bound too large: exact
            planned = self.plan(record, matched, path, last_node, exact_fallback(config))
            return planned._replace(plan=refused(planned.plan, plan))
        start_state = exact_state if plan.kind is HitKind.EXACT_CHECKPOINT else approx_state
        return Planned(plan, start_state, prov, last_node, path)

    def apply(self, req: Any, result: MatchResult, host: HostTierCache | None, repair: SharedRepairRules) -> MatchResult:
        """Plan the request's hit; SGLang's match result is rewritten to the plan's prefix. With
        HiCache, the host tier is used where it makes the prefix longer (the plan then runs over
        the device + host KV hit) or holds the state a checkpoint plan starts from; SGLang's
        load-back brings what the plan reads to the device before the forward (`init_load_back`).
        May mutate: the record, the tree (a split), the state LRU's order, a node's repair mark."""
        record = self.record(req)
        record.begin_match(len(req.origin_input_ids) + len(req.output_ids))
        device_len = result.device_prefix_len
        if host is not None and result.host_hit_length > 0:
            path = self.matched_path(result.best_match_node)
            planned = self.plan(record, device_len + result.host_hit_length, path, result.best_match_node)
            if planned.plan.prefix_len > device_len:
                repair.note(record, planned, len(req.origin_input_ids))
                return host.apply_host_plan(req, record, result, planned)
            path = path.upto(result.last_device_node)
        else:
            path = self.matched_path(result.last_device_node)
        planned = self.plan(record, device_len, path, result.last_device_node)
        repair.note(record, planned, len(req.origin_input_ids))
        if host is not None and host.state_on_host(planned):
            return host.apply_host_plan(req, record, result, planned)
        plan, start_state, prov, last_node, path = planned
        config = record.config
        self.touch_start_state(planned)
        record.set_plan(plan, *plan_carry(plan, start_state, prov, config.knobs.kv_mode),
                        kv_slots=tail_kv_slots(plan, config.knobs.kv_mode, path))
        if plan.from_checkpoint:
            last_node = start_state.node_id
        elif plan.kind is HitKind.MISS:
            last_node = self.cache.root_node_handle(req.extra_key)
        return result._replace(device_prefix_len=plan.prefix_len, last_device_node=last_node,
                               last_host_node=last_node, best_match_node=last_node,
                               host_hit_length=0, mamba_host_hit_length=0)

    def touch_start_state(self, planned: Planned) -> None:
        """The state a plan resumes from becomes the most recently used one, as on stock SGLang,
        whose match touches the state it ends at because that is the state the request copies.
        Here the match runs to the end of the KV (`create_match_validator` accepts every node), so
        SGLang's touch lands on whatever state sits there, or on none; a state the plan resumes
        from above it (an exact state below a deeper approximate one, a branch-point state) would
        otherwise age as if unused and go first under state pressure. SGLang's own touch (the Mamba
        component's `refresh_lru` at `MATCH_END`) is applied to that state. May mutate: the device
        state LRU's order (nothing when the state is on the host only)."""
        if planned.plan.from_checkpoint:
            cache = self.cache
            node = cache.tree_core.node_by_id(planned.start_state.node_id)
            cache.components[ComponentType.MAMBA].refresh_lru(LRURefreshPhase.MATCH_END, node, cache.root_node)

    # ---- at insert ----------------------------------------------------------------------------
    def would_adopt_inexact_kv(self, req: Any, up_to: int) -> bool:
        """Whether the insert of a running strict request (`exactness: "exact"`, or pressed beyond
        the tolerance: `TailReplayRequest.strict`; chunked prefill) over [0, up_to) would hand it
        tree KV that is not strictly exact: SGLang's insert frees the request's slots it finds in
        the tree already and rewrites the request's row to the tree's, so the request reads the
        tree's KV from then on (its next chunks, its decode). Where the tree's KV past what the
        request holds (`cache_protected_len`) is not strictly exact, the strict request must not
        take it (fail closed: it keeps what it computed itself; it inserts when it finishes). A
        finished request reads nothing more. Reads only."""
        cache = self.cache
        record = record_of(req)
        if cache.disable or record is None or not record.strict or req.finished():
            return False
        key = RadixKey(req.full_untruncated_fill_ids[:up_to], req.extra_key, is_bigram=cache.tree_core.is_eagle,
                       cache_salt=req.cache_salt)
        matched, node_id, _ = cache.tree_core.match_full_device_prefix(key)
        if matched <= req.kv.cache_protected_len:
            return False
        return self.path_provenance(node_id).first_inexact < matched
