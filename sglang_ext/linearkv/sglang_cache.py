"""SGLang adapter: `--radix-cache-backend linearkv` (a Tail-Replay cache that also assembles
position-independent chunks; the pure core is `sglang_ext/linearkv/serving.py`).

A request's way through it (seams in `patches/linearkv_request.py` and this class):
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

import functools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from sglang_ext.linearkv.ops import rerotate_keys
from sglang_ext.linearkv.prepass import (
    PrePass,
    StateSeed,
    reads_done,
    write_seed,
)
from sglang_ext.linearkv.serving import (
    BACKEND_NAME,
    COMPOSING_RULES,
    RECORD_ATTR,
    LinearKVConfig,
    LinearKVRequest,
    capture_of,
    check_server_flags,
    fallback_record,
    is_chunk_namespace,
    is_registration,
    plan_chunks,
    request_field,
    tenant_namespace,
)
from sglang_ext.linearkv.serving import record_of as serving_record_of
from sglang_ext.tail_replay import TailDecay, TailReplayMambaComponent, TailReplayRadixCache, record_of

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

__all__ = ["BACKEND_NAME", "LinearKVRadixCache", "linearkv_cache_factory", "linearkv_record"]

logger = logging.getLogger(__name__)

#: chunk transitions kept (by content); beyond this many the least recently stored go
MAX_TRANSITIONS = 65536


linearkv_record = serving_record_of   # the record of SGLang's Req (serving.record_of)


def _record_for(req: Any, config: LinearKVConfig) -> LinearKVRequest | None:
    """The request's record, parsed once from its custom_params (validated on arrival); None for
    requests without LinearKV fields."""
    record = linearkv_record(req)
    if record is not None:
        return record
    custom = getattr(req.sampling_params, "custom_params", None)
    value = request_field(custom)
    if value is None:
        return None
    if is_registration(custom):
        record = LinearKVRequest(register=True, keep_state=value.get("keep_state", True) is not False)
    else:
        n = len(req.origin_input_ids)
        try:
            record = LinearKVRequest(plan=plan_chunks(value, n, config))
        except ValueError as exc:
            # validated on arrival (HTTP 400), so only a prompt SGLang cut afterwards
            # (--allow-auto-truncate) gets here: served as a plain prefill, and said so
            record = fallback_record(value, n, f"chunks not served on the {n}-token prompt as served: {exc}")
    setattr(req, RECORD_ATTR, record)
    return record


class KeyRelocator:
    """Copies chunk KV between pool slots, re-rotating keys by the chunk's new offset."""

    def __init__(self, kv_pool: Any, layers: list[tuple[int, Any]]):
        self.kv_pool = kv_pool
        self.layers = layers   # (layer id, rotary module or None for NoPE)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        for layer_id, rotary in self.layers:
            k = self.kv_pool.get_key_buffer(layer_id)
            v = self.kv_pool.get_value_buffer(layer_id)
            keys = k[src]
            if rotary is not None and delta:
                keys = rerotate_keys(keys.float(), delta, rotary.rotary_dim, float(rotary.base),
                                     neox=bool(rotary.is_neox_style)).to(k.dtype)
            k[dst] = keys
            v[dst] = v[src]


def attention_layers(model: Any) -> list[tuple[int, Any]]:
    """(layer id, rotary embedding or None) of every full-attention layer of an SGLang model."""
    from sglang.srt.layers.radix_attention import RadixAttention

    out = {}
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, RadixAttention):
            out[attn.layer_id] = getattr(module, "rotary_emb", None)
    return sorted(out.items())


def only_mamba2(model: Any) -> bool:
    """Whether every linear layer of an SGLang model is a Mamba-2 mixer (none is GDN)."""
    from sglang.srt.layers.attention.mamba.mamba import MambaMixer2
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    mods = list(model.modules())
    return any(isinstance(m, MambaMixer2) for m in mods) and not any(isinstance(m, RadixLinearAttention) for m in mods)


