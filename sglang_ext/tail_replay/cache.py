"""SGLang adapter: a UnifiedRadixCache whose Mamba component lets matches run as deep as the
attention KV, and a planner decision per request (`--radix-cache-backend tail_replay`).

What changes against SGLang 0.5.23's `UnifiedRadixCache` + `MambaComponent`:
- match (this module): every node is valid for the Mamba component (`component`), so a hit is as
  long as the full-attention KV hit (L). The planner then sets the request's prefix length: a
  checkpoint at C (exact), or L - W with a zeroed linear state (approximate), or 0. The matched
  path is walked once per match (`tree_provenance.MatchedPath`).
- provenance (`tree_provenance`, `tail_replay.provenance`): every node the tree gets from a request
  carries the bound of its KV per token, every stored state its bound; approximate end states are
  stored too (with their bound: a conversation's next turn resumes from them), and fresh KV of a
  smaller bound replaces an approximate node's on insert (where no request holds that node).
  `insert_bounds` is the one place that decides the bounds of what an insert brings.
- the host and storage tiers (`tiers`), the state eviction order (`state_order`), the branch-point
  track and shared-state repair (`branch_rules`, `tail_replay.repair`), the KV past a finished
  request's last state under the extra buffer (`kv_past_state`).
- caching: with keep_checkpoints=False no state is inserted; the attention KV always is.
The per-request decision goes into the request's record (`tail_replay.request`): its config
(resolved once, at the first match), the plan (a ReplayPlan) and, for exact-KV replay, `kv_slots`:
the tree's KV slots of the replayed tail, read by `patches/tail_replay/batch.py` /
`tail_replay/attention.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import LRURefreshPhase
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_ext.tail_replay import insert_provenance, own_tail
from sglang_ext.tail_replay.branch_rules import SharedRepairRules
from sglang_ext.tail_replay.component import TailReplayMambaComponent
from sglang_ext.tail_replay.config import BACKEND_NAME, TailReplayConfig, server_config
from sglang_ext.tail_replay.kv_past_state import KvPastTheState
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan, exact_fallback, plan_replay, pressure_config, refused
from sglang_ext.tail_replay.provenance import PathProvenance
from sglang_ext.tail_replay.request import TailReplayRequest, attach, record_of
from sglang_ext.tail_replay.request_fields import request_overrides
from sglang_ext.tail_replay.sessions import StreamingTurns
from sglang_ext.tail_replay.tiers import HostTierCache
from sglang_ext.tail_replay.tree_provenance import MatchedPath, Planned, answer_from, plan_carry, provenance_of

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult

__all__ = ["BACKEND_NAME", "TailReplayRadixCache", "TailReplayMambaComponent", "tail_replay_cache_factory",
           "provenance_of", "answer_from"]


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


class TailReplayRadixCache(StreamingTurns, HostTierCache, SharedRepairRules, KvPastTheState, UnifiedRadixCache):
    tail_replay_config: TailReplayConfig = TailReplayConfig()
    #: the record of the request whose `checkpoint_into_tree` is running (None: no record, or no
    #: request: `_caching` tells them apart)
    _inserting: TailReplayRequest | None = None
    #: the prompt length of the request whose `checkpoint_into_tree` is running (None: no request)
    _inserting_prompt: int | None = None
    #: whether a request's `checkpoint_into_tree` is running (its record may be None: untracked)
    _caching: bool = False
    #: a streaming session's turn being inserted: what its session computed before it (`sessions`)
    _inserting_history: torch.Tensor | None = None
    #: the matched path of the running match, walked once (`matched_path`); None outside a match
    _match_path: MatchedPath | None = None

    def request_record(self, req: Any) -> TailReplayRequest:
        """The request's record, created with its config resolved on first use."""
        return record_for(self.tail_replay_config, req)

    def inserting_record(self) -> TailReplayRequest | None:
        return self._inserting

    def inserting_prompt_len(self) -> int | None:
        return self._inserting_prompt

    def insert_bounds(self, start: int, end: int) -> torch.Tensor:
        """The bound of each position in [start, end) that the running insert brings into the tree:
        decided by `insert_provenance.insert_bounds`, the one place (fail closed). Reads only."""
        return insert_provenance.insert_bounds(self._inserting, start, end, caching=self._caching,
                                               transferred=self._transferred(), history=self._inserting_history)

    def insert_state_bound(self, depth: int) -> float:
        """The bound of the state the running insert stores at `depth` (`insert_provenance`)."""
        return insert_provenance.state_bound(self._inserting, depth, caching=self._caching,
                                             transferred=self._transferred(), history=self._inserting_history)

    @staticmethod
    def _transferred() -> bool:
        """The decode side of PD disaggregation: requests insert KV a prefill server computed."""
        from sglang.srt.runtime_context import get_disagg

        return get_disagg().disaggregation_mode == "decode"

    def reset(self) -> None:
        """SGLang's full reset (`/flush_cache`: the tree and the session slots are rebuilt); what
        Tail-Replay keeps beside them goes too: the stock shadow of the state order and the
        streaming sessions' provenance (a stale entry would label a new slot of the same session
        id with an old slot's provenance). May mutate: those tables."""
        super().reset()
        self._session_table = None
        self._released_history = None
        mamba = getattr(self, "components", {}).get(ComponentType.MAMBA)
        if mamba is not None:
            mamba.forget_stock_shadow()

    # ---- match -------------------------------------------------------------------------------
    def _match_tree(self, params: MatchPrefixParams) -> MatchResult:
        self._match_path = None   # walked by this match (`remember_matched_path`, `matched_path`)
        try:
            return super()._match_tree(params)
        finally:
            self._match_path = None

    def remember_matched_path(self, path: MatchedPath) -> None:
        """The tree core's walk of the running match's path (the Mamba component's finalizer)."""
        self._match_path = path

    def matched_path(self, node_id: Any) -> MatchedPath:
        """The path from the root to `node_id`: the running match's walk, extended below its end
        where `node_id` lies deeper (a host hit). May mutate: the remembered path."""
        path = MatchedPath.walk(self.tree_core, self.tree_core.node_by_id(node_id), self._match_path)
        self._match_path = path
        return path

    def _finalize_match_result(self, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        if params.req is not None and not self._is_storage_probe(params):
            result = self._apply_replay_plan(params.req, result)
        return super()._finalize_match_result(params, result)

    def _path(self, node_id) -> list[Any]:
        """The nodes from the root to `node_id`, root first (root excluded): a fresh walk."""
        return MatchedPath.walk(self.tree_core, self.tree_core.node_by_id(node_id)).nodes

    def path_provenance(self, node_id) -> PathProvenance:
        """Provenance of the path from the root to `node_id` (its KV bounds and its states: on the
        device, and on the host where states go there). A fresh walk (outside a match)."""
        host = self.components[ComponentType.MAMBA].host_states
        return MatchedPath(self._path(node_id)).provenance(host)

    def _node_at_depth(self, path: MatchedPath, depth: int) -> Any:
        """The id of the path's node that ends at `depth` (page-aligned), splitting the node that
        spans it; the root for 0. May mutate: the tree (a split), `path`."""
        def split(node: Any, head_len: int) -> Any:
            head, action = self.tree_core._split_node(node.key, node, head_len)
            if action is not None:   # HiCache: a pending write-through follows the split
                self._apply_cache_actions([action])
            return head

        return path.node_at_depth(depth, self.tree_core.root_node.id, split)

    def _plan(self, record: TailReplayRequest, matched: int, path: MatchedPath, last_node: Any,
              config: TailReplayConfig | None = None) -> Planned:
        """The plan over the path's first `matched` tokens (`path` and its node `last_node` end
        there), under the request's config (or `config`). Reads the tree; may split the node at the
        strict mode's cut."""
        config = config or record.config
        prov = path.provenance(self.components[ComponentType.MAMBA].host_states)
        if config.strict and prov.first_inexact < matched:   # read only strictly exact KV
            matched = prov.first_inexact // self.page_size * self.page_size
            last_node = self._node_at_depth(path, matched)
        exact_state = prov.deepest_exact_state(config.threshold, config.strict)
        approx_state = None if config.strict else prov.deepest_approximate_state(config.threshold)
        plan = plan_replay(matched, exact_state.depth if exact_state else None, self.page_size, config,
                           (approx_state.depth, approx_state.bound) if approx_state else None)
        if plan.pressure == "beyond_tolerance":   # pressed, the approximate plan's bound too large: exact
            planned = self._plan(record, matched, path, last_node, exact_fallback(config))
            return planned._replace(plan=refused(planned.plan, plan))
        start_state = exact_state if plan.kind is HitKind.EXACT_CHECKPOINT else approx_state
        return Planned(plan, start_state, prov, last_node, path)

    def _apply_replay_plan(self, req: Any, result: MatchResult) -> MatchResult:
        """Plan the request's hit; SGLang's match result is rewritten to the plan's prefix. With
        HiCache, the host tier is used where it makes the prefix longer (the plan then runs over
        the device + host KV hit) or holds the state a checkpoint plan starts from; SGLang's
        load-back brings what the plan reads to the device before the forward (`init_load_back`)."""
        record = self.request_record(req)
        record.begin_match(len(req.origin_input_ids) + len(req.output_ids))
        device_len = result.device_prefix_len
        record.host_load = None
        if result.host_hit_length > 0:
            path = self.matched_path(result.best_match_node)
            planned = self._plan(record, device_len + result.host_hit_length, path, result.best_match_node)
            if planned.plan.prefix_len > device_len:
                self._note_shared_repair(record, planned, len(req.origin_input_ids))
                return self._apply_host_plan(req, record, result, planned)
            path = path.upto(result.last_device_node)
        else:
            path = self.matched_path(result.last_device_node)
        planned = self._plan(record, device_len, path, result.last_device_node)
        self._note_shared_repair(record, planned, len(req.origin_input_ids))
        if self._state_on_host(planned):
            return self._apply_host_plan(req, record, result, planned)
        plan, start_state, prov, last_node, path = planned
        config = record.config
        self._touch_start_state(planned)
        record.set_plan(plan, *plan_carry(plan, start_state, prov, config.kv_mode))
        record.kv_slots = self._tail_kv_slots(plan, config, path)
        own_tail.begin(record, plan, config.kv_mode)   # recompute: the request keeps its tail KV
        if plan.from_checkpoint:
            last_node = start_state.node_id
        elif plan.kind is HitKind.MISS:
            last_node = self.root_node_handle(req.extra_key)
        return result._replace(device_prefix_len=plan.prefix_len, last_device_node=last_node,
                               last_host_node=last_node, best_match_node=last_node,
                               host_hit_length=0, mamba_host_hit_length=0)

    def _touch_start_state(self, planned: Planned) -> None:
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

    def _tail_kv_slots(self, plan: ReplayPlan, config: TailReplayConfig, path: MatchedPath) -> torch.Tensor | None:
        """The tree's KV slots of [prefix_len, L), read off the matched path (it reaches L)."""
        if config.kv_mode != "exact" or not plan.reuses_tail_kv:
            return None
        return path.kv_slots(plan.prefix_len, plan.matched_tokens)

    # ---- caching ------------------------------------------------------------------------------
    # kv_mode "recompute": the request's recomputed tail KV stays its own (own_tail.py); the
    # insert reads the request's record for the provenance of what it inserts
    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        if self._would_adopt_inexact_kv(req, up_to):
            up_to = 0   # no insert while it runs (SGLang's empty insert): it keeps its own KV
        self._inserting, self._inserting_prompt, self._caching = record_of(req), len(req.origin_input_ids), True
        self._inserting_history = self.session_history(req)
        try:
            with own_tail.claiming(self, req):
                super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            if self._keeps_kv_past_the_state(req, up_to):
                self._insert_kv_past_the_state(req, up_to)
        finally:
            self._inserting, self._inserting_prompt, self._caching = None, None, False
            self._inserting_history, self._released_history = None, None

    def _would_adopt_inexact_kv(self, req: Any, up_to: int) -> bool:
        """Whether the insert of a running strict request (`exactness: "exact"`, or pressed beyond
        the tolerance: `TailReplayRequest.strict`; chunked prefill) over
        [0, up_to) would hand it tree KV that is not strictly exact: SGLang's insert frees the
        request's slots it finds in the tree already and rewrites the request's row to the tree's,
        so the request reads the tree's KV from then on (its next chunks, its decode). Where the
        tree's KV past what the request holds (`cache_protected_len`) is not strictly exact, the
        strict request must not take it (fail closed: it keeps what it computed itself; it inserts
        when it finishes). A finished request reads nothing more. Reads only."""
        record = record_of(req)
        if self.disable or record is None or not record.strict or req.finished():
            return False
        key = RadixKey(req.full_untruncated_fill_ids[:up_to], req.extra_key, is_bigram=self.tree_core.is_eagle,
                       cache_salt=req.cache_salt)
        matched, node_id, _ = self.tree_core.match_full_device_prefix(key)
        if matched <= req.kv.cache_protected_len:
            return False
        return self.path_provenance(node_id).first_inexact < matched

    def insert(self, params):
        return own_tail.insert(self, params, super().insert)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._released_history = None   # an aborted session turn released without an insert
        own_tail.release(self, req)
        super().on_release(req, checkpointed=checkpointed)


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
