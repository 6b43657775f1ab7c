"""Tail-Replay's state-only eviction walk (SGLang adapter; a part of `TailReplayMambaComponent`).

State pressure frees states, never attention KV. SGLang's walk over the state LRU hands back a
whole device leaf (its attention KV too) when the least recently used state sits on a leaf,
because without Tail-Replay a leaf's KV is useless once its state is gone. Here the KV is what
makes a hit, so every state is freed the way SGLang already frees states on inner nodes: the state
alone; the node, its KV and its place in the KV eviction order stay. Locked states (a running
request's checkpoint, the one a planned exact-checkpoint hit is about to copy) are never victims.
With HiCache the same holds: a state with a host copy lives on there (SGLang's host LRU takes it),
one without is gone, as any device state SGLang frees.

Which state goes next is a registered state order's (`sglang_ext.hooks.StateOrder`): the one the
config names (`state_order.resolved_order`), or a policy's order chosen for the walk at its start
(`hooks.chosen_state_order`: SAE's "sae" under `--radix-eviction-policy sae`). The config's order
observes every insert, match and reset, whichever order runs the walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

from sglang_ext.hooks import StateOrder, StateOrderSite, chosen_state_order, state_order_factory
from sglang_ext.tail_replay.state_order import resolved_order


class StateEvictionWalk:
    """Needs the Mamba component (the walk frees its states through the tree core's
    `_evict_component_and_detach_lru`, SGLang's own step for an inner node's state), the server
    config's getter and the radix cache (handed to the orders' factories)."""

    def __init__(self, component: Any, config: Callable[[], Any], cache: Any) -> None:
        self.component = component
        self.site = StateOrderSite(component.tree_core, component.component_type, config, cache)
        self._config_order: StateOrder | None = None
        self.walk_order: StateOrder | None = None
        self.request_cnt = 0

    @property
    def config_order(self) -> StateOrder:
        """The order the config names (made on first use). May mutate: that (the order made)."""
        if self._config_order is None:
            self._config_order = state_order_factory(resolved_order(self.site.config()))(self.site)
        return self._config_order

    def start(self, request_cnt: int) -> None:
        """A walk that must free `request_cnt` states begins (after SGLang's own start). May
        mutate: the orders' state, which order runs the walk."""
        self.request_cnt = request_cnt
        self.config_order.start(request_cnt)
        chosen = chosen_state_order(self.site.tree_core)
        self.walk_order = self.config_order
        if chosen is not None:
            self.walk_order = state_order_factory(chosen)(self.site)
            self.walk_order.start(request_cnt)

    def next_node(self, tracker: dict, device_frees: dict, host_frees: dict, cache_actions: list) -> None:
        """Free the next victim's state alone; always None (no leaf goes whole). May mutate: the
        walk order's cursor, the victim's state value and LRU membership, `tracker`,
        `device_frees`, `host_frees`, `cache_actions`, the tree's evictable leaf sets."""
        ct = self.component.component_type
        if tracker[ct] >= self.request_cnt or self.walk_order is None:
            return None
        victim = self.walk_order.next_victim()
        if victim is None:
            return None
        core = self.site.tree_core
        core._evict_component_and_detach_lru(victim, self.component, target=EvictLayer.DEVICE, tracker=tracker,
                                             device_frees=device_frees, host_frees=host_frees,
                                             cache_actions=cache_actions)
        core._update_evictable_leaf_sets(victim)
        return None

    def end(self) -> None:
        """The walk is over. May mutate: the orders' state."""
        if self.walk_order is not None and self.walk_order is not self.config_order:
            self.walk_order.end()
        self.walk_order = None
        self.config_order.end()

    def on_insert(self, node: Any, depth: int, params: Any) -> None:
        """May mutate: the config order's state (the stock shadow)."""
        self.config_order.on_insert(node, depth, params)

    def on_match(self, params: Any, nodes: list[Any]) -> None:
        """May mutate: the config order's state (the stock shadow)."""
        self.config_order.on_match(params, nodes)

    def reset(self) -> None:
        """May mutate: the config order's state (the stock shadow, dropped)."""
        self.config_order.reset()
