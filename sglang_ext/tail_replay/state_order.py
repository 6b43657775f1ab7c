"""The orders in which states go under state pressure, registered as `sglang_ext.hooks` state
orders, and the walk that runs them (`StateEvictionWalk`, below). State pressure frees states,
never attention KV; which state goes first is SGLang's LRU order ("lru"), unless the config's
`state_order` puts some first ("ends", "approximate_first", "stock_last"), or a policy's order
(`--radix-eviction-policy sae`: "sae", registered by the eviction wing) is chosen for the walk.

The default (`state_order: "auto"`) under `exactness` "exact_first" / "exact" /
"exact_unless_pressed" is "stock_last": Tail-Replay's own states never displace an exact state
stock SGLang would still hold for the same slots. The order keeps a shadow of stock SGLang's
state LRU (`StockStateShadow`: the positions stock's tree holds a state at, in stock's own order,
driven by the same matches, inserts and evictions: stock's match touches the deepest state on its
path; its insert makes a state the most recently used where stock keeps one: a request's own state,
but not the approximate one of a request that branched off the tree at another depth (where
Tail-Replay replayed approximately at a branch, stock missed and kept its exact state at the branch
point, which is where the shared-state repair puts the exact one, so a repair run's insert counts
as stock's); and an eviction walk frees as many of stock's least recently used states as stock would
be short of slots, not as many as Tail-Replay is: the states Tail-Replay holds beyond stock's take
no slots of stock's). Under state pressure go first, each least recently used first: (1) a state
that does not count as exact (an approximate replay's, an untracked one's); (2) an exact state
stock would no longer hold (its shadow let it go while Tail-Replay kept it); (3) only then an exact
state stock holds, in stock's order. tests/tail_replay/test_state_order.py checks this against
stock SGLang's own cache over random request sequences. Under "approximate": SGLang's LRU order.

The walk (SGLang adapter; a part of `TailReplayMambaComponent`): SGLang's walk over the state LRU
hands back a whole device leaf (its attention KV too) when the least recently used state sits on a
leaf, because without Tail-Replay a leaf's KV is useless once its state is gone. Here the KV is
what makes a hit, so every state is freed the way SGLang already frees states on inner nodes: the
state alone; the node, its KV and its place in the KV eviction order stay. Locked states (a running
request's checkpoint, the one a planned exact-checkpoint hit is about to copy) are never victims.
With HiCache the same holds: a state with a host copy lives on there (SGLang's host LRU takes it),
one without is gone, as any device state SGLang frees. Which state goes next is a registered
order's: the one the config names (`resolved_order`), or a policy's order chosen for the walk at
its start (`hooks.chosen_state_order`: SAE's "sae" under `--radix-eviction-policy sae`). The
config's order observes every insert, match and reset, whichever order runs the walk.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

from sglang_ext.hooks import StateOrder, StateOrderSite, add_state_order, chosen_state_order, state_order_factory
from sglang_ext.tail_replay.provenance import bounds as provenance
from sglang_ext.tail_replay.provenance.tree import provenance_of


def continues_to_a_state(node: Any, component_type: Any) -> bool:
    """Whether `node` continues in exactly one child and a state sits further down that single
    line before it branches or ends."""
    while len(node.children) == 1:
        node = next(iter(node.children.values()))
        if node.component_data[component_type].value is not None:
            return True
    return False


def is_approximate(node: Any, threshold: float) -> bool:
    """The node's state does not count as exact (its bound above `threshold`)."""
    prov = provenance_of(node)
    return prov is not None and not provenance.counts_exact(prov.state, threshold)


def resolved_order(config: Any) -> str:
    """The state order a server config runs: `state_order`, with "auto" resolved by the server's
    `exactness` ("lru" under "approximate", else "stock_last")."""
    if config.server.state_order != "auto":
        return config.server.state_order
    return "lru" if config.knobs.exactness == "approximate" else "stock_last"


