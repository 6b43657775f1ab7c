"""Tail-Replay's Mamba component (SGLang adapter): SGLang 0.5.23's `MambaComponent` that never
limits a match, and keeps or withholds the request's state by its config. Its other concerns are
mixed in from their own modules: provenance on insert / split / overlap (`tree_provenance`), the
host tier (`tiers`), the state eviction order (`state_order`) and the branch-point track
(`branch_rules`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from sglang_ext.tail_replay.branch_rules import BranchPointTrack
from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.request import plan_of, record_of
from sglang_ext.tail_replay.state_order import StateEvictionOrder
from sglang_ext.tail_replay.tiers import HostTierComponent
from sglang_ext.tail_replay.tree_provenance import ProvenanceOnInsert


class TailReplayMambaComponent(StateEvictionOrder, ProvenanceOnInsert, HostTierComponent, BranchPointTrack,
                               MambaComponent):
    """Mamba component that never limits a match and stores states with their provenance."""

    def __init__(self, cache, params):
        # SGLang's constructor asserts page_size == 1 without the extra buffer (only a sequence-end
        # state exists there, so a cached state needs page 1) unless the tree is disabled. Tail-Replay
        # reuses page-aligned prefixes without any state, so the stock constructor runs on a copy
        # of the params that reads as disabled: `disable` is read by that check only (the component
        # keeps no reference to the params; the tree's own `disable` is the cache's).
        super().__init__(cache, dataclasses.replace(params, disable=True) if not params.disable else params)

    @property
    def config(self) -> TailReplayConfig:
        return self.cache.tail_replay_config

    def create_match_validator(self, match_device_only: bool = False) -> Callable[[Any], bool]:
        return lambda node: True

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
        record = self.cache.request_record(req)
        lands_on_its_depth = self.cache.enable_mamba_extra_buffer or token_ids_len % self.cache.page_size == 0
        return record.config.keep_checkpoints and lands_on_its_depth

    def prepare_for_caching_req(self, req: Any, insert_params: Any, token_ids_len: int, is_finished: bool) -> int:
        withheld = not self._stores_state(req, token_ids_len)
        self.cache.request_record(req).state_withheld = withheld
        if not withheld:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        insert_params.mamba_value = None   # the attention KV is still inserted in full
        return token_ids_len

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
