"""Tail-Replay's Mamba component (SGLang adapter): SGLang 0.5.23's `MambaComponent` that never
limits a match, and keeps or withholds the request's state by its config. The class keeps only
SGLang's hook overrides; each delegates to a named part, held by composition and built on first use
(once the tree core is set):

| part | class (module) | what it decides |
|---|---|---|
| `provenance` | `ProvenanceWriter` (`provenance.tree`) | a node's provenance on insert / split / overlap |
| `host_tier` | `HostTierRules` (`tiers`) | which host-tier steps run for states |
| `branch_track` | `BranchPointTrack` (`branch_rules`) | the branch-point track at a match |
| `states` | `StateEvictionWalk` (`state_order`) | the state-only eviction walk and its registered order |

A hook that extends SGLang's step hands SGLang's implementation to the part (`stock=`), or runs it
first and then the part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cached_property
from typing import Any

from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from sglang_ext.tail_replay.branch_rules import BranchPointTrack
from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.provenance.tree import ProvenanceWriter
from sglang_ext.tail_replay.request import plan_of, record_of
from sglang_ext.tail_replay.state_order import StateEvictionWalk
from sglang_ext.tail_replay.tiers import HostTierRules


class StateSlotShortfall(RuntimeError):
    """No state slot for a running request's checkpoint, even after eviction."""