class StockStateShadow:
    """Stock SGLang's state LRU over the same tree: the nodes at whose depth stock's tree would
    hold a state (one Tail-Replay holds there, or a ghost: a node Tail-Replay freed the state of),
    least recently used first. Nodes, not ids: a ghost may leave Tail-Replay's tree (KV eviction)
    and still be stock's until stock's own LRU lets it go. At most `capacity` nodes (stock's tree
    holds no more states than the pool has slots; KV pressure, which the shadow does not follow,
    frees states without a state eviction step)."""

    def __init__(self, capacity: int | None) -> None:
        self.lru: OrderedDict[int, Any] = OrderedDict()
        self.capacity = capacity

    def holds(self, node: Any) -> bool:
        return node.id in self.lru

    def touch(self, node: Any) -> None:
        """Stock's insert of a state at `node`, or its match ending there: the most recently used.
        May mutate: the shadow's order."""
        self.lru[node.id] = node
        self.lru.move_to_end(node.id)
        while self.capacity is not None and len(self.lru) > self.capacity:
            self.lru.popitem(last=False)

    def touch_deepest(self, nodes: list[Any]) -> None:
        """Stock's match over a path (root first): it ends at, and touches, the deepest node stock
        holds a state at. May mutate: the shadow's order."""
        for node in reversed(nodes):
            if node.id in self.lru:
                self.lru.move_to_end(node.id)
                return

    def evict(self, count: int = 1) -> None:
        """Stock frees its `count` least recently used states. May mutate: the shadow."""
        for _ in range(min(count, len(self.lru))):
            self.lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self.lru)

    def in_order(self) -> list[Any]:
        return list(self.lru.values())


def stock_shortfall(request_cnt: int, held: int, stock_held: int) -> int:
    """How many states stock SGLang frees where Tail-Replay's eviction walk must free
    `request_cnt`: both pools have the same slots and the same running requests, so stock's free
    slots differ from Tail-Replay's by the states each tree holds (`held` in Tail-Replay's, on the
    device; `stock_held` in the shadow)."""
    return max(0, request_cnt - held + stock_held)


def first_unlocked_state(lru: Any, component_type: Any, goes_first: Callable[[Any], bool],
                         limit: int | None = None) -> Any:
    """The least recently used unlocked state of `lru` whose node `goes_first(node)`, or None;
    with `limit`, among the `limit` least recently used unlocked states only. Reads only."""
    node = lru.get_lru_no_lock()
    while node is not None and (limit is None or limit > 0):
        data = node.component_data[component_type]
        if data.value is not None and data.lock_ref == 0:
            if goes_first(node):
                return node
            limit = None if limit is None else limit - 1
        node = lru.get_prev_no_lock(node)
    return None


#: a gated walk (`StateEvictionWalk.gated`) asks its gate of at most this many of the least
#: recently used unlocked states per step (a gate may walk each one's path: the cost stays bounded
#: however many states the tree holds)
GATED_SCAN = 64


class LruOrder(StateOrder):
    """"lru": SGLang's order, least recently used first (with the session radix cache, its
    partitioned cursor; `start` repositions the cursor SGLang's own walk start placed, and SGLang's
    walk end unlinks it). Needs the tree core and the component type."""

    def __init__(self, tree_core: Any, component_type: Any) -> None:
        self.tree_core = tree_core
        self.component_type = component_type
        self.cursor: Any = None

    def start(self, request_cnt: int) -> None:
        """May mutate: the cursor (and the session LRU's cursor sentinel)."""
        lru = self.tree_core.lru_lists[self.component_type]
        if self.tree_core.enable_session_radix_cache:
            lru.cursor_begin()
            self.cursor = lru.cursor_next()
        else:
            self.cursor = lru.get_lru_no_lock()

    def next_victim(self) -> Any:
        """May mutate: the cursor (stepped past the victim: freeing it unlinks it, the cursor, or
        its sentinel, stays put)."""
        lru = self.tree_core.lru_lists[self.component_type]
        by_session = self.tree_core.enable_session_radix_cache
        if self.cursor is not None and not lru.in_list(self.cursor):
            self.cursor = lru.cursor_next() if by_session else lru.get_lru_no_lock()
        victim = self.cursor
        if victim is None or not lru.in_list(victim):
            return None
        self.cursor = lru.cursor_next() if by_session else lru.get_prev_no_lock(victim)
        return victim

    def end(self) -> None:
        self.cursor = None