def check_rotary(layers: list[tuple[int, Any]]) -> None:
    """Only plain RoPE (any rotary_dim, NeoX or GPT-J pairing) and NoPE can be re-rotated exactly."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    for layer_id, rotary in layers:
        if rotary is not None and type(rotary) is not RotaryEmbedding:
            raise ValueError(f"--radix-cache-backend linearkv: attention layer {layer_id} uses "
                             f"{type(rotary).__name__} (scaled or multimodal RoPE); only plain RoPE and "
                             "NoPE keys can be moved to a new offset")


class LinearKVMambaComponent(TailReplayMambaComponent):
    """Tail-Replay's Mamba component; chunk registrations keep their exact end state, assembled
    requests publish nothing past their tree prefix, requests whose chunks were not all served
    (fallback: Tail-Replay over P, the rest prefilled) follow Tail-Replay's rules."""

    def prepare_for_caching_req(self, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> int:
        record = linearkv_record(req)
        if record is None:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        if record.register and not record.register_hit and not record.keep_state:
            self._withhold(req, insert_params)   # a KV-only chunk
            return token_ids_len
        if record.register and not record.register_hit:
            if is_finished:
                self.cache.keep_transition(req)
                if self.cache.enable_mamba_extra_buffer:
                    return self._donate_end_state(req, insert_params, token_ids_len)
            return MambaComponent.prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished)
        if not (record.register_hit or record.assembled):   # a fallback: Tail-Replay's rules
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        self._withhold(req, insert_params)
        if record.assembled:
            return min(token_ids_len, record.plan.prefix_end)
        return token_ids_len

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
        linearkv_record(req).end_donated = True
        return token_ids_len

    def _withhold(self, req: Any, insert_params: Any) -> None:
        tr = record_of(req)
        if tr is not None:
            tr.withhold_state()
        else:
            linearkv_record(req).state_withheld = True
        insert_params.mamba_value = None

    def cleanup_after_caching_req(self, req: Any, is_finished: bool, insert_result: Any = None,
                                  insert_params: Any = None) -> None:
        own = linearkv_record(req)
        if own is not None and own.state_withheld:
            own.state_withheld = False
            if is_finished:
                self.cache.req_to_token_pool.free_mamba_cache(req)
                return
            return MambaComponent.cleanup_after_caching_req(self, req, is_finished, insert_result, insert_params)
        if own is not None and own.end_donated:   # is_finished, extra_buffer: see _donate_end_state
            own.end_donated = False
            donated = insert_params.mamba_value if insert_params is not None else None
            if donated is not None and (insert_result is None or insert_result.mamba_exist):
                self._free_mamba_value(donated)   # the tree kept its own copy
            self.cache.req_to_token_pool.free_mamba_cache(req)   # the fresh slot and the ping-pong slots
            return
        record = linearkv_record(req)
        if record is not None and record.register and not record.register_hit and record.keep_state:
            return MambaComponent.cleanup_after_caching_req(self, req, is_finished, insert_result, insert_params)
        return super().cleanup_after_caching_req(req, is_finished, insert_result, insert_params)   # withheld too

    def finalize_match_result_in_cache(self, params, result):
        record = linearkv_record(params.req) if params.req is not None else None
        if record is not None and record.register:
            if record.register_hit and params.cow_mamba and params.req.kv.holds_mamba:
                params.req.kv.mamba_cow_src_index = None
                params.req.kv.mamba_needs_clear = True
            if record.register_hit:
                return result
            return MambaComponent.finalize_match_result_in_cache(self, params, result)
        return super().finalize_match_result_in_cache(params, result)


