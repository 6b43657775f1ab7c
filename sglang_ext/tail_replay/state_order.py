"""The order in which states go under state pressure (SGLang adapter: a mixin of
`TailReplayMambaComponent`). State pressure frees states, never attention KV; which state goes
first is SGLang's LRU order, unless the config's `state_order` (or an eviction policy,
`--radix-eviction-policy sae`) puts some first.

The default (`state_order: "auto"`) under `exactness` "exact_first" / "exact" /
"exact_unless_pressed" is "stock_last": Tail-Replay's own states never displace an exact state
stock SGLang would still hold for the same slots. The component keeps a shadow of stock SGLang's
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
"""

from __future__ import annotations

from collections import OrderedDict
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
    `exactness` ("lru" under "approximate", else "stock_last")."""
    if config.state_order != "auto":
        return config.state_order
    return "lru" if config.exactness == "approximate" else "stock_last"


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


class StateEvictionOrder:
    """The Mamba component's device-state eviction (`self.config` is the server's config)."""

    _stock_shadow: StockStateShadow | None = None

    @property
    def stock_shadow(self) -> StockStateShadow | None:
        """The shadow of stock SGLang's state LRU, kept under the "stock_last" order only (not with
        the session radix cache or HiCache, whose state walks stay SGLang's)."""
        if resolved_order(self.config) != "stock_last" or self.tree_core.enable_session_radix_cache \
                or self.tree_core.enable_hicache:
            return None
        if self._stock_shadow is None:
            allocator = self.cache.req_to_token_pool.mamba_allocator
            self._stock_shadow = StockStateShadow(getattr(allocator, "size", None))
        return self._stock_shadow

    def forget_stock_shadow(self) -> None:
        """The tree was reset (`/flush_cache`): stock's would be empty too, and the shadow's
        nodes are gone. May mutate: the shadow (dropped; made anew on next use)."""
        self._stock_shadow = None

    def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
        """Stock's insert of the same state makes it its most recently used. May mutate: the shadow,
        and what the next classes' inserts do."""
        super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
        shadow = self.stock_shadow
        depth = result.prefix_len + (len(node.key) if is_new_leaf else 0)
        if shadow is not None and params.mamba_value is not None and self._stock_inserts(node, depth):
            shadow.touch(node)

    def _stock_inserts(self, node: Any, depth: int) -> bool:
        """Whether stock SGLang's tree gets a state where the running insert stores one (at
        `node`, `depth` deep): a request's own (stock computes the same request, exactly, and
        keeps its state there), but for an approximate one whose request branched off the tree at
        another depth (`stock_branch_depth`: stock's miss kept its exact state at that branch
        point, not here; the shared-state repair's insert puts it there); a repair run's (its exact
        state stands where stock's kept one); not an audit's reference run's (stock runs none).
        Reads only."""
        record = self.cache.inserting_record()
        if record is None:
            return True
        if record.config.audit_of is not None:
            return False
        if record.config.repair_of is not None:
            return True
        return record.stock_branch_depth in (None, depth) or not self._is_approximate(node)

    def _evict_device_start(self, request_cnt: int) -> None:
        """An eviction walk that must free `request_cnt` states: stock frees as many as it would be
        short of (`stock_shortfall`), its least recently used, before Tail-Replay picks its victims
        (which then go first if Tail-Replay still holds them). May mutate: the shadow."""
        super()._evict_device_start(request_cnt)
        shadow = self.stock_shadow
        if shadow is not None:
            core, ct = self.tree_core, self.component_type
            held = core.component_evictable_size(ct) + core.component_protected_size(ct)
            shadow.evict(stock_shortfall(request_cnt, held, len(shadow)))

    def shadow_match(self, params: Any, nodes: list[Any]) -> None:
        """Stock's match of the same key touches the deepest state it holds on the path (not a
        background run's match). May mutate: the shadow's order."""
        shadow = self.stock_shadow
        if shadow is None:
            return
        if params.req is not None and self.cache.request_record(params.req).config.background:
            return
        shadow.touch_deepest(nodes)

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
        patches/sae/state_eviction.py). May mutate: the walk cursor."""
        lru = self.tree_core.lru_lists[self.component_type]
        by_session = self.tree_core.enable_session_radix_cache
        order = resolved_order(self.config)
        if order == "stock_last" and not by_session:
            victim = self._stock_last_victim(lru)
            if victim is not None:
                return victim
        goes_first = self._goes_first.get(order)
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

    def _stock_last_victim(self, lru: Any) -> Any:
        """State order "stock_last": a state that does not count as exact, else an exact one the
        stock shadow does not hold (each least recently used first), else the first unlocked
        state in the shadow's (stock's) order; None: SGLang's order runs. Reads only."""
        victim = self._first_unlocked_state(lru, StateEvictionOrder._is_approximate)
        shadow = self.stock_shadow
        if victim is not None or shadow is None:
            return victim
        victim = self._first_unlocked_state(lru, lambda self, node: not shadow.holds(node))
        if victim is not None:
            return victim
        for node in shadow.in_order():
            data = node.component_data[self.component_type]
            if data.value is not None and data.lock_ref == 0 and lru.in_list(node):
                return node
        return None

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
        """State order "approximate_first" (and "stock_last"'s first class): the state does not
        count as exact (its bound above the config's `threshold`), so exact states (the ones stock
        SGLang would hold and serve exact hits from) outlive approximate ones."""
        prov = provenance_of(node)
        return prov is not None and not provenance.counts_exact(prov.state, self.config.threshold)

    #: `state_order` -> which states go first under state pressure (then least recently used)
    _goes_first: dict[str, Callable[[Any, Any], bool]] = {"ends": _is_superseded, "approximate_first": _is_approximate}
