"""State order "stock_last" (the default under every `exactness` but "approximate"; see
`state_order`): Tail-Replay's own states never displace an exact state stock SGLang would still
hold for the same slots. The order observes the component's inserts and matches into its shadow of
stock's state LRU (`StockStateShadow`), and frees, each least recently used first, a state that
does not count as exact, then an exact one stock would no longer hold, then stock's in stock's
order; SGLang's order when none is left. The shadow is kept only without the session radix cache
or HiCache (whose state walks stay SGLang's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_ext.hooks import StateOrder
from sglang_ext.tail_replay.state_order import (
    LruOrder,
    StockStateShadow,
    first_unlocked_state,
    is_approximate,
    stock_shortfall,
)


class StockLastOrder(StateOrder):
    """Needs the tree core, the component type, the server config's getter (its `threshold`), the
    state pool's slot count (`slots()`: the shadow's capacity, read when the shadow is made), and
    the cache's record accessors: `inserting_record()` (the record of the request whose insert
    runs, or None) and `request_record(req)`."""

    def __init__(self, tree_core: Any, component_type: Any, config: Callable[[], Any], *,
                 slots: Callable[[], int | None], inserting_record: Callable[[], Any],
                 request_record: Callable[[Any], Any]) -> None:
        self.tree_core = tree_core
        self.component_type = component_type
        self.config = config
        self.slots = slots
        self.inserting_record = inserting_record
        self.request_record = request_record
        self.lru_order = LruOrder(tree_core, component_type)
        self._shadow: StockStateShadow | None = None

    @property
    def shadow(self) -> StockStateShadow | None:
        """The shadow of stock SGLang's state LRU; None with the session radix cache or HiCache.
        May mutate: the shadow (made on first use)."""
        if self.tree_core.enable_session_radix_cache or self.tree_core.enable_hicache:
            return None
        if self._shadow is None:
            self._shadow = StockStateShadow(self.slots())
        return self._shadow

    def reset(self) -> None:
        """The tree was reset (`/flush_cache`): stock's would be empty too, and the shadow's nodes
        are gone. May mutate: the shadow (dropped; made anew on next use)."""
        self._shadow = None

    def start(self, request_cnt: int) -> None:
        """An eviction walk that must free `request_cnt` states: stock frees as many as it would be
        short of (`stock_shortfall`), its least recently used, before Tail-Replay picks its victims
        (which then go first if Tail-Replay still holds them). May mutate: the shadow, the cursor."""
        self.lru_order.start(request_cnt)
        shadow = self.shadow
        if shadow is not None:
            core, ct = self.tree_core, self.component_type
            held = core.component_evictable_size(ct) + core.component_protected_size(ct)
            shadow.evict(stock_shortfall(request_cnt, held, len(shadow)))

    def end(self) -> None:
        self.lru_order.end()

    def next_victim(self) -> Any:
        """A state that does not count as exact, else an exact one the shadow does not hold (each
        least recently used first), else the first unlocked state in the shadow's (stock's) order,
        else SGLang's order (only SGLang's with the session radix cache). May mutate: the cursor."""
        if not self.tree_core.enable_session_radix_cache:
            victim = self._stock_last_victim()
            if victim is not None:
                return victim
        return self.lru_order.next_victim()

    def _stock_last_victim(self) -> Any:
        ct = self.component_type
        lru = self.tree_core.lru_lists[ct]
        threshold = self.config().threshold
        victim = first_unlocked_state(lru, ct, lambda node: is_approximate(node, threshold))
        shadow = self.shadow
        if victim is not None or shadow is None:
            return victim
        victim = first_unlocked_state(lru, ct, lambda node: not shadow.holds(node))
        if victim is not None:
            return victim
        for node in shadow.in_order():
            data = node.component_data[ct]
            if data.value is not None and data.lock_ref == 0 and lru.in_list(node):
                return node
        return None

    def on_insert(self, node: Any, depth: int, params: Any) -> None:
        """Stock's insert of the same state makes it its most recently used. May mutate: the
        shadow's order."""
        shadow = self.shadow
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
        record = self.inserting_record()
        if record is None:
            return True
        if record.config.audit_of is not None:
            return False
        if record.config.repair_of is not None:
            return True
        return record.stock_branch_depth in (None, depth) or not is_approximate(node, self.config().threshold)

    def on_match(self, params: Any, nodes: list[Any]) -> None:
        """Stock's match of the same key touches the deepest state it holds on the path (not a
        background run's match). May mutate: the shadow's order."""
        shadow = self.shadow
        if shadow is None:
            return
        if params.req is not None and self.request_record(params.req).config.background:
            return
        shadow.touch_deepest(nodes)