class GoesFirstOrder(StateOrder):
    """The least recently used unlocked state whose node `goes_first(node)` goes first, then
    SGLang's order ("ends", "approximate_first"); with the session radix cache SGLang's order only.
    Needs the tree core, the component type and the class that goes first."""

    def __init__(self, tree_core: Any, component_type: Any, goes_first: Callable[[Any], bool]) -> None:
        self.tree_core = tree_core
        self.component_type = component_type
        self.goes_first = goes_first
        self.lru_order = LruOrder(tree_core, component_type)

    def start(self, request_cnt: int) -> None:
        self.lru_order.start(request_cnt)

    def next_victim(self) -> Any:
        """May mutate: the LRU cursor."""
        if not self.tree_core.enable_session_radix_cache:
            lru = self.tree_core.lru_lists[self.component_type]
            victim = first_unlocked_state(lru, self.component_type, self.goes_first)
            if victim is not None:
                return victim
        return self.lru_order.next_victim()

    def end(self) -> None:
        self.lru_order.end()


def _lru_order(site: StateOrderSite) -> StateOrder:
    return LruOrder(site.tree_core, site.component_type)


def _ends_order(site: StateOrderSite) -> StateOrder:
    """"ends": a state its conversation has moved past goes first (the node continues in exactly
    one child, and a state sits further down that single line before any branch); conversation
    ends (leaves) and branch points (two children or more) are kept."""
    return GoesFirstOrder(site.tree_core, site.component_type,
                          lambda node: continues_to_a_state(node, site.component_type))


def _approximate_first_order(site: StateOrderSite) -> StateOrder:
    """"approximate_first": a state that does not count as exact (its bound above the config's
    `threshold`) goes first, so exact states (the ones stock SGLang would hold and serve exact hits
    from) outlive approximate ones."""
    return GoesFirstOrder(site.tree_core, site.component_type,
                          lambda node: is_approximate(node, site.config().threshold))


def _stock_last_order(site: StateOrderSite) -> StateOrder:
    from sglang_ext.tail_replay.stock_last import StockLastOrder

    cache = site.cache
    return StockLastOrder(site.tree_core, site.component_type, site.config,
                          slots=lambda: getattr(cache.req_to_token_pool.mamba_allocator, "size", None),
                          inserting_record=cache.inserting_record, request_record=cache.request_record)


#: Tail-Replay's config orders (`state_order`; "auto" resolves, `resolved_order`)
TAIL_REPLAY_ORDERS: dict[str, Callable[[StateOrderSite], StateOrder]] = {
    "lru": _lru_order, "ends": _ends_order, "approximate_first": _approximate_first_order,
    "stock_last": _stock_last_order}


def register_orders() -> None:
    """Register Tail-Replay's config orders (idempotent; run at import). May mutate: the hooks'
    state order registry."""
    for name, factory in TAIL_REPLAY_ORDERS.items():
        add_state_order(name, factory)


register_orders()


# ---------------------------------------------------------------- the walk that runs them
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
        #: while set (`gated`), the walk frees only states that pass it, least recently used first
        self.gate: Callable[[Any], bool] | None = None

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
        if self.gate is not None:
            # a gated walk picks its own victims (the byte budget's, `gated`): no order runs, and
            # the config order's state (the stock shadow) sees no walk: stock would free nothing here
            self.walk_order = self.config_order
            return
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
        if self.gate is not None:
            victim = first_unlocked_state(self.site.tree_core.lru_lists[ct], ct, self.gate, GATED_SCAN)
        else:
            victim = self.walk_order.next_victim()
        if victim is None:
            return None
        core = self.site.tree_core
        core._evict_component_and_detach_lru(victim, self.component, target=EvictLayer.DEVICE, tracker=tracker,
                                             device_frees=device_frees, host_frees=host_frees,
                                             cache_actions=cache_actions)
        core._update_evictable_leaf_sets(victim)
        return None

    @contextlib.contextmanager
    def gated(self, may_go: Callable[[Any], bool]) -> Iterator[None]:
        """Walks inside this block free only unlocked states whose node passes `may_go` (asked
        afresh at each step, of the `GATED_SCAN` least recently used: freeing one may change
        another's answer), least recently used first, instead of the config order's victims; the
        walk ends when none of them passes. Not with the session
        radix cache (its LRU is partitioned: the byte budget does not run there). May mutate: the
        gate (set for the block)."""
        self.gate = may_go
        try:
            yield
        finally:
            self.gate = None

    def end(self) -> None:
        """The walk is over. May mutate: the orders' state."""
        if self.gate is not None:   # a gated walk started no order
            self.walk_order = None
            return
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
