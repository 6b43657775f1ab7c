"""The KV past a finished request's last tracked state, under the extra buffer (SGLang adapter: the
`KvPastTheState` part of `TailReplayRadixCache`, run by its `checkpoint_into_tree`).

Under the extra buffer SGLang inserts a finished request only up to the last state it tracked (a
chunk boundary of its prefill, or of its decode's track interval) and frees the KV after it: on
stock SGLang that KV cannot be reused without a state at its end. Here it can (a plan resumes from
the state and recomputes, or replays), and without the extra buffer the tree gets a request's
whole KV anyway; so the rest is inserted as KV alone, with the provenance the cache decides for
every insert (`provenance.writes.InsertContext`), for requests whose provenance is tracked.

What that KV is worth: under the exact modes (`exact_first`, `exact`, `exact_unless_pressed`) an
exact hit resumes at a state, so KV past a path's last state serves only approximate plans (a
request whose path holds no exact state, or a pressed one). It is worth less than any KV an exact
hit reads, so a new stateless leaf it makes is the first KV a shortfall evicts
(`to_eviction_front`); while memory lasts it stays. A request that matches through it makes it
recently used, as any node. Under `approximate` every KV token is worth its prefill: it keeps the
recency SGLang's insert gave it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from sglang_ext.tail_replay.own_tail import OwnTailClaims
from sglang_ext.tail_replay.provenance.writes import tracks
from sglang_ext.tail_replay.request import owns_tail, record_of


class KvPastTheState:
    """`keeps` (when) and `insert` (the insert). Needs the SGLang cache it inserts into (its tree
    core, pools, `insert`, `lock` / `unlock`, flags) and the cache's own-tail claims."""

    def __init__(self, cache: Any, claims: OwnTailClaims) -> None:
        self.cache = cache
        self.claims = claims

    def keeps(self, req: Any, up_to: int) -> bool:
        """Whether a finished request's KV past its tree state still waits to be inserted: only
        for the Full + Mamba components (no SWA window to keep), and not with the session radix
        cache (it registers the first insert's end as the session's leaf), and only for a request
        whose record tracks what it computed (`provenance.writes.tracks`): SGLang's insert stopped
        where the request's components capped it (another wing's request, e.g. position-independent
        assembled chunks, publishes nothing past its exact prefix), and KV of unknown provenance
        is not worth keeping. Reads only."""
        cache = self.cache
        return (tracks(record_of(req)) and req.finished() and cache.enable_mamba_extra_buffer and not cache.disable
                and req.kv.holds_kv and not req.skip_radix_cache_insert and not cache.enable_session_radix_cache
                and {c.component_type for c in cache._components_tuple} == {ComponentType.FULL, ComponentType.MAMBA}
                and up_to // cache.page_size * cache.page_size > req.kv.cache_protected_len)

    def insert(self, req: Any, up_to: int) -> None:
        """Insert [cache_protected_len, up_to) of a finished request's KV with no state, after
        SGLang's own insert stopped at the request's last tracked state; then, as SGLang's insert
        does, the request's row takes the tree's slots and its lock moves to the new end. The
        request's release frees what is left past it (`release_kv_cache`). A recompute tail
        (`own_tail`) is claimed over this insert as over the first one (`OwnTailClaims`). May mutate: the tree, the
        request's KV row, lock, `cache_protected_len`, `cache_inserted_len`, `last_node`."""
        cache = self.cache
        token_ids = req.full_untruncated_fill_ids[:up_to]
        key = RadixKey(token_ids, req.extra_key, is_bigram=cache.tree_core.is_eagle,
                       cache_salt=req.cache_salt).page_aligned(cache.page_size)
        values = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(key)].to(dtype=torch.int64, copy=True)
        params = InsertParams(key=key, value=values, prev_prefix_len=req.kv.cache_protected_len,
                              inserted_len=req.kv.cache_inserted_len, priority=req.priority or 0,
                              session_id=req.session_id, rotation_base=req.kv_rotation_base)
        with self.claims.claiming(req) if owns_tail(record_of(req)) else nullcontext():
            result = cache.insert(params)
        if result.rotation_tail_declined:
            return
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, len(key))
        new_last_node = result.last_device_node
        new_indices = cache.path_device_indices(new_last_node)
        protected = req.kv.cache_protected_len
        cache.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, len(new_indices))),
                                     new_indices[protected:])
        cache.unlock(req.lock)
        req.lock = cache.lock(new_last_node, skip_lock_components=(
            (ComponentType.MAMBA,) if envs.SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK.get() else ()))
        req.kv.cache_protected_len = len(new_indices)
        req.last_node = new_last_node
        if cache.tail_replay_config.knobs.exactness != "approximate":
            to_eviction_front(cache.tree_core, cache.tree_core.node_by_id(new_last_node))


#: how far a demoted node's recency drops: below every node SGLang stamped (its time counter counts
#: up from 0), keeping the demoted nodes' own order among themselves
DEMOTION = 1 << 62


def to_eviction_front(tree_core: Any, node: Any) -> bool:
    """Make a stateless leaf the first KV a shortfall evicts: SGLang's KV eviction takes the
    evictable leaves by its policy's priority, which for the recency policies (`lru`, the
    default; `priority` and `tlru` within a tier) is the node's `last_access_time`; it drops
    below every stamped node's. A request that matches through the node stamps it afresh. Only a
    leaf holding no device state; not the root. Returns whether it moved. May mutate: the node's
    `last_access_time`."""
    if node is tree_core.root_node or node.children or node.component_data[ComponentType.MAMBA].value is not None:
        return False
    if node.last_access_time >= 0:
        node.last_access_time -= DEMOTION
    return True


def demoted_go_first(tree_core: Any) -> bool:
    """Whether SGLang's KV eviction takes every demoted leaf before any other: under `lru` (its
    default), which orders by `last_access_time` alone. Under a tiered policy (`priority`, `tlru`,
    `slru`, `lfu`) a demoted leaf goes first only within its tier; under `mru` last; under
    one that ignores recency (`fifo`, `sae`) anywhere. Reads only."""
    from sglang.srt.mem_cache.evict_policy import LRUStrategy

    return type(getattr(tree_core, "eviction_strategy", None)) is LRUStrategy


def is_demoted(node: Any) -> bool:
    """Whether `to_eviction_front` demoted the node and no match has stamped it since. Reads only."""
    return node.last_access_time < 0
