"""Extension points between the wings: what one wing adds to another's seams, registered by the
wing that adds it, so no wing imports another's internals (and Tail-Replay's code never names
LinearKV). The plugin wires them once per process (`sglang_ext.plugin.register_cache_backends`,
which every SGLang process of a patched server runs). Pure: no SGLang import.

- decay captures: `req -> (accumulator, first, end) | None`: prefill rows of a request whose
  per-layer log-decays the gate hooks sum (Tail-Replay's bound seam, `patches/tail_replay/batch.py`),
  beside Tail-Replay's own approximate tails. LinearKV: a chunk registration's transition.
- meta contributors: `req -> (key, summary) | None`: a per-request summary added to
  `meta_info.cached_tokens_details[key]` (`patches/tail_replay/meta.py`).
- request backends: radix-cache backends whose requests carry Tail-Replay request fields (validated
  on arrival by `patches/tail_replay/request.py`). LinearKV serves its exact prefix with Tail-Replay.
- state orders: `name -> factory(StateOrderSite) -> StateOrder`, which device state Tail-Replay's
  state-only eviction walk frees next (`sglang_ext.tail_replay.state_order.StateEvictionWalk`). Tail-Replay registers
  its config's orders ("lru", "ends", "approximate_first", "stock_last"); a policy registers its
  own with `chosen_when(tree_core)`, and then runs the walks it is chosen for over the config's
  order. SAECache: "sae" (`sglang_ext.eviction.sglang_adapter.register_policy`).

May mutate: the module's registries (registration only; idempotent per function or name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DecayCapture = Callable[[Any], "tuple[Any, int, int] | None"]
MetaContributor = Callable[[Any], "tuple[str, Any] | None"]

_decay_captures: list[DecayCapture] = []
_meta_contributors: list[MetaContributor] = []
_request_backends: set[str] = set()


def add_decay_capture(fn: DecayCapture) -> None:
    if fn not in _decay_captures:
        _decay_captures.append(fn)


def add_meta_contributor(fn: MetaContributor) -> None:
    if fn not in _meta_contributors:
        _meta_contributors.append(fn)


def add_request_backend(name: str) -> None:
    _request_backends.add(name)


def decay_capture(req: Any) -> tuple[Any, int, int] | None:
    """The first registered capture of a request, or None."""
    for fn in _decay_captures:
        found = fn(req)
        if found is not None:
            return found
    return None


def meta_contributions(req: Any) -> list[tuple[str, Any]]:
    """Every registered summary of a request, as (key, summary)."""
    return [found for fn in _meta_contributors if (found := fn(req)) is not None]


def request_backends() -> frozenset[str]:
    return frozenset(_request_backends)


class StateOrder:
    """Which device state a Mamba component's state-only eviction walk frees next. One instance
    per component and order; the walk calls `start` / `next_victim`... / `end`, and every
    component event reaches the observers (`on_insert`, `on_match`, `reset`) of the config's
    order, whichever order runs the walk. Only `next_victim` must be given."""

    def start(self, request_cnt: int) -> None:
        """A walk that must free `request_cnt` states begins. May mutate: the order's own state."""

    def next_victim(self) -> Any:
        """The next node whose unlocked device state the walk frees, or None (the walk stops).
        May mutate: the order's cursor (never the tree: the walk frees the state)."""
        raise NotImplementedError(f"{type(self).__name__} gives no next_victim")

    def end(self) -> None:
        """The walk is over. May mutate: the order's own state."""

    def on_insert(self, node: Any, depth: int, params: Any) -> None:
        """An insert committed at `node` (`depth` tokens deep; `params.mamba_value`: the state it
        stores, or None). May mutate: the order's own state."""

    def on_match(self, params: Any, nodes: list[Any]) -> None:
        """A match walked `nodes` (root first) for `params.req`. May mutate: the order's own state."""

    def reset(self) -> None:
        """The tree was reset (`/flush_cache`). May mutate: the order's own state."""


@dataclass(frozen=True)
class StateOrderSite:
    """What a state order's factory gets: the Mamba component's tree core (its state LRU is
    `tree_core.lru_lists[component_type]`), its component type, the server config's getter
    (Tail-Replay's config) and the radix cache (its request records, its pools)."""

    tree_core: Any
    component_type: Any
    config: Callable[[], Any]
    cache: Any


StateOrderFactory = Callable[[StateOrderSite], StateOrder]

_state_orders: dict[str, StateOrderFactory] = {}
_chosen_when: dict[str, Callable[[Any], bool]] = {}


def add_state_order(name: str, factory: StateOrderFactory, *,
                    chosen_when: Callable[[Any], bool] | None = None) -> None:
    """Register the state order `name` (replacing an earlier one of that name). `chosen_when`:
    a policy's order, which runs each walk for which `chosen_when(tree_core)` holds at its start
    (else the order the config names runs it)."""
    _state_orders[name] = factory
    _chosen_when.pop(name, None)
    if chosen_when is not None:
        _chosen_when[name] = chosen_when


def remove_state_order(name: str) -> None:
    _state_orders.pop(name, None)
    _chosen_when.pop(name, None)


def state_orders() -> tuple[str, ...]:
    """The registered state orders' names, in registration order."""
    return tuple(_state_orders)


def state_order_factory(name: str) -> StateOrderFactory:
    """The factory of the registered order `name`; ValueError naming the registered ones."""
    try:
        return _state_orders[name]
    except KeyError:
        raise ValueError(f"no state order {name!r} registered (registered: {state_orders()})") from None


def chosen_state_order(tree_core: Any) -> str | None:
    """The first registered policy order chosen for a walk of `tree_core` now, or None."""
    return next((name for name, chosen in _chosen_when.items() if chosen(tree_core)), None)
