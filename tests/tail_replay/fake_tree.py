"""A fake radix tree for the Mamba component's parts (no pools, no server): nodes with a key, a
parent, children and per-component data; a state LRU with SGLang's walk methods; a tree core with
the calls the parts make (a state eviction frees the value and records the node)."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA


@dataclass
class Data:
    value: Any = None
    host_value: Any = None
    lock_ref: int = 0


@dataclass(eq=False)
class Node:
    id: int
    key: list
    parent: Any = None
    children: dict = field(default_factory=dict)
    component_data: dict = field(default_factory=lambda: {FULL: Data(), MAMBA: Data()})


class FakeLru:
    """Least recently used first in `nodes`; the `_no_lock` walks skip locked nodes."""

    def __init__(self, component_type: Any = MAMBA) -> None:
        self.nodes: list[Node] = []
        self.component_type = component_type

    def in_list(self, node: Any) -> bool:
        return node is not None and any(n is node for n in self.nodes)

    def _unlocked_from(self, i: int) -> Any:
        for node in self.nodes[i:]:
            if node.component_data[self.component_type].lock_ref == 0:
                return node
        return None

    def get_lru_no_lock(self) -> Any:
        return self._unlocked_from(0)

    def get_prev_no_lock(self, node: Node) -> Any:
        return self._unlocked_from(self.nodes.index(node) + 1)

    def reset_node_mru(self, node: Node) -> None:
        self.nodes.remove(node)
        self.nodes.append(node)


class FakeCore:
    """A tree core over `root`, with a state LRU; `freed`: the nodes whose state a walk freed."""

    def __init__(self) -> None:
        self.root_node = Node(0, [])
        self.lru_lists = {MAMBA: FakeLru()}
        self.enable_session_radix_cache = False
        self.enable_hicache = False
        self.freed: list[int] = []

    def add(self, node_id: int, parent: Node, tokens: int, state: Any = None) -> Node:
        """A child of `parent` with `tokens` tokens (and a device state: the most recently used)."""
        node = Node(node_id, list(range(tokens)), parent)
        parent.children[node_id] = node
        if state is not None:
            node.component_data[MAMBA].value = state
            self.lru_lists[MAMBA].nodes.append(node)
        return node

    def component_evictable_size(self, ct: Any) -> int:
        return sum(1 for n in self.lru_lists[ct].nodes if n.component_data[ct].lock_ref == 0)

    def component_protected_size(self, ct: Any) -> int:
        return sum(1 for n in self.lru_lists[ct].nodes if n.component_data[ct].lock_ref > 0)

    def _evict_component_and_detach_lru(self, node, component, *, target, tracker, device_frees, host_frees,
                                        cache_actions) -> None:
        ct = component.component_type
        device_frees[ct].append(node.component_data[ct].value)
        node.component_data[ct].value = None
        self.lru_lists[ct].nodes.remove(node)
        tracker[ct] += 1
        self.freed.append(node.id)

    def _update_evictable_leaf_sets(self, node) -> None:
        pass