class TailReplayMambaComponent(MambaComponent):
    """Mamba component that never limits a match and stores states with their provenance."""

    def __init__(self, cache, params):
        # SGLang's constructor asserts page_size == 1 without the extra buffer (only a sequence-end
        # state exists there, so a cached state needs page 1) unless the tree is disabled. Tail-Replay
        # reuses page-aligned prefixes without any state, so the stock constructor runs on a copy
        # of the params that reads as disabled: `disable` is read by that check only (the component
        # keeps no reference to the params; the tree's own `disable` is the cache's).
        super().__init__(cache, dataclasses.replace(params, disable=True) if not params.disable else params)

    def _config(self) -> TailReplayConfig:
        return self.cache.tail_replay_config

    # ---- the parts (built on first use: the tree core is set after the constructor) -------------
    @cached_property
    def provenance(self) -> ProvenanceWriter:
        cache = self.cache
        return ProvenanceWriter(self.tree_core, self.component_type, inserting=cache.inserting_context,
                                free_state=self._free_mamba_value)

    @cached_property
    def host_tier(self) -> HostTierRules:
        return HostTierRules(self.tree_core, self._config, state_load_node=lambda: self.cache.state_load_node,
                             inserting=self.cache.inserting_context)

    @cached_property
    def states(self) -> StateEvictionWalk:
        return StateEvictionWalk(self, self._config, self.cache)

    @cached_property
    def branch_track(self) -> BranchPointTrack:
        return BranchPointTrack(self.tree_core, self.component_type, self.mamba_checkpoint_grid,
                                request_record=self.cache.request_record,
                                remember_matched_path=self.cache.remember_matched_path,
                                on_match=self.states.on_match)

    # ---- what the cache calls -------------------------------------------------------------------
    @property
    def host_states(self) -> bool:
        """Whether states go to the host tier (HiCache on, the server keeps checkpoints). A server
        without HiCache never builds its host-tier part."""
        return bool(self.tree_core.enable_hicache) and self.host_tier.host_states

    def forget_stock_shadow(self) -> None:
        """The tree was reset (`/flush_cache`): the state order forgets what it observed (the stock
        shadow). May mutate: the state walk's orders (none before the walk part is built)."""
        if "states" in self.__dict__:
            self.states.reset()

    # ---- SGLang's hooks: the match ---------------------------------------------------------------
    def create_match_validator(self, match_device_only: bool = False) -> Callable[[Any], bool]:
        return lambda node: True

    def finalize_match_result_in_tree_core(self, result, params, value_chunks, best_value_len):
        """The branch-point track (`BranchPointTrack.finalize`). May mutate: the cache's matched
        path, the state order's observed matches."""
        return self.branch_track.finalize(result, params)

    def finalize_match_result_in_cache(self, params, result):
        """A plan that does not start from a checkpoint replays from the zero state. May mutate: the
        request's deferred copy-on-write / clear."""
        plan = plan_of(params.req) if params.req is not None else None
        if plan is None or plan.from_checkpoint:
            return super().finalize_match_result_in_cache(params, result)
        if params.cow_mamba and params.req.kv.holds_mamba:
            params.req.kv.mamba_cow_src_index = None
            params.req.kv.mamba_needs_clear = True   # replay starts from the zero state
        return result

    # ---- SGLang's hooks: the insert --------------------------------------------------------------
    def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
        """The provenance writer stores the state (through SGLang's commit), then the state order
        observes the insert. May mutate: the node's state and provenance, the order's shadow."""
        self.provenance.on_commit(node, is_new_leaf, params, result, cache_actions,
                                  stock=super().commit_insert_component_data)
        self.states.on_insert(node, result.prefix_len + (len(node.key) if is_new_leaf else 0), params)

    def redistribute_on_node_split(self, new_parent, child):
        super().redistribute_on_node_split(new_parent, child)
        self.provenance.on_split(new_parent, child)

    def update_component_on_insert_overlap(self, node, prefix_len, total_prefix_len, value_slice, params,
                                           result, cache_actions):
        consumed = super().update_component_on_insert_overlap(
            node, prefix_len, total_prefix_len, value_slice, params, result, cache_actions)
        return self.provenance.on_overlap(node, prefix_len, total_prefix_len, value_slice, params, cache_actions,
                                          consumed)

    def _stores_state(self, req: Any, token_ids_len: int) -> bool:
        """States, exact or approximate (with their bound, see `commit_insert_component_data`),
        where the tree can hold them: without the extra buffer the state is the sequence-end state,
        and the key is cut to whole pages on insert."""
        record = self.cache.request_record(req)
        lands_on_its_depth = self.cache.enable_mamba_extra_buffer or token_ids_len % self.cache.page_size == 0
        return record.config.knobs.keep_checkpoints and lands_on_its_depth

    def prepare_for_caching_req(self, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> int:
        withheld = not self._stores_state(req, token_ids_len)
        self.cache.request_record(req).state_withheld = withheld
        if not withheld:
            try:
                return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
            except StateSlotShortfall:   # a running request's checkpoint finds no slot: it keeps none
                self.cache.request_record(req).state_withheld = True
        insert_params.mamba_value = None   # the attention KV is still inserted in full
        return token_ids_len

    def _alloc_mamba_slot(self, req: Any = None) -> Any:
        """SGLang's slot for a running request's checkpoint (the extra buffer donates its tracked
        state and takes a fresh slot to go on with), evicting first if needed. Where none is left
        even then (one byte budget under load: every byte held by running requests, which SGLang's
        admission does not reserve for these slots), `StateSlotShortfall` instead of SGLang's
        assertion, which kills the scheduler: the checkpoint then keeps no state
        (`prepare_for_caching_req`). SGLang's lazy extra buffer keeps its own path."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        from sglang.srt.runtime_context import get_exec

        if get_exec().mamba.enable_mamba_extra_buffer_lazy:
            return super()._alloc_mamba_slot(req)
        allocator = self.cache.req_to_token_pool.mamba_allocator
        slot = allocator.alloc(1)
        if slot is None:
            self.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
            slot = allocator.alloc(1)
        if slot is None:
            raise StateSlotShortfall("no state slot for a running request's checkpoint")
        return slot

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

    # ---- SGLang's hooks: the host tier (`HostTierRules`) -----------------------------------------
    def needs_incremental_backup(self, node: Any) -> bool:
        return self.host_tier.needs_incremental_backup(node, super().needs_incremental_backup)

    def build_hicache_transfers(self, node: Any, phase: Any, **kwargs: Any) -> Any:
        return self.host_tier.build_hicache_transfers(node, phase, super().build_hicache_transfers, **kwargs)

    def prepare_load_back(self, node_id: Any, *, req: Any = None) -> Any:
        return self.host_tier.prepare_load_back(node_id, req, super().prepare_load_back)

    def prepare_prefetch(self, node_id: Any, *, prefetch_tokens: int = 0) -> Any:
        return self.host_tier.prepare_prefetch()

    def drive_host_eviction(self, num_tokens, tracker, device_frees, host_frees, cache_actions) -> None:
        stock = super().drive_host_eviction
        self.host_tier.drive_host_eviction(lambda: stock(num_tokens, tracker, device_frees, host_frees, cache_actions))

    def recover_after_unevict(self, node, prefix_len, total_prefix_len, params, result, cache_actions) -> None:
        super().recover_after_unevict(node, prefix_len, total_prefix_len, params, result, cache_actions)
        self.host_tier.after_unevict(node, total_prefix_len)

    # ---- SGLang's hooks: the device state eviction walk (`StateEvictionWalk`) --------------------
    def _evict_device_start(self, request_cnt: int) -> None:
        super()._evict_device_start(request_cnt)
        self.states.start(request_cnt)

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        """Frees the walk order's next state alone (never a whole leaf). May mutate: see
        `StateEvictionWalk.next_node`."""
        return self.states.next_node(tracker, device_frees, host_frees, cache_actions)

    def _evict_device_end(self) -> None:
        self.states.end()
        super()._evict_device_end()
