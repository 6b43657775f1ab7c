"""SGLang adapter: a UnifiedRadixCache whose Mamba component lets matches run as deep as the
attention KV, and a planner decision per request (`--radix-cache-backend tail_replay`).

The class keeps only SGLang 0.5.23's hook overrides; each delegates to a named part, held by
composition and built once the cache is (`build_parts`):

| part | module | what it decides |
|---|---|---|
| `planner` (`MatchPlanner`) | `matching` | the record, the matched path (walked once), the plan, the rewritten match result |
| `host_tier` (`HostTierCache`, asked only with HiCache or storage) | `tiers` | plans that read the host tier, their load-back, storage |
| `repair` (`SharedRepairRules`) | `branch_rules` | the shared-state repair asks at a match |
| `sessions` (`StreamingTurns`, asked only for a session's requests) | `sessions` | a streaming session's turns: their plan, refusal, provenance |
| `claims` (`OwnTailClaims`, asked only for a request with a recompute tail) | `own_tail` | `kv_mode: "recompute"`: a request's own recomputed tail |
| `kv_past_state` (`KvPastTheState`) | `kv_past_state` | the KV past a finished request's last state (extra buffer) |
| `byte_budget` (`ByteBudget`, asked only with `--enable-unified-memory`) | `byte_budget` | under one byte budget, which states go before KV |

Insert-time state is one object, `inserting` (`provenance.writes.InsertContext`: the inserting
request's record, prompt length, session history), set for the time a request's
`checkpoint_into_tree` runs; every bound an insert stores is asked of it (the Mamba component's
provenance writer and host-tier rules ask it through `inserting_context()`). The Mamba component is
`TailReplayMambaComponent` (`component`). With keep_checkpoints=False no state is inserted; the
attention KV always is. The per-request decision goes into the request's record
(`tail_replay.request`): its config, the plan (a ReplayPlan) and, for exact-KV replay, `kv_slots`:
the tree's KV slots of the replayed tail, read by `patches/tail_replay/batch.py` /
`patches/tail_replay/attention.py`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_ext.tail_replay.branch_rules import SharedRepairRules
from sglang_ext.tail_replay.byte_budget import ByteBudget
from sglang_ext.tail_replay.component import TailReplayMambaComponent
from sglang_ext.tail_replay.config import BACKEND_NAME, TailReplayConfig, server_config
from sglang_ext.tail_replay.kv_past_state import KvPastTheState
from sglang_ext.tail_replay.matching import MatchPlanner, record_for, request_config
from sglang_ext.tail_replay.own_tail import OwnTailClaims
from sglang_ext.tail_replay.provenance.bounds import PathProvenance
from sglang_ext.tail_replay.provenance.tree import MatchedPath, answer_from, provenance_of
from sglang_ext.tail_replay.provenance.writes import NO_REQUEST, InsertContext
from sglang_ext.tail_replay.request import TailReplayRequest, owns_tail, record_of
from sglang_ext.tail_replay.sessions import SessionProvenance, StreamingTurns
from sglang_ext.tail_replay.tiers import HostTierCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult

__all__ = ["BACKEND_NAME", "TailReplayRadixCache", "TailReplayMambaComponent", "tail_replay_cache_factory",
           "provenance_of", "answer_from", "record_for", "request_config"]


class TailReplayRadixCache(UnifiedRadixCache):
    tail_replay_config: TailReplayConfig = TailReplayConfig()
    #: whether the shared-state repair's branch rule runs (a wing whose tree branches otherwise
    #: turns it off, `SharedRepairRules`)
    branch_repair: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: the running request's caching (None: no request's `checkpoint_into_tree` runs)
        self.inserting: InsertContext | None = None
        super().__init__(*args, **kwargs)
        self.build_parts()

    def build_parts(self) -> None:
        """The named parts (table in the module docstring), once SGLang's constructor has built
        the tree, the pools and the components. May mutate: the parts (new)."""
        self.planner = MatchPlanner(self, self.tail_replay_config)
        #: asked only while HiCache or a storage tier is on (`tiers_on`)
        self.host_tier = HostTierCache(self, self.planner)
        self.repair = SharedRepairRules(self, self.planner.node_at_depth, branch_rule=self.branch_repair)
        self.sessions = StreamingTurns(self, self.planner.record)
        self.claims = OwnTailClaims(self.req_to_token_pool, self.token_to_kv_pool_allocator)
        self.kv_past_state = KvPastTheState(self, self.claims)
        #: asked only while KV and states share one byte buffer (`--enable-unified-memory`)
        self.byte_budget = ByteBudget(self)

    # ---- what the parts and the Mamba component read --------------------------------------------
    def request_record(self, req: Any) -> TailReplayRequest:
        """The request's record, created with its config resolved on first use."""
        return record_for(self.tail_replay_config, req)

    def inserting_context(self) -> InsertContext:
        """What the running insert brings: a request's caching, or none (exact). Reads only."""
        return self.inserting if self.inserting is not None else NO_REQUEST

    def inserting_record(self) -> TailReplayRequest | None:
        """The record of the request whose insert runs (None: none, or untracked)."""
        return self.inserting_context().record

    def remember_matched_path(self, path: MatchedPath) -> None:
        """The tree core's walk of the running match's path (the Mamba component's finalizer)."""
        self.planner.remember(path)

    @property
    def state_load_node(self) -> Any:
        """HiCache: the node whose host state the running load-back may copy (`HostTierCache`)."""
        return self.host_tier.state_load_node

    def path_provenance(self, node_id: Any) -> PathProvenance:
        """Provenance of the path from the root to `node_id` (a fresh walk, outside a match)."""
        return self.planner.path_provenance(node_id)

    def session_provenance(self) -> dict[str, SessionProvenance]:
        """Per open streaming session with a slot: its provenance (`StreamingTurns.table`)."""
        return self.sessions.table

    def tiers_on(self) -> bool:
        """Whether HiCache or a storage tier is on (SGLang turns them on once the constructor ran):
        only then is the host-tier part asked. Reads only."""
        return bool(self.tree_core.enable_hicache) or bool(self.enable_storage)

    @staticmethod
    def _in_session(req: Any) -> bool:
        """A request of a SGLang session (`Req.session`): only then do the session rules run."""
        return req is not None and getattr(req, "session", None) is not None

    @staticmethod
    def _transferred() -> bool:
        """The decode side of PD disaggregation: requests insert KV a prefill server computed."""
        from sglang.srt.runtime_context import get_disagg

        return get_disagg().disaggregation_mode == "decode"

    # ---- SGLang's hooks -----------------------------------------------------------------------
    def reset(self) -> None:
        """SGLang's full reset (`/flush_cache`: the tree and the session slots are rebuilt); what
        Tail-Replay keeps beside them goes too: the stock shadow of the state order and the
        streaming sessions' provenance. May mutate: those tables."""
        super().reset()
        sessions = getattr(self, "sessions", None)   # SGLang's constructor resets before the parts exist
        if sessions is not None:
            sessions.reset()
        mamba = getattr(self, "components", {}).get(ComponentType.MAMBA)
        if mamba is not None:
            mamba.forget_stock_shadow()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        if self._in_session(params.req):
            return self.sessions.match_prefix(params, super().match_prefix)
        return super().match_prefix(params)

    def _match_tree(self, params: MatchPrefixParams) -> MatchResult:
        self.planner.begin_match()   # the path is walked by this match (`remember_matched_path`)
        try:
            return super()._match_tree(params)
        finally:
            self.planner.end_match()

    def _finalize_match_result(self, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        if params.req is None:
            return super()._finalize_match_result(params, result)
        if not self.tiers_on():
            result = self.planner.apply(params.req, result, None, self.repair)
        elif not self.host_tier.is_storage_probe(params):
            result = self.planner.apply(params.req, result, self.host_tier, self.repair)
        return super()._finalize_match_result(params, result)

    def evict_for_alloc(self, params: Any, *, allocation_reclaim_satisfied: Any = None) -> Any:
        """Under one byte budget, the states worth less per byte than KV go first (`ByteBudget`),
        then SGLang's own eviction frees what is still short. A joint-reclaim walk (the predicate
        form), static pools and `byte_budget: false` run SGLang's eviction alone."""
        if (self.disable or allocation_reclaim_satisfied is not None or not hasattr(self, "byte_budget")
                or not self.tail_replay_config.server.byte_budget or not self.byte_budget.shared()):
            return super().evict_for_alloc(params, allocation_reclaim_satisfied=allocation_reclaim_satisfied)
        early, rest = self.byte_budget.states_first(params)
        if not (rest.num_tokens or rest.swa_num_tokens or rest.mamba_num):
            return early
        late = super().evict_for_alloc(rest)
        late.num_tokens_evicted += early.num_tokens_evicted
        late.swa_num_tokens_evicted += early.swa_num_tokens_evicted
        late.mamba_num_evicted += early.mamba_num_evicted
        return late

    def init_load_back(self, params: Any) -> Any:
        if not self.tiers_on():
            return super().init_load_back(params)
        return self.host_tier.init_load_back(params, super().init_load_back)

    def write_backup_storage(self, node_id: Any) -> None:
        if self.host_tier.stores(node_id):
            super().write_backup_storage(node_id)

    # kv_mode "recompute": the request's recomputed tail KV stays its own (own_tail.py); the
    # insert reads the request's record for the provenance of what it inserts
    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        if self.planner.would_adopt_inexact_kv(req, up_to):
            up_to = 0   # no insert while it runs (SGLang's empty insert): it keeps its own KV
        record = record_of(req)
        history = self.sessions.history(req) if self._in_session(req) or self.sessions.released else None
        self.inserting = InsertContext(record, len(req.origin_input_ids), history=history,
                                       transferred=self._transferred())
        try:
            with self.claims.claiming(req) if owns_tail(record) else nullcontext():
                super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            if self.kv_past_state.keeps(req, up_to):
                self.kv_past_state.insert(req, up_to)
        finally:
            self.inserting = None
            self.sessions.released = None

    def insert(self, params):
        if self.claims.armed is None:   # no recompute tail waits to be claimed by this insert
            return super().insert(params)
        return self.claims.insert(params, super().insert)

    def claim_kv_row(self, req: Any) -> bool:
        if not self._in_session(req):
            return super().claim_kv_row(req)
        return self.sessions.claim_kv_row(req, super().claim_kv_row)

    def release_session(self, session_id: str) -> None:
        self.sessions.release_session(session_id)
        super().release_session(session_id)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self.sessions.released = None   # an aborted session turn released without an insert
        record = record_of(req)
        if record is not None and record.own_kv is not None:
            self.claims.release(req)
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
