"""SAE chooses the full-KV leaves to evict.

Target (SGLang 0.5.23): `srt/mem_cache/unified_cache/components/full.py: FullComponent.
_evict_device_start / _evict_device_next_node / _evict_device_end`, the walk that hands the
tree core one evictable device leaf at a time (SGLang orders it by a heap of
`eviction_strategy.get_priority(node)`). Under SAE the walk first syncs SAE with the tree
(nodes the tree dropped on its own, evictability of every known node), then asks SAE's
`victim()` for each leaf and reports each evicted leaf back (SAE's eviction feedback:
residence time, ghosts, duels); a parent that becomes an evictable leaf joins at once. After
the walk the totals go to /metrics. Other policies run SGLang's heap unchanged.
"""

from __future__ import annotations

import functools
import time

TARGET = ("srt/mem_cache/unified_cache/components/full.py: FullComponent._evict_device_start, "
          "_evict_device_next_node, _evict_device_end")


def _server(component):
    from sglang_ext.eviction.sglang_adapter import strategy_of

    strategy = strategy_of(component.tree_core)
    return None if strategy is None else strategy.server


def _alive_in(tree_core):
    """Whether a node still holds its full KV in ``tree_core`` (registered, value present)."""
    arena = tree_core._node_arena
    return lambda node: arena.get(node.id) is node and not node.evicted


def _wrap_start(original):
    @functools.wraps(original)
    def _evict_device_start(self, request_cnt: int) -> None:
        server = _server(self)
        if server is None or self.tree_core.enable_session_radix_cache:
            return original(self, request_cnt)
        from sglang_ext.eviction.sglang_adapter import describe_leaf

        leaves = self.tree_core.evictable_device_leaves
        t0 = time.perf_counter_ns()
        server.sync({n.id for n in leaves}, _alive_in(self.tree_core), lambda leaf: describe_leaf(self.tree_core, leaf), leaves)
        server.stats.hook_ns += time.perf_counter_ns() - t0
        self._evict_device_request_cnt = request_cnt
        self._evict_device_last_node = None
        self._evict_device_heap = []
        self._sae_walk = server

    return _evict_device_start


def _finish_last(self, server) -> None:
    last = self._evict_device_last_node
    self._evict_device_last_node = None
    if last is None:
        return
    if not _alive_in(self.tree_core)(last):
        server.evicted(last.id)
    parent = last.parent
    if parent is not None and parent in self.tree_core.evictable_device_leaves:
        server.set_evictable(parent.id, True)


def _wrap_next(original):
    @functools.wraps(original)
    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        server = self.__dict__.get("_sae_walk")
        if server is None:
            return original(self, tracker, device_frees, host_frees, cache_actions)
        parent = self._evict_device_last_node.parent if self._evict_device_last_node is not None else None
        _finish_last(self, server)
        leaves = self.tree_core.evictable_device_leaves
        if parent is not None and parent in leaves and not server.knows(parent.id):
            from sglang_ext.eviction.sglang_adapter import describe_leaf

            server.sync({n.id for n in leaves}, _alive_in(self.tree_core), lambda leaf: describe_leaf(self.tree_core, leaf), [parent])
        while tracker[self.component_type] < self._evict_device_request_cnt:
            chosen = server.victim()
            if chosen is None:
                return None
            node = chosen.handle
            if node not in leaves:   # stale: the tree changed it without telling SAE
                server.set_evictable(chosen.node_id, False)
                if not _alive_in(self.tree_core)(node):
                    server.evicted(chosen.node_id)
                continue
            self._evict_device_last_node = node
            return node.id
        return None

    return _evict_device_next_node


def _wrap_end(original):
    @functools.wraps(original)
    def _evict_device_end(self) -> None:
        server = self.__dict__.pop("_sae_walk", None)
        if server is not None:
            _finish_last(self, server)
            from sglang_ext.eviction.sglang_adapter import publish_metrics, strategy_of

            publish_metrics(strategy_of(self.tree_core))
        return original(self)

    return _evict_device_end


def apply() -> None:
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

    FullComponent._evict_device_start = _wrap_start(FullComponent._evict_device_start)
    FullComponent._evict_device_next_node = _wrap_next(FullComponent._evict_device_next_node)
    FullComponent._evict_device_end = _wrap_end(FullComponent._evict_device_end)