class LinearKVRadixCache(TailReplayRadixCache):
    linearkv_config: LinearKVConfig = LinearKVConfig()
    chunk_namespace: str = ""
    relocator: KeyRelocator | None = None
    #: whether the model's linear layers are all Mamba-2 (chunk transitions are per-head decays)
    can_compose: bool = False
    #: chunk token ids -> {Mamba-2 layer id: decay [heads] fp32}, set by `keep_transition`
    transitions: OrderedDict | None = None

    def _branch_repair_depth(self, record: Any, planned: Any, prompt_len: int) -> int | None:
        """Tail-Replay's shared-state repair at the branch is not used here: a LinearKV tree's
        branches are chunk registrations and their continuations, not prompts that share a
        prefix, and its background runs would compete with the chunk traffic for state slots
        (the lazy rule below a shared approximate state still runs). Reads nothing."""
        return None

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
        key = (req.extra_key, req.cache_salt, tuple(req.origin_input_ids))
        self.transitions[key] = {layer: s.exp() for layer, s in decay.sums.items()}
        self.transitions.move_to_end(key)
        while len(self.transitions) > MAX_TRANSITIONS:
            self.transitions.popitem(last=False)

    def _transitions_of(self, req: Any, chunks: Any) -> list[dict] | None:
        ids = req.origin_input_ids
        space, salt = self.chunk_space(req)
        out = [self.transitions.get((space, salt, tuple(ids[s:e]))) for s, e in chunks]
        return None if any(t is None for t in out) else out

    def chunk_space(self, req: Any) -> tuple[str, str | None]:
        """(`extra_key`, cache salt) under which a request's chunks are registered: its tenant's
        chunk namespace (`serving.tenant_namespace`), with its salt."""
        return tenant_namespace(self.chunk_namespace, req.extra_key), req.cache_salt

    # ---- match -------------------------------------------------------------------------------
    def _match_tree(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        record = None if req is None else _record_for(req, self.linearkv_config)
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
        key = params.key
        n = len(key.token_ids)
        found = self._find_chunk(key.token_ids, 0, n, need_state=record.keep_state,
                                 space=(key.extra_key, key.cache_salt))
        result = self.tree_core.match_prefix(MatchPrefixParams(key=key))
        self._apply_cache_actions(result.cache_actions)
        if found is not None and result.device_prefix_len >= n - 1 and (not (self.can_compose and record.keep_state)
                or (key.extra_key, key.cache_salt, tuple(key.token_ids)) in self.transitions):
            record.register_hit = True
            result = result._replace(device_prefix_len=n - 1)
        else:
            if self.can_compose:
                record.capture = (TailDecay(), 0, n)
            root = self.root_node_handle(key.extra_key)
            result = result._replace(device_prefix_len=0, last_device_node=root, last_host_node=root,
                                     best_match_node=root, mamba_branching_seqlen=None)
        return UnifiedFinalize.finalize(self, params, result)

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

    def _chunk_nodes(self, req: Any, record: LinearKVRequest) -> tuple[list[Any], Any] | None:
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
        if composing and self._transitions_of(req, state_spans) is None:
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

    def _prefix_node(self, req: Any, record: LinearKVRequest) -> tuple[Any, Any] | None:
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
        prefix_node = self._prefix_node(req, record)
        found = None if prefix_node is None else self._chunk_nodes(req, record)
        if found is None:
            record.chunks_missed = len(plan.chunks)
            record.recomputed_tokens = len(req.origin_input_ids) - result.device_prefix_len
            return result
        record.chunks_hit = len(plan.chunks)
        return result._replace(host_hit_length=plan.forward_start - result.device_prefix_len)

    # ---- admission: place the chunk KV into the request's own slots ---------------------------
    def init_load_back(self, params: Any):
        req = params.req
        record = None if req is None else linearkv_record(req)
        if record is None or record.plan is None or record.register or record.chunks_hit == 0:
            return super().init_load_back(params)
        loaded = self._assemble(req, record)
        return loaded, req.last_node

    def load_back_is_cache_owned(self) -> bool:
        return False   # the assembled slots are the request's own; the tree owns only [0, p0)

    def _assemble(self, req: Any, record: LinearKVRequest) -> int:
        """Copy the KV into fresh slots and seed the question's state; the number of tokens placed
        (0: declined). The copies run on the scheduler's stream at admission; SGLang's overlap
        scheduler makes the forward stream wait on that stream before it launches the batch that
        reads them, and the source nodes stay locked until the copies are enqueued (those whose
        states a seed reads later, the deferred copy-on-write's or EPIC's pre-pass's, until the
        request's first forward has read them: `release_read_locks`)."""
        plan = record.plan
        prefix = self._prefix_node(req, record)
        found = None if prefix is None else self._chunk_nodes(req, record)
        if found is None:
            self._declined(req, record)
            return 0
        prefix_node, prefix_root = prefix
        nodes, prefix_state = found
        sources = [prefix_node, *nodes, *([prefix_state] if prefix_state is not None else [])]
        locks = [self.lock(node) for node in sources]
        keep: list[int] = []   # indices of the locks held until the first forward has read the states
        try:
            p0 = record.tree_prefix_len
            total = plan.forward_start - p0
            slots = self._alloc(total)
            if slots is None:
                self._declined(req, record)
                return 0
            self._copy_prefix(prefix_node, prefix_root, p0, slots[:plan.prefix_end - p0])
            for node, (start, end) in zip(nodes, plan.chunks):
                end = min(end, plan.forward_start)   # a replayed tail is computed by the forward
                if end <= start:
                    continue
                src = self.tree_core.collect_full_device_indices(node, self.root_node_handle(self.chunk_space(req)[0]))
                self.relocator.copy(src[:end - start], slots[start - p0:end - p0], delta=start)
            if not self._seed_state(req, record, nodes, prefix_state):
                self.token_to_kv_pool_allocator.free(slots)
                self._declined(req, record)
                return 0
            if plan.heads and not plan.seeds_zero:
                keep = list(range(1, len(locks)))   # the seeds of EPIC's heads read these nodes' states
            elif record.state_source == "predecessor":
                keep = [len(nodes)]                 # the question's copy-on-write reads the last chunk's
        finally:
            for i, lock in enumerate(locks):
                if i not in keep:
                    self.unlock(lock)
        record.locks = [locks[i] for i in keep]
        record.reads_done = None
        record.slots = slots
        record.assembled = True
        record.reused_tokens = plan.chunk_tokens - plan.recomputed_chunk_tokens
        record.recomputed_tokens = len(req.origin_input_ids) - plan.forward_start + plan.head_tokens
        tr = record_of(req)
        if tr is not None:   # the Tail-Replay plan over P was only the fallback
            tr.drop_plan()
        return total

    def _declined(self, req: Any, record: LinearKVRequest) -> None:
        """The load is declined: the request runs Tail-Replay's plan over P and prefills the rest."""
        record.chunks_hit, record.chunks_missed = 0, len(record.plan.chunks)
        record.recomputed_tokens = len(req.origin_input_ids) - record.tree_prefix_len

    def _alloc(self, n: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        slots = allocator.alloc(n)
        if slots is None:
            self.evict_for_alloc(EvictParams(num_tokens=n))
            slots = allocator.alloc(n)
        return slots

    def _copy_prefix(self, prefix_node: Any, root: Any, start: int, dst: torch.Tensor) -> None:
        """The exact KV of [start, c_1) (the part of P the tree prefix does not cover)."""
        if len(dst) == 0:
            return
        path = self.tree_core.collect_full_device_indices(prefix_node, root)
        self.relocator.copy(path[start:start + len(dst)], dst, delta=0)

    def _take_state_slots(self, req: Any) -> bool:
        """Take every state slot the request will hold now, at its load: its own state and, under
        `extra_buffer`, its ping-pong track slots (SGLang would take those after admission, when
        the chunk states this load locks can no longer be evicted to make room, and asserts if
        they are not there). False (nothing taken): not enough slots even after eviction."""
        pool = self.req_to_token_pool
        kv = req.kv
        tracking = (pool.mamba_initial_tracking_slots
                    if self.enable_mamba_extra_buffer and kv.mamba_ping_pong_track_buffer is None else 0)
        needed = (0 if kv.holds_mamba else 1) + tracking
        allocator = pool.mamba_allocator
        if allocator.schedulable_available_size() < needed:
            self.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=needed - allocator.schedulable_available_size()))
        if allocator.schedulable_available_size() < needed:
            return False
        if not kv.holds_mamba:
            kv.mamba_pool_idx = allocator.alloc(1)[0]
            write_pos = pool.mamba_pool.replayssm_write_pos
            if write_pos is not None:   # a fresh slot starts an empty ring (as SGLang's alloc does)
                write_pos[kv.mamba_pool_idx] = 0
        if tracking:
            pool._alloc_ping_pong_buffer(req)
        return True

    def _seed_state(self, req: Any, record: LinearKVRequest, nodes: list[Any], prefix_state: Any) -> bool:
        """Seed the question's state slot by the plan's state rule (predecessor: a deferred
        copy-on-write of the last chunk's; zero: a deferred clear; compose: folded in now), and
        leave EPIC's heads, if any, to the worker's pre-pass (`prepass.py`), which then writes a
        composed question seed itself (its stages overwrite the slot). False (nothing changed): no
        state slot to be had, even after eviction; the load is then declined."""
        kv = req.kv
        if not self._take_state_slots(req):
            return False
        plan = record.plan
        kv.mamba_cow_src_index = None
        kv.mamba_needs_clear = False
        question = self._seed_after(req, plan, len(plan.chunks), nodes, prefix_state)
        if plan.state == "predecessor":
            kv.mamba_cow_src_index = question.slots[0]
        elif plan.seeds_zero:
            kv.mamba_needs_clear = True
        elif not plan.heads:
            write_seed(self.req_to_token_pool, question, kv.mamba_pool_idx)
        record.state_source = plan.state
        if plan.heads:
            heads = [(s, e, self._seed_after(req, plan, j, nodes, prefix_state)) for j, (s, e) in enumerate(plan.heads)]
            record.prepass = PrePass(heads, question if plan.state in COMPOSING_RULES else None)
        return True

    def _seed_after(self, req: Any, plan: Any, j: int, nodes: list[Any], prefix_state: Any) -> StateSeed:
        """The state rule's seed for a span after P and chunks[:j] (the reference path's per-span
        rule, `initializers.STATE_RULES`): zero; predecessor: chunk j-1's end state (j = 0: P's,
        zero without P); compose: P's and chunks[:j]'s folded through their decays."""
        sources = ([prefix_state] if prefix_state is not None else []) + list(nodes[:j])
        if plan.seeds_zero or not sources:
            return StateSeed("zero")
        slots = tuple(self.tree_core.get_component_device_value(n, ComponentType.MAMBA) for n in sources)
        if plan.state == "predecessor":
            return StateSeed("copy", slots[-1:])
        spans = ([(0, plan.prefix_end)] if plan.prefix_end else []) + list(plan.chunks[:j])
        decays = self._transitions_of(req, spans)
        assert decays is not None, "linearkv: a composed chunk lost its transition after its match"
        return StateSeed("compose", slots, tuple(decays))

    def prefix_device_indices(self, req: Any) -> torch.Tensor:
        record = linearkv_record(req)
        slots = None if record is None else record.slots
        if record is None or not record.assembled or slots is None:
            return super().prefix_device_indices(req)
        p0 = record.tree_prefix_len
        path = self.tree_core.collect_full_device_indices(req.last_node, self.root_node_handle(req.extra_key))
        out = torch.cat([path[:p0].to(torch.int64), slots.to(torch.int64)])
        assert len(out) == req.prefix_len, (req.rid, len(out), req.prefix_len)
        record.slots = None   # the row owns them from here on (freed at release)
        return out

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


