"""SGLang adapter: the Mamba (linear-state) component of `--radix-cache-backend linearkv`.

One table, `CACHING`, says for each kind of request (`request_kind`) what it inserts into the
tree, what it does with its linear state, at its match and when it is cached, and what its
inserts' provenance is decided from; the component's methods (and `track_provenance`, after a
registration's match) read it in one place (`rule_of`) and do nothing else by kind:

| kind             | inserts      | state at the match            | state when cached                  | provenance     |
|------------------|--------------|-------------------------------|------------------------------------|----------------|
| plain, fallback  | Tail-Replay  | Tail-Replay                   | Tail-Replay                        | its plan       |
| register_kv      | every token  | SGLang's                      | withheld (a KV-only chunk)         | from scratch   |
| register_state   | every token  | SGLang's                      | the exact end state (see `END`)    | from scratch   |
| register_hit     | every token  | cleared (a throw-away prefill)| withheld                           | unknown        |
| assembled        | up to c_1    | Tail-Replay (its plan over P) | withheld (approximate past c_1)    | unknown        |

Provenance is decided in one place, Tail-Replay's (`provenance.writes`, from the request's
Tail-Replay record); this column says what that record holds. "its plan": Tail-Replay's planner
set it at the match. "from scratch": a registration prefilled in full from the zero state, at
position 0 of its namespace, computes its KV and end state exactly: its record gets an exact
plan (`FROM_SCRATCH`, a miss: nothing reused). "unknown": no plan (fail closed, never exact): a
registration hit's last token runs from a cleared state (its other tokens are the tree's own);
an assembled request reads chunk KV out of position (its plan over P is dropped at its load).

A fallback is a request with chunks served as a plain prefill (a chunk missed, or its layout no
longer fits the prompt as served); an assembled request one whose chunk KV was placed at admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from sglang_ext.linearkv.serving import LinearKVRequest, record_of
from sglang_ext.tail_replay import HitKind, ReplayPlan, TailReplayMambaComponent
from sglang_ext.tail_replay import record_of as tail_replay_record_of

#: what a request inserts: Tail-Replay's rules decide | every token of the sequence | [0, c_1) only
TAIL_REPLAY, ALL, PREFIX = "tail_replay", "all", "prefix"
#: what happens to its state: Tail-Replay's rules | SGLang's own rules (match) | cleared (match) |
#: kept out of the tree, freed at release | the exact end state goes into the tree (SGLang's
#: rules; under `extra_buffer` the request's own slot, which holds the state at the chunk's end, is
#: donated). END calls SGLang's `MambaComponent` directly: Tail-Replay's rules would withhold a
#: registration's state on a server that keeps no checkpoints (`keep_checkpoints: false`).
STOCK, CLEAR, WITHHOLD, END = "stock", "clear", "withhold", "end"
#: what its inserts' provenance is decided from (module docstring): its Tail-Replay plan | an
#: exact plan from position 0 (`FROM_SCRATCH`) | no plan (unknown: never exact)
PLANNED, EXACT_FROM_SCRATCH, UNKNOWN = "planned", "from_scratch", "unknown"
#: the plan of a registration prefilled in full from the zero state: nothing reused, all exact
FROM_SCRATCH = ReplayPlan(HitKind.MISS, matched_tokens=0, prefix_len=0, replay_start=0)


@dataclass(frozen=True)
class CachingRule:
    inserts: str
    at_match: str
    when_cached: str
    provenance: str


CACHING: dict[str, CachingRule] = {
    "plain": CachingRule(TAIL_REPLAY, TAIL_REPLAY, TAIL_REPLAY, PLANNED),
    "fallback": CachingRule(TAIL_REPLAY, TAIL_REPLAY, TAIL_REPLAY, PLANNED),
    "register_kv": CachingRule(ALL, STOCK, WITHHOLD, EXACT_FROM_SCRATCH),
    "register_state": CachingRule(ALL, STOCK, END, EXACT_FROM_SCRATCH),
    "register_hit": CachingRule(ALL, CLEAR, WITHHOLD, UNKNOWN),
    "assembled": CachingRule(PREFIX, TAIL_REPLAY, WITHHOLD, UNKNOWN),
}


def request_kind(record: LinearKVRequest | None) -> str:
    """The kind (a key of `CACHING`) of a request with this LinearKV record. Reads only."""
    if record is None:
        return "plain"
    if record.register:
        if record.register_hit:
            return "register_hit"
        return "register_state" if record.keep_state else "register_kv"
    return "assembled" if record.assembled else "fallback"


def rule_of(req: Any) -> CachingRule:
    return CACHING[request_kind(record_of(req))]


def track_provenance(cache: Any, req: Any) -> None:
    """After a registration's match (its kind is known): its Tail-Replay record says what its
    inserts are computed from (`CACHING`'s provenance column), for Tail-Replay's one provenance
    decision to read. "from scratch": the record (created with the request's config,
    `cache.request_record`) gets the exact plan `FROM_SCRATCH`; it is the server's own run, not
    traffic, so Tail-Replay's request counters skip it. "unknown": any plan an earlier match left
    is dropped. May mutate: the request's Tail-Replay record."""
    provenance = rule_of(req).provenance
    if provenance == EXACT_FROM_SCRATCH:
        record = cache.request_record(req)
        record.set_plan(FROM_SCRATCH)
        record.done.update(("plan_recorded", "exactness_recorded"))
    elif provenance == UNKNOWN:
        untrack(req)


def untrack(req: Any) -> None:
    """Drop the plan an earlier match of `req` left on its Tail-Replay record, if any (a
    registration's re-match then runs SGLang's own match, as its first did). May mutate: that record."""
    record = tail_replay_record_of(req)
    if record is not None:
        record.drop_plan()


class LinearKVMambaComponent(TailReplayMambaComponent):
    """Tail-Replay's Mamba component, with each request kind's rule from `CACHING`."""

    def finalize_match_result_in_cache(self, params, result):
        """May mutate: the request's deferred copy-on-write / clear (a registration hit starts clear)."""
        rule = rule_of(params.req) if params.req is not None else CACHING["plain"]
        if rule.at_match == CLEAR:
            if params.cow_mamba and params.req.kv.holds_mamba:
                params.req.kv.mamba_cow_src_index = None
                params.req.kv.mamba_needs_clear = True
            return result
        return super().finalize_match_result_in_cache(params, result)   # a registration has no plan: SGLang's

    def prepare_for_caching_req(self, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> int:
        """The length of `req`'s sequence to insert. May mutate: `insert_params.mamba_value` /
        `mamba_keep_idx`, the records' withheld / donated marks, the request's state slot (END
        under `extra_buffer`), the cache's chunk transitions (END, finished)."""
        rule = rule_of(req)
        if rule.when_cached == TAIL_REPLAY:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        if rule.when_cached == END:
            if is_finished:
                self.cache.keep_transition(req)
                if self.cache.enable_mamba_extra_buffer:
                    return self._donate_end_state(req, insert_params, token_ids_len)
            return MambaComponent.prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished)
        self._withhold(req, insert_params)
        return min(token_ids_len, record_of(req).plan.prefix_end) if rule.inserts == PREFIX else token_ids_len

    def _donate_end_state(self, req: Any, insert_params: Any, token_ids_len: int) -> int:
        """A finished registration under `extra_buffer`: SGLang would keep the state it last
        tracked (on its grid, not at the chunk's end); the request's own slot holds the state at the
        chunk's end (a registration decodes nothing), so that slot is donated with the whole key
        and a fresh one takes its place for SGLang's release to free. No slot to spare (after
        eviction): the chunk is kept without its state (a seed that needs it misses)."""
        pool = self.cache.req_to_token_pool
        fresh = pool.mamba_allocator.alloc(1)
        if fresh is None:
            self.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
            fresh = pool.mamba_allocator.alloc(1)
        insert_params.mamba_value = None
        if fresh is not None:
            insert_params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(-1).clone()
            req.kv.mamba_pool_idx = fresh[0]
        insert_params.mamba_keep_idx = None
        record_of(req).end_donated = True
        return token_ids_len

    def _withhold(self, req: Any, insert_params: Any) -> None:
        """Keep the request's state out of the tree: marked on its Tail-Replay record where it has
        one (an assembled request: Tail-Replay's cleanup frees it), else on its own."""
        tr = tail_replay_record_of(req)
        if tr is not None:
            tr.withhold_state()
        else:
            record_of(req).state_withheld = True
        insert_params.mamba_value = None

    def cleanup_after_caching_req(self, req: Any, is_finished: bool, insert_result: Any = None,
                                  insert_params: Any = None) -> None:
        """May mutate: the request's state slots (freed when finished), the records' marks."""
        own = record_of(req)
        rule = rule_of(req)
        if own is not None and own.state_withheld:
            own.state_withheld = False
            if is_finished:
                self.cache.req_to_token_pool.free_mamba_cache(req)
                return
        if own is not None and own.end_donated:   # is_finished, extra_buffer: see _donate_end_state
            own.end_donated = False
            donated = insert_params.mamba_value if insert_params is not None else None
            if donated is not None and (insert_result is None or insert_result.mamba_exist):
                self._free_mamba_value(donated)   # the tree kept its own copy
            self.cache.req_to_token_pool.free_mamba_cache(req)   # the fresh slot and the ping-pong slots
            self.cache.tie_transition(req)
            return
        if rule.when_cached == END:
            MambaComponent.cleanup_after_caching_req(self, req, is_finished, insert_result, insert_params)
            if is_finished:
                self.cache.tie_transition(req)
            return
        return super().cleanup_after_caching_req(req, is_finished, insert_result, insert_params)

    def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
        """A node's state freed on the device takes its chunk's transition with it (`transitions`).
        May mutate: the node's state, the cache's transitions."""
        if EvictLayer.DEVICE in target and node.component_data[self.component_type].value is not None \
                and self.cache.transitions is not None:
            self.cache.transitions.drop_with(node)
        return super().evict_component(node, device_frees, host_frees, cache_actions, target=target)
