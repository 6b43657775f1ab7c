"""State orders as registered policies (`sglang_ext.hooks`): Tail-Replay's four config orders
and SAE's, registered by the eviction wing; a made-up order registered here runs the walk it is
chosen for, on a fake tree (`fake_tree`) and on the kit's real pools (`test_state_order.Server`),
with the exact victims in order; the config's order keeps observing under a chosen one."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

from sglang_ext import hooks  # noqa: E402
from sglang_ext.hooks import StateOrder, add_state_order, remove_state_order  # noqa: E402
from sglang_ext.tail_replay.state_order import register_orders  # noqa: E402
from tests.tail_replay.fake_tree import MAMBA, FakeCore  # noqa: E402
from tests.tail_replay.test_component_parts import CONFIG, _evict, _leaves, _walk  # noqa: E402
from tests.tail_replay.test_state_order import CONFIG as SERVED  # noqa: E402
from tests.tail_replay.test_state_order import STEMS, Server  # noqa: E402
from tests.tail_replay.tree_walk import tree_nodes  # noqa: E402


def test_the_registry_holds_tail_replays_orders_and_saes_once_the_eviction_wing_registers():
    from sglang_ext.eviction.sglang_adapter import register_policy

    register_orders()
    register_policy()
    register_policy()
    names = hooks.state_orders()
    assert sorted(names) == ["approximate_first", "ends", "lru", "sae", "stock_last"]
    assert hooks.chosen_state_order(FakeCore()) is None   # SAE's runs a walk only under its policy


class HighestIdFirst(StateOrder):
    """A made-up order: the unlocked states by node id, highest first."""

    def __init__(self, tree_core: Any, component_type: Any) -> None:
        self.tree_core, self.component_type, self.queue = tree_core, component_type, []

    def start(self, request_cnt: int) -> None:
        lru = self.tree_core.lru_lists[self.component_type]
        self.queue = sorted((n for n in lru.nodes if n.component_data[self.component_type].lock_ref == 0),
                            key=lambda n: -n.id)

    def next_victim(self) -> Any:
        return self.queue.pop(0) if self.queue else None


def test_a_registered_policy_order_runs_the_walk_it_is_chosen_for():
    core, other = FakeCore(), FakeCore()
    for tree in (core, other):
        nodes = _leaves(tree, 5)
        nodes[3].component_data[MAMBA].lock_ref = 1   # node 4: a running request's
    add_state_order("highest_id_first", lambda site: HighestIdFirst(site.tree_core, site.component_type),
                    chosen_when=lambda tree_core: tree_core is core)
    try:
        lru = CONFIG.replaced(state_order="lru")
        assert _evict(_walk(core, lru), 3) == [5, 3, 2]
        assert _evict(_walk(other, lru), 3) == [1, 2, 3]   # not chosen: the config's
    finally:
        remove_state_order("highest_id_first")
    assert "highest_id_first" not in hooks.state_orders()


def test_the_config_order_observes_under_a_chosen_policy_order():
    """A policy's order runs the walk; the config's ("stock_last") still sees the walk start."""
    core = FakeCore()
    nodes = _leaves(core, 3)
    cache = SimpleNamespace(req_to_token_pool=SimpleNamespace(mamba_allocator=SimpleNamespace(size=8)),
                            inserting_record=lambda: None, request_record=lambda req: None)
    walk = _walk(core, CONFIG, cache)
    for node in nodes:
        walk.on_insert(node, 4, SimpleNamespace(mamba_value=node.component_data[MAMBA].value))
    add_state_order("highest_id_first", lambda site: HighestIdFirst(site.tree_core, site.component_type),
                    chosen_when=lambda tree_core: tree_core is core)
    try:
        assert _evict(walk, 1) == [3]
    finally:
        remove_state_order("highest_id_first")
    assert [n.id for n in walk.config_order.shadow.in_order()] == [2, 3]   # stock freed its oldest
    walk.reset()
    assert walk.config_order.shadow.in_order() == []


class HighestSlotFirst(StateOrder):
    """A made-up policy order: the unlocked states by state slot, highest first; it records the
    slots of its victims."""

    def __init__(self, tree_core: Any, component_type: Any, victims: list[int]) -> None:
        self.tree_core, self.component_type, self.victims, self.queue = tree_core, component_type, victims, []

    def start(self, request_cnt: int) -> None:
        held = [n for n, _ in tree_nodes(SimpleNamespace(tree_core=self.tree_core))
                if n.component_data[MAMBA].value is not None and n.component_data[MAMBA].lock_ref == 0]
        self.queue = sorted(held, key=lambda n: -int(n.component_data[MAMBA].value.item()))

    def next_victim(self) -> Any:
        if not self.queue:
            return None
        node = self.queue.pop(0)
        self.victims.append(int(node.component_data[MAMBA].value.item()))
        return node


def test_a_registered_policy_order_runs_the_components_walk():
    """Four slots, three conversations' states, then two requests: the first takes the free slot,
    the second needs one. The made-up order registered for this tree frees the state in the
    highest slot (the latest request's), where the default frees the least recently used."""
    tr = Server(SERVED, mamba_size=4)
    core, victims = tr.cache.tree_core, []
    add_state_order("highest_slot_first", lambda site: HighestSlotFirst(site.tree_core, site.component_type, victims),
                    chosen_when=lambda tree_core: tree_core is core)
    try:
        for tokens in (*STEMS, list(range(8000, 8040)), list(range(8100, 8140))):
            tr.run(tokens)
    finally:
        remove_state_order("highest_slot_first")
    assert victims == [4]
    held = tr.states()
    assert tuple(range(8000, 8040)) not in held and all(tuple(stem) in held for stem in STEMS)
