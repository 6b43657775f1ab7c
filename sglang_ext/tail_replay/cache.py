"""SGLang adapter: a UnifiedRadixCache whose Mamba component lets matches run as deep as the
attention KV, and a planner decision per request (`--radix-cache-backend tail_replay`).

What changes against SGLang 0.5.23's `UnifiedRadixCache` + `MambaComponent`:
- match: every node is valid for the Mamba component, so a hit is as long as the full-attention
  KV hit (L). The planner then sets the request's prefix length: a checkpoint at C (exact), or
  L - W with a zeroed linear state (approximate), or 0.
- caching: states computed after an approximate replay (and, with keep_checkpoints=False, all
  states) are never inserted; the attention KV still is.
The per-request decision goes into the request's record (`tail_replay.request`): its config
(resolved once, at the first match), the plan (a ReplayPlan) and, for exact-KV replay, `kv_slots`:
the tree's KV slots of the replayed tail, read by `patches/tail_replay_batch.py` /
`tail_replay_attention.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer, TreeComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_exec, mamba_cache_chunk_size, mamba_checkpoint_grid

from sglang_ext.tail_replay import own_tail
from sglang_ext.tail_replay.config import BACKEND_NAME, TailReplayConfig, request_overrides, server_config
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan, plan_replay
from sglang_ext.tail_replay.request import TailReplayRequest, attach, plan_of, record_of

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult

__all__ = ["BACKEND_NAME", "TailReplayRadixCache", "TailReplayMambaComponent", "tail_replay_cache_factory"]


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
        # SGLang's in-prefill checkpoint placement assumes the match ends at a state.
        return result._replace(mamba_branching_seqlen=None)

    def finalize_match_result_in_cache(self, params, result):
        plan = plan_of(params.req) if params.req is not None else None
        if plan is None or plan.kind is HitKind.EXACT_CHECKPOINT:
            return super().finalize_match_result_in_cache(params, result)
        if params.cow_mamba and params.req.kv.holds_mamba:
            params.req.kv.mamba_cow_src_index = None
            params.req.kv.mamba_needs_clear = True   # replay starts from the zero state
        return result

    def _stores_state(self, req: Any, token_ids_len: int) -> bool:
        """Only exact states, and only where the tree can hold them: without the extra buffer
        the state is the sequence-end state, and the key is cut to whole pages on insert."""
        record = record_for(self.config, req)
        exact = record.plan is None or record.plan.state_is_exact
        lands_on_its_depth = self.cache.enable_mamba_extra_buffer or token_ids_len % self.cache.page_size == 0
        return record.config.keep_checkpoints and exact and lands_on_its_depth

    def prepare_for_caching_req(self, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> int:
        withheld = not self._stores_state(req, token_ids_len)
        record_for(self.config, req).state_withheld = withheld
        if not withheld:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        insert_params.mamba_value = None   # the attention KV is still inserted in full
        return token_ids_len

    def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
        if params.mamba_value is not None:
            super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        """State pressure frees states, never attention KV.

        SGLang's walk over the state LRU hands back a whole device leaf (its attention KV too)
        when the least recently used state sits on a leaf, because without Tail-Replay a leaf's KV
        is useless once its state is gone. Here the KV is what makes a hit, so every state is freed
        the way SGLang already frees states on inner nodes: the state alone; the node, its KV and
        its place in the KV eviction order stay. Locked states (a running request's checkpoint,
        the one a planned exact-checkpoint hit is about to copy) are skipped by the LRU walk.
        With HiCache, SGLang's own walk runs (its host backups are tied to whole-leaf eviction).

        May mutate: this component's walk cursor, the victim's state value and LRU membership,
        `tracker`, `device_frees`.
        """
        if self.tree_core.enable_hicache:
            return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
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
        if self._evict_device_cursor is not None and not lru.in_list(self._evict_device_cursor):
            self._evict_device_cursor = lru.cursor_next() if by_session else lru.get_lru_no_lock()
        victim = self._evict_device_cursor
        if victim is None or not lru.in_list(victim):
            return None
        # step on now: freeing the victim unlinks it, the cursor (or its sentinel) stays put
        self._evict_device_cursor = lru.cursor_next() if by_session else lru.get_prev_no_lock(victim)
        return victim

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

    def _finalize_match_result(self, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        if params.req is not None:
            result = self._apply_replay_plan(params.req, result)
        return super()._finalize_match_result(params, result)

    def _deepest_state_on_path(self, node_id) -> tuple[int | None, int | None]:
        """(node id, depth in tokens) of the deepest node on the path holding a device state."""
        core = self.tree_core
        node, root = core.node_by_id(node_id), core.root_node
        path = []
        while node is not root:
            path.append(node)
            node = node.parent
        depth = sum(len(n.key) for n in path)
        for n in path:
            if n.component_data[ComponentType.MAMBA].value is not None:
                return n.id, depth
            depth -= len(n.key)
        return None, None

    def _apply_replay_plan(self, req: Any, result: MatchResult) -> MatchResult:
        record = record_for(self.tail_replay_config, req)
        config = record.config
        ckpt_id, ckpt_len = self._deepest_state_on_path(result.last_device_node)
        plan = plan_replay(result.device_prefix_len, ckpt_len or None, self.page_size, config)
        record.set_plan(plan)
        record.kv_slots = self._tail_kv_slots(plan, config, result.last_device_node)
        own_tail.begin(record, plan, config.kv_mode)   # recompute: the request keeps its tail KV
        if plan.kind is HitKind.EXACT_CHECKPOINT:
            return result._replace(device_prefix_len=plan.prefix_len, last_device_node=ckpt_id,
                                   last_host_node=ckpt_id, best_match_node=ckpt_id)
        if plan.kind is HitKind.MISS:
            root = self.root_node_handle(req.extra_key)
            return result._replace(device_prefix_len=0, last_device_node=root,
                                   last_host_node=root, best_match_node=root)
        return result._replace(device_prefix_len=plan.prefix_len)

    # kv_mode "recompute": the request's recomputed tail KV stays its own (own_tail.py)
    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        with own_tail.claiming(self, req):
            super().checkpoint_into_tree(req, up_to=up_to, **kwargs)

    def insert(self, params):
        return own_tail.insert(self, params, super().insert)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        own_tail.release(self, req)
        super().on_release(req, checkpointed=checkpointed)

    def _tail_kv_slots(self, plan: ReplayPlan, config: TailReplayConfig, last_node_id: Any) -> torch.Tensor | None:
        """The tree's KV slots of [prefix_len, L), read off the matched path bottom-up (O(W))."""
        if config.kv_mode != "exact" or not plan.reuses_tail_kv:
            return None
        node, depth, chunks = self.tree_core.node_by_id(last_node_id), plan.matched_tokens, []
        while depth > plan.prefix_len:
            chunks.append(node.component_data[ComponentType.FULL].value)
            depth -= len(node.key)
            node = node.parent
        return torch.cat(chunks[::-1])[plan.prefix_len - depth:].clone()


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
