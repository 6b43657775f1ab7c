"""One byte budget for KV and states (`--enable-unified-memory`): which goes first under pressure,
by value per byte (SGLang adapter; a part of `TailReplayRadixCache`).

With SGLang's unified memory the state pool and the KV pool are views over one byte buffer whose
split follows the workload; its eviction suits stock, not Tail-Replay: on a state shortfall stock
evicts full-attention KV first, on a KV shortfall only KV leaves (a state goes only with its leaf).
Tail-Replay can rebuild a state by replaying KV, but cannot rebuild KV. So here, before stock's
eviction runs, states whose value per byte is below KV's are freed first, least recently used
first (`state_order.StateEvictionWalk.gated`; each state's value asked afresh at each step, since
freeing one lengthens the replay its neighbours below save, of the 64 least recently used states:
`GATED_SCAN`), until none of them is worth less:

- a KV token saves at most one token of prefill, per KV token of bytes;
- a state at depth d saves a request resuming there the recompute back to the nearest exact state
  above it (at depth u): d - u tokens, for the bytes of `token_cost` KV tokens (SGLang's
  `mamba_slot_full_token_cost`; a Qwen3-Next-80B state is the KV of ~3,100 tokens). It goes before
  KV when d - u < token_cost;
- under the exact modes (`exact_first`, `exact`, `exact_unless_pressed`) a state with no exact
  state above it on its path is what keeps its path's hits exact (without it `exact_first` replays
  approximately where stock resumed exactly), so it never goes before KV; nor does a state its
  conversation has not gone on past (a conversation's end or a branch point: where the next
  request resumes; the price above counts every KV token as if it would be read again, which the
  coldest KV often is not); under `approximate` every state may (an approximate replay takes its
  place).

Before any state, a KV shortfall takes the KV that serves no exact hit: the stateless leaves past
a finished request's last state (`kv_past_state`, demoted under the exact modes), which SGLang's
`lru` eviction would also take first, but only after this pass had freed states (under another
policy the pass does not run: `kv_past_state.demoted_go_first`).

Freeing a state gives its bytes to the KV side only while the allocator may move pages
(`moves_blocked`: a HiCache transfer or a PD transfer in flight holds them); then this pass frees
nothing for a KV shortfall, and stock's eviction runs as it would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sglang_ext.tail_replay.kv_past_state import demoted_go_first, is_demoted
from sglang_ext.tail_replay.metrics import record_states_freed_first
from sglang_ext.tail_replay.provenance.bounds import counts_exact
from sglang_ext.tail_replay.provenance.tree import provenance_of
from sglang_ext.tail_replay.state_order import continues_to_a_state


def goes_before_kv(depth: int, exact_above: int | None, token_cost: int, *, exact_mode: bool,
                   moved_past: bool = True) -> bool:
    """Whether a state at `depth` is worth less per byte than KV (pure): it saves `depth -
    exact_above` tokens of recompute for `token_cost` KV tokens of bytes. `exact_above`: the depth
    of the nearest exact state above it on its path, None where there is none (the root's zero
    state does not count: a path without an exact state is replayed approximately under
    `exact_first`). `moved_past`: its conversation has gone on past it (a state further down its
    single line); a conversation's end or a branch point, where the next request resumes, is kept
    before KV under the exact modes."""
    if not exact_mode:
        return True
    if exact_above is None or not moved_past:
        return False
    return depth - exact_above < token_cost


def exact_state_above(node: Any, mamba: Any, threshold: float, depth: int | None = None) -> int | None:
    """The depth of the nearest state above `node` (at `depth`, walked from the root when not
    given) on its path that counts exact under `threshold`, or None. Reads only."""
    depth = _depth(node) if depth is None else depth
    while node.parent is not None and node.parent.parent is not None:   # the root holds no state
        depth -= len(node.key)
        node = node.parent
        if node.component_data[mamba].value is not None:
            prov = provenance_of(node)
            if counts_exact(0.0 if prov is None else prov.state, threshold):
                return depth
    return None


def _depth(node: Any) -> int:
    depth = 0
    while node is not None and node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


class ByteBudget:
    """The cache's unified-memory eviction preference. Needs the SGLang cache (its allocator, the
    Mamba component and its state walk, `_evict`, `_component_available_size`, the server
    config) and where its counts go (`record`: the Prometheus counter). May mutate: through
    `_evict`, the tree's states and the pools (states freed)."""

    def __init__(self, cache: Any, record: Callable[[str, int], None] = record_states_freed_first) -> None:
        self.cache = cache
        #: where each pass's count goes (shortfall "state" or "kv", states freed): the metrics
        self.record = record
        #: states this cache freed before KV (for the metrics and the tests)
        self.states_freed = 0

    def shared(self) -> bool:
        """Whether KV and states share one byte buffer (`--enable-unified-memory`). Reads only."""
        return self.cache.token_to_kv_pool_allocator.mamba_full_cache_donor() is not None

    def states_first(self, params: Any) -> tuple[Any, Any]:
        """Before stock's `evict_for_alloc`: free the states worth less per byte than KV, least
        recently used first, until each shortfall of `params` (SGLang's `EvictParams`: states, then
        KV) is met or none worth less is left. Returns (what this pass freed: an
        `EvictResult`, the shortfall left for stock's eviction: an `EvictParams`). May mutate: the
        tree's states."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        cache = self.cache
        freed = EvictResult()
        if getattr(cache.components.get(ComponentType.MAMBA), "states", None) is None or self._partitioned():
            return freed, params
        if params.num_tokens > 0 and not self._moves_blocked(cache.token_to_kv_pool_allocator):
            evicted, left = self._free_demoted_kv(params.num_tokens)
            freed.num_tokens_evicted += evicted
            params = dataclasses.replace(params, num_tokens=left)
        if params.mamba_num > 0:
            count, left = self._free_states(ComponentType.MAMBA, params.mamba_num, "state")
            freed.mamba_num_evicted += count
            params = dataclasses.replace(params, mamba_num=left)
        if params.num_tokens > 0 and not self._moves_blocked(cache.token_to_kv_pool_allocator):
            count, left = self._free_states(ComponentType.FULL, params.num_tokens, "kv")
            freed.mamba_num_evicted += count
            params = dataclasses.replace(params, num_tokens=left)
        self.states_freed += freed.mamba_num_evicted
        return freed, params

    def _free_demoted_kv(self, wanted: int) -> tuple[int, int]:
        """A KV shortfall of `wanted` tokens: first the KV that serves no exact hit (stateless
        leaves `kv_past_state.to_eviction_front` demoted, worth less than any state), which
        SGLang's eviction takes first, capped at their evictable tokens so that nothing else goes
        in this pass. Only where its policy takes them before any other leaf (`demoted_go_first`:
        `lru`); else nothing here, the shortfall goes on. Returns (tokens evicted, what is still
        short). May mutate: the tree's demoted leaves (evicted)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        cache = self.cache
        if not demoted_go_first(cache.tree_core):
            return 0, wanted
        demoted = sum(len(node.key) for node in cache.tree_core.evictable_device_leaves if is_demoted(node))
        if demoted <= 0:
            return 0, wanted
        full = ComponentType.FULL
        target = cache._component_available_size(full) + wanted
        result = cache._evict(EvictParams(num_tokens=demoted), {full: (full, target)})
        return int(result.num_tokens_evicted), max(0, target - cache._component_available_size(full))

    def _free_states(self, kind: Any, wanted: int, shortfall: str) -> tuple[int, int]:
        """Free states worth less than KV until `kind`'s capacity grows by `wanted`. Returns (the
        number freed, what is still short). May mutate: the tree's states."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        cache = self.cache
        mamba = ComponentType.MAMBA
        target = cache._component_available_size(kind) + wanted
        evictable = cache.mamba_evictable_size()
        if evictable <= 0:
            return 0, wanted
        token_cost = max(1, int(cache.token_to_kv_pool_allocator.mamba_slot_full_token_cost()))
        config = cache.tail_replay_config
        exact_mode = config.knobs.exactness != "approximate"
        threshold = config.threshold

        def worth_freeing(node: Any) -> bool:
            depth = _depth(node)
            return goes_before_kv(depth, exact_state_above(node, mamba, threshold, depth), token_cost,
                                  exact_mode=exact_mode, moved_past=continues_to_a_state(node, mamba))

        with cache.components[mamba].states.gated(worth_freeing):
            result = cache._evict(EvictParams(mamba_num=evictable), {mamba: (kind, target)})
        count = int(result.mamba_num_evicted)
        self.record(shortfall, count)
        return count, max(0, target - cache._component_available_size(kind))

    def _partitioned(self) -> bool:
        """SGLang's session radix cache partitions the state LRU: the gated walk does not run there."""
        return bool(getattr(getattr(self.cache, "tree_core", None), "enable_session_radix_cache", False))

    @staticmethod
    def _moves_blocked(allocator: Any) -> bool:
        """Whether freed state bytes cannot reach the KV side now (a transfer holds the pages)."""
        states = getattr(allocator, "mamba_allocator", None)
        blocked = getattr(states, "moves_blocked", None)
        return bool(blocked()) if callable(blocked) else False

