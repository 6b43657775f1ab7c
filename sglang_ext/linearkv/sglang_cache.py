"""SGLang adapter: `--radix-cache-backend linearkv` (a Tail-Replay cache that also assembles
position-independent chunks; the pure core is `sglang_ext/linearkv/serving.py`).

A request's way through it (seams in `patches/linearkv/request.py` and this class; the admission
is the `assembly.ChunkAssembly` part, the state rules per request kind `mamba_component`, the start-up
`factory`):
1. Arrival (tokenizer process): the chunks are found (token spans, or a separator string), and
   one registration prefill per chunk and one for P (`max_new_tokens: 0`,
   `custom_params.linearkv.register`, `extra_key` = the model's chunk namespace) run before the
   request is sent on. A chunk already
   registered costs a one-token throw-away prefill (`register_hit`); a new one is prefilled on its
   own from a zero state and inserted with its end state (the tree's Mamba component keeps it).
2. Match (scheduler): the prefix P = [0, c_1) is matched as Tail-Replay matches any prompt (its
   plan gives the tree prefix p0 <= c_1, and the fallback if the chunks cannot be used); P's KV
   comes from the tree path, or from P's registration when the plan uses none of the tree. Every chunk
   is looked up in the namespace; all present (and, for `predecessor`, the last one's end state)
   -> the match reports the tokens [p0, question_start) as a load-back (SGLang's
   `host_hit_length`), so admission budgets their slots like a HiCache load.
3. Admission (`init_load_back`): the chunk nodes are locked, fresh slots allocated, the tree's KV of
   [p0, c_1) copied and each chunk's KV copied with keys re-rotated to its offset (RoPE composes:
   R(c_j) R(p) = R(c_j + p); the model's own rotary dims and base; NoPE attention is a plain copy);
   the question's linear state is the last chunk's end state (copy-on-write from its node), zero, or
   (Mamba-2) the chunks' states composed. With selector `epic-k` each chunk's head is left to the
   worker's pre-pass with its seed (`prepass.py`). Nodes whose states are read later stay locked
   until the request's first forward has run. Any chunk gone by now -> the load is declined and
   the request runs Tail-Replay's plan over P and prefills the rest.
4. Forward: EPIC's heads (pre-pass, one extend forward per chunk index), then Q (chunked prefill,
   CUDA graphs and the scheduler are untouched).
5. Caching: an assembled request publishes nothing past c_1 (its chunk KV, question KV and states
   are approximate); SGLang's release frees every slot past the tree-owned prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from sglang_ext.linearkv.assembly import ChunkAssembly
from sglang_ext.linearkv.mamba_component import track_provenance, untrack
from sglang_ext.linearkv.model_layers import KeyRelocator
from sglang_ext.linearkv.prepass import reads_done
from sglang_ext.linearkv.serving import (
    BACKEND_NAME,
    COMPOSING_RULES,
    RECORD_ATTR,
    LinearKVConfig,
    LinearKVRequest,
    capture_of,
    parse_record,
    served_exactly,
    tenant_namespace,
)
from sglang_ext.linearkv.serving import record_of as serving_record_of
from sglang_ext.linearkv.transitions import ChunkTransitions, transition_key
from sglang_ext.tail_replay import TailDecay, TailReplayRadixCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

__all__ = ["BACKEND_NAME", "LinearKVRadixCache", "linearkv_record"]

logger = logging.getLogger(__name__)

linearkv_record = serving_record_of   # the record of SGLang's Req (serving.record_of)


def _record_for(req: Any, config: LinearKVConfig, can_compose: bool,
                strict: Callable[[Any], bool]) -> LinearKVRequest | None:
    """The request's record, parsed once from its custom_params (validated on arrival) on the
    prompt as served (`serving.parse_record`); None for requests without LinearKV fields. A planned
    request whose exactness is strict (`strict(req)`: its resolved Tail-Replay config) is served
    as a plain prefill instead (`serving.served_exactly`): assembly is never exact."""
    record = linearkv_record(req)
    if record is None:
        record = parse_record(getattr(req.sampling_params, "custom_params", None), len(req.origin_input_ids),
                              config, can_compose=can_compose)
        if record is not None and record.plan is not None and strict(req):
            record = served_exactly(record)
        if record is not None:
            setattr(req, RECORD_ATTR, record)
    return record


class LinearKVRadixCache(TailReplayRadixCache):
    linearkv_config: LinearKVConfig = LinearKVConfig()
    chunk_namespace: str = ""
    relocator: KeyRelocator | None = None
    #: whether the model's linear layers are all Mamba-2 (chunk transitions are per-head decays)
    can_compose: bool = False
    #: chunk key digest -> {Mamba-2 layer id: decay [heads] fp32}, set by `keep_transition`, tied
    #: to the chunk's node by `tie_transition` and dropped with its state
    transitions: ChunkTransitions | None = None

    #: Tail-Replay's branch rule is not used here (no shared-state repair at the branch, no branch
    #: point for the stock shadow): a LinearKV tree's branches are chunk registrations and their
    #: continuations, not prompts that share a prefix, and its background runs would compete with
    #: the chunk traffic for state slots (the lazy rule below a shared approximate state still runs)
    branch_repair = False

    def build_parts(self) -> None:
        """Tail-Replay's parts, and the admission of assembled requests (`ChunkAssembly`)."""
        super().build_parts()
        self.assembly = ChunkAssembly(self)

    # ---- the admission (`assembly.ChunkAssembly`; `patches/linearkv/admission.py` calls the first two)
    def open_admission_round(self, adder: Any) -> Any:
        return self.assembly.open_admission_round(adder)

    def round_slots_of(self, req: Any) -> int:
        return self.assembly.round_slots_of(req)

    def init_load_back(self, params: Any):
        return self.assembly.init_load_back(params, super().init_load_back)

    def load_back_is_cache_owned(self) -> bool:
        return False   # the assembled slots are the request's own; the tree owns only [0, p0)

    def prefix_device_indices(self, req: Any):
        return self.assembly.prefix_device_indices(req, super().prefix_device_indices)

    def reset(self) -> None:
        """SGLang's full reset (the tree is rebuilt); the transitions tied to its nodes go too."""
        super().reset()
        if self.transitions is not None:
            self.transitions = ChunkTransitions()

    # ---- chunk transitions (compose) -----------------------------------------------------------
    def keep_transition(self, req: Any) -> None:
        """At a registration's end: its summed log-decay per Mamba-2 layer -> the chunk's decays,
        kept when every layer saw every token (else the chunk cannot be composed)."""
        capture = capture_of(req)
        if capture is None:
            return
        decay, start, end = capture
        linearkv_record(req).capture = None
        if not decay.sums or any(n != end - start for n in decay.tokens.values()):
            return
        key = transition_key(req.extra_key, req.cache_salt, req.origin_input_ids)
        self.transitions.keep(key, {layer: s.exp() for layer, s in decay.sums.items()})

    def tie_transition(self, req: Any) -> None:
        """After a registration's insert: its chunk's transition is tied to the node that took
        the chunk's end state (dropped with that state, `LinearKVMambaComponent.evict_component`),
        or dropped now when the tree took none. Touches the chunk's LRU position."""
        ids = req.origin_input_ids
        key = transition_key(req.extra_key, req.cache_salt, ids)
        if key not in self.transitions:
            return
        node = self._find_chunk(ids, 0, len(ids), need_state=True, space=(req.extra_key, req.cache_salt))
        self.transitions.tie(key, None if node is None else self.tree_core.node_by_id(node))

    def transitions_of(self, req: Any, chunks: Any) -> list[dict] | None:
        ids = req.origin_input_ids
        space, salt = self.chunk_space(req)
        out = [self.transitions.get(transition_key(space, salt, ids[s:e])) for s, e in chunks]
        return None if any(t is None for t in out) else out

    def chunk_space(self, req: Any) -> tuple[str, str | None]:
        """(`extra_key`, cache salt) under which a request's chunks are registered: its tenant's
        chunk namespace (`serving.tenant_namespace`), with its salt."""
        return tenant_namespace(self.chunk_namespace, req.extra_key), req.cache_salt

    # ---- match -------------------------------------------------------------------------------
    def _match_tree(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        record = None if req is None else _record_for(req, self.linearkv_config, self.can_compose,
                                                      lambda r: self.request_record(r).config.strict)
        if record is None:
            return super()._match_tree(params)
        record.reset_match()
        self._drop_chunk_lock(req)
        self._free_unplaced(req)
        if record.register:
            return self._match_registration(params, record)
        if record.plan is None:
            result = super()._match_tree(params)
            if record.fallback is not None:   # a plain prefill past the tree prefix; every chunk missed
                record.chunks_missed = record.declared_chunks
                record.recomputed_tokens = len(req.origin_input_ids) - result.device_prefix_len
            return result
        if len(params.key) < record.plan.forward_start:
            # the scheduler capped the match below the question (input logprobs asked from a
            # position inside P or the chunks): those tokens must run in this forward, so the
            # request is served as a plain prompt and its chunks count as missed
            record.chunks_missed = len(record.plan.chunks)
            result = super()._match_tree(params)
            record.recomputed_tokens = len(req.origin_input_ids) - result.device_prefix_len
            return result
        capped = MatchPrefixParams(key=params.key[:record.plan.prefix_end], cow_mamba=params.cow_mamba, req=req)
        result = super()._match_tree(capped)
        return self._plan_chunks(req, record, result)

    def _match_registration(self, params: MatchPrefixParams, record: LinearKVRequest) -> MatchResult:
        """A chunk registration: a one-token throw-away prefill when the chunk and its end state
        are in the namespace, else a full prefill from zero (its end state is then stored)."""
        untrack(params.req)   # a re-match (after retraction) is planned anew below
        key = params.key
        n = len(key.token_ids)
        found = self._find_chunk(key.token_ids, 0, n, need_state=record.keep_state,
                                 space=(key.extra_key, key.cache_salt))
        result = self.tree_core.match_prefix(MatchPrefixParams(key=key))
        self._apply_cache_actions(result.cache_actions)
        if found is not None and result.device_prefix_len >= n - 1 and (not (self.can_compose and record.keep_state)
                or transition_key(key.extra_key, key.cache_salt, key.token_ids) in self.transitions):
            record.register_hit = True
            result = result._replace(device_prefix_len=n - 1)
        else:
            if self.can_compose:
                record.capture = (TailDecay(local_heads=True), 0, n)   # per head, on this rank's state shard
            root = self.root_node_handle(key.extra_key)
            result = result._replace(device_prefix_len=0, last_device_node=root, last_host_node=root,
                                     best_match_node=root, mamba_branching_seqlen=None)
        result = UnifiedFinalize.finalize(self, params, result)
        track_provenance(self, params.req)   # exact from scratch, or unknown (a hit): `mamba_component`
        return result

    def _find_chunk(self, token_ids: Any, start: int, end: int, need_state: bool,
                    space: tuple[str, str | None]) -> Any:
        """The node of chunk namespace `space` (`chunk_space`) holding chunk token_ids[start:end]
        in full (and its end state if `need_state`), or None. Touches the chunk's LRU position."""
        key = RadixKey(token_ids[start:end], space[0], cache_salt=space[1])
        result = self.tree_core.match_prefix(MatchPrefixParams(key=key))
        self._apply_cache_actions(result.cache_actions)
        if result.device_prefix_len != end - start:
            return None
        node = result.last_device_node
        if self.tree_core.node_by_id(node) is None:
            return None
        if need_state and self.tree_core.get_component_device_value(node, ComponentType.MAMBA) is None:
            return None
        return node

    def chunk_nodes(self, req: Any, record: LinearKVRequest) -> tuple[list[Any], Any] | None:
        """(the chunks' namespace nodes, P's namespace node when a seed reads P's state), or None
        when one is missing. P is registered as a chunk at offset 0 (its exact KV and state) by the
        request seam; `compose` folds its state, EPIC's first head starts from it (`predecessor`).
        A node must hold its end state where a seed reads it: the last chunk's for the question
        (`predecessor`), every chunk's but the last for EPIC's heads, all of them for `compose`."""
        ids = req.origin_input_ids
        plan = record.plan
        composing = plan.state in COMPOSING_RULES
        heads_read = bool(plan.heads) and plan.state == "predecessor"
        state_spans = ([(0, plan.prefix_end)] if plan.prefix_end else []) + list(plan.chunks)
        if composing and self.transitions_of(req, state_spans) is None:
            return None
        nodes = []
        for i, (start, end) in enumerate(plan.chunks):
            last = i == len(plan.chunks) - 1
            need = composing or (plan.state == "predecessor" and (last or heads_read))
            node = self._find_chunk(ids, start, end, need_state=need, space=self.chunk_space(req))
            if node is None:
                return None
            nodes.append(node)
        if not plan.prefix_end or not (composing or heads_read):
            return nodes, None
        prefix = self._find_chunk(ids, 0, plan.prefix_end, need_state=True, space=self.chunk_space(req))
        return None if prefix is None else (nodes, prefix)

    def prefix_node(self, req: Any, record: LinearKVRequest) -> tuple[Any, Any] | None:
        """(node, its root) ending the exact prefix P = [0, c_1) in full: in the radix tree, or,
        when the tree serves none of P (Tail-Replay's plan over P starts at 0), P's own
        registration in the chunk namespace (at offset 0 it is P's exact KV); None otherwise."""
        plan = record.plan
        root = self.root_node_handle(req.extra_key)
        if plan.prefix_end == 0:
            return root, root
        key = RadixKey(req.origin_input_ids[:plan.prefix_end], req.extra_key, cache_salt=req.cache_salt)
        result = self.tree_core.match_prefix(MatchPrefixParams(key=key))
        self._apply_cache_actions(result.cache_actions)
        if result.device_prefix_len == plan.prefix_end:
            return result.last_device_node, root
        if record.tree_prefix_len == 0:
            space = self.chunk_space(req)
            node = self._find_chunk(req.origin_input_ids, 0, plan.prefix_end, need_state=False, space=space)
            if node is not None:
                return node, self.root_node_handle(space[0])
        return None

    def _plan_chunks(self, req: Any, record: LinearKVRequest, result: MatchResult) -> MatchResult:
        plan = record.plan
        record.tree_prefix_len = result.device_prefix_len
        prefix_node = self.prefix_node(req, record)
        found = None if prefix_node is None else self.chunk_nodes(req, record)
        if found is None:
            record.chunks_missed = len(plan.chunks)
            record.recomputed_tokens = len(req.origin_input_ids) - result.device_prefix_len
            return result
        record.chunks_hit = len(plan.chunks)
        return result._replace(host_hit_length=plan.forward_start - result.device_prefix_len)

    # ---- release -----------------------------------------------------------------------------
    def _free_unplaced(self, req: Any) -> None:
        """Free assembled slots that never reached the request's row (its admission did not go
        on after the load, or it was matched again / released before its first forward)."""
        record = linearkv_record(req)
        slots = None if record is None else record.slots
        if slots is not None:
            record.slots = None
            self.token_to_kv_pool_allocator.free(slots)

    def _drop_chunk_lock(self, req: Any) -> None:
        record = linearkv_record(req)
        if record is None:
            return
        locks = record.locks or []
        record.locks, record.prepass, record.reads_done = None, None, None
        for lock in locks:
            self.unlock(lock)

    def release_read_locks(self, req: Any) -> None:
        """Unlock the chunk nodes whose states the request's first forward read, once it has read
        them (`prepass.reads_done`); before that, keep them."""
        record = linearkv_record(req)
        if record is not None and record.locks and reads_done(req):
            self._drop_chunk_lock(req)

    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        self.release_read_locks(req)
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._drop_chunk_lock(req)
        self._free_unplaced(req)
        record = linearkv_record(req)
        if record is not None and req.finished():
            from sglang_ext.linearkv.metrics import record_request

            record_request(record)
        super().on_release(req, checkpointed=checkpointed)


class UnifiedFinalize:
    """Call UnifiedRadixCache's finalizers directly (skipping Tail-Replay's planner)."""

    @staticmethod
    def finalize(cache: LinearKVRadixCache, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        return UnifiedRadixCache._finalize_match_result(cache, params, result)