@functools.lru_cache(maxsize=1)
def server_linearkv_config() -> LinearKVConfig:
    from sglang_ext.env import linearkv_config_text
    from sglang_ext.linearkv.serving import parse_config

    return parse_config(linearkv_config_text())


def linearkv_cache_factory(ctx: Any) -> Any:
    """`--radix-cache-backend linearkv`: SGLang calls this once per scheduler at start-up."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from sglang_ext.tail_replay import check_scheduler_start, server_config

    config = server_linearkv_config()
    tail_config = server_config()
    check_scheduler_start(ctx, tail_config)
    if not ctx.is_hybrid_ssm:
        raise ValueError("--radix-cache-backend linearkv needs a hybrid model with linear-attention "
                         "or SSM layers (GDN, Mamba-2); this model has none")
    check_server_flags(ctx.server_args)
    model = ctx.tp_worker.model_runner.model
    layers = attention_layers(model)
    check_rotary(layers)
    can_compose = only_mamba2(model)
    if config.state in COMPOSING_RULES and not can_compose:
        raise ValueError(f"--linearkv-config key 'state': {config.state!r} is served for Mamba-2 models only "
                         "(this model has GDN layers, whose chunk transition is a matrix per head)")
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}),
        ComponentType.MAMBA: LinearKVMambaComponent,
    }
    cache_class = type("LinearKVRadixCache", (LinearKVRadixCache,), {
        "tail_replay_config": tail_config, "linearkv_config": config,
        "chunk_namespace": chunk_namespace(ctx.server_args), "can_compose": can_compose})
    cache = create_unified_radix_cache(ctx, cache_class=cache_class)
    cache.transitions = OrderedDict()
    cache.relocator = KeyRelocator(cache.token_to_kv_pool_allocator.get_kvcache(), layers)
    hide_chunk_events(cache.tree_core.kv_events)
    return cache


def hide_chunk_events(recorder: Any) -> None:
    """Leave chunk registrations out of SGLang's KV events (`--kv-events-config`): a chunk's KV
    sits at offset 0 of a namespace no prompt matches, so a router that took it for a prompt
    prefix would route by a false affinity. Stores and removals of every other node pass."""
    store, remove = recorder.record_store, recorder.record_remove

    @functools.wraps(store)
    def record_store(node: Any, *args: Any, **kwargs: Any) -> None:
        if not is_chunk_namespace(node.key.extra_key):
            store(node, *args, **kwargs)

    @functools.wraps(remove)
    def record_remove(node: Any, *args: Any, **kwargs: Any) -> None:
        if not is_chunk_namespace(node.key.extra_key):
            remove(node, *args, **kwargs)

    recorder.record_store, recorder.record_remove = record_store, record_remove


def chunk_namespace(server_args: Any) -> str:
    from sglang_ext.linearkv.serving import namespace

    return namespace(str(getattr(server_args, "served_model_name", None) or server_args.model_path))
