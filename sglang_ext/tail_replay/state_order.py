"""The order in which states go under state pressure (SGLang adapter: a mixin of
`TailReplayMambaComponent`). State pressure frees states, never attention KV; which state goes
first is SGLang's LRU order, unless the config's `state_order` (or an eviction policy,
`--radix-eviction-policy sae`) puts some first.

The default (`state_order: "auto"`) under `exactness` "exact_first" / "exact" is
"approximate_first": a state that does not count as exact (an approximate replay's, an untracked
one's) goes before any exact one, so Tail-Replay's own states never displace the exact states stock
SGLang holds for the same slots (tests/tail_replay/test_state_order.py checks this against stock
SGLang's own cache over random request sequences). Under "approximate" it is SGLang's LRU order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

from sglang_ext.tail_replay import provenance
from sglang_ext.tail_replay.tree_provenance import provenance_of


def continues_to_a_state(node: Any, component_type: Any) -> bool:
    """Whether `node` continues in exactly one child and a state sits further down that single
    line before it branches or ends."""
    while len(node.children) == 1:
        node = next(iter(node.children.values()))
        if node.component_data[component_type].value is not None:
            return True
    return False


def resolved_order(config: Any) -> str:
    """The state order a server config runs: `state_order`, with "auto" resolved by the server's
    `exactness` ("lru" under "approximate", else "approximate_first")."""
    if config.state_order != "auto":
        return config.state_order
    return "lru" if config.exactness == "approximate" else "approximate_first"


class StateEvictionOrder:
    """The Mamba component's device-state eviction (`self.config` is the server's config)."""

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        """State pressure frees states, never attention KV.

        SGLang's walk over the state LRU hands back a whole device leaf (its attention KV too)
        when the least recently used state sits on a leaf, because without Tail-Replay a leaf's KV
        is useless once its state is gone. Here the KV is what makes a hit, so every state is freed
        the way SGLang already frees states on inner nodes: the state alone; the node, its KV and
        its place in the KV eviction order stay. Locked states (a running request's checkpoint,
        the one a planned exact-checkpoint hit is about to copy) are skipped by the LRU walk.
        With HiCache the same holds: a state with a host copy lives on there (SGLang's host LRU
        takes it), one without is gone, as any device state SGLang frees.

        May mutate: this component's walk cursor, the victim's state value and LRU membership,
        `tracker`, `device_frees`.
        """
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
        goes_first = self._goes_first.get(resolved_order(self.config))
        if goes_first is not None and not by_session:
            victim = self._first_unlocked_state(lru, goes_first)
            if victim is not None:
                return victim
        if self._evict_device_cursor is not None and not lru.in_list(self._evict_device_cursor):
            self._evict_device_cursor = lru.cursor_next() if by_session else lru.get_lru_no_lock()
        victim = self._evict_device_cursor
        if victim is None or not lru.in_list(victim):
            return None
        # step on now: freeing the victim unlinks it, the cursor (or its sentinel) stays put
        self._evict_device_cursor = lru.cursor_next() if by_session else lru.get_prev_no_lock(victim)
        return victim

    def _first_unlocked_state(self, lru: Any, goes_first: Callable[[Any, Any], bool]) -> Any:
        """The least recently used unlocked state whose node `goes_first(self, node)`, or None
        (then SGLang's order runs). Reads only."""
        node = lru.get_lru_no_lock()
        while node is not None:
            data = node.component_data[self.component_type]
            if data.value is not None and data.lock_ref == 0 and goes_first(self, node):
                return node
            node = lru.get_prev_no_lock(node)
        return None

    def _is_superseded(self, node: Any) -> bool:
        """State order "ends": its conversation has moved past this state (the node continues in
        exactly one child, and a state sits further down that single line before any branch).
        Conversation ends (leaves) and branch points (two children or more) are kept."""
        return continues_to_a_state(node, self.component_type)

    def _is_approximate(self, node: Any) -> bool:
        """State order "approximate_first": the state does not count as exact (its bound above
        the config's `threshold`), so exact states (the ones stock SGLang would hold and serve exact hits
        from) outlive approximate ones."""
        prov = provenance_of(node)
        return prov is not None and not provenance.counts_exact(prov.state, self.config.threshold)

    #: `state_order` -> which states go first under state pressure (then least recently used)
    _goes_first: dict[str, Callable[[Any, Any], bool]] = {"ends": _is_superseded, "approximate_first": _is_approximate}
