"""The parts of `TailReplayMambaComponent`, each on a fake tree (`fake_tree`: no pools, no server):
the state eviction walk and its registered orders, the provenance writer, the host-tier rules and
the branch-point track. The orders against stock SGLang's own cache: test_state_order.py."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from types import SimpleNamespace  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.unified_cache.cache_action import FreeDeviceKV  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase  # noqa: E402

from sglang_ext.tail_replay.branch_rules import BranchPointTrack  # noqa: E402
from sglang_ext.tail_replay.config import TailReplayConfig  # noqa: E402
from sglang_ext.tail_replay.provenance.bounds import TAINT, NodeProvenance  # noqa: E402
from sglang_ext.tail_replay.provenance.tree import (  # noqa: E402
    ANSWER_FROM_ATTR,
    ProvenanceWriter,
    answer_from,
    provenance_of,
    set_provenance,
)
from sglang_ext.tail_replay.provenance.writes import InsertContext  # noqa: E402
from sglang_ext.tail_replay.request import TailReplayRequest  # noqa: E402
from sglang_ext.tail_replay.state_order import StateEvictionWalk  # noqa: E402
from sglang_ext.tail_replay.stock_last import StockLastOrder  # noqa: E402
from sglang_ext.tail_replay.tiers import HostTierRules  # noqa: E402
from tests.tail_replay.fake_tree import FULL, MAMBA, FakeCore  # noqa: E402

CONFIG = TailReplayConfig()
APPROXIMATE = 1.0   # a state bound no threshold counts as exact


def _chain(core: FakeCore, states: list[bool]) -> list:
    """Nodes 1..n under the root, each the only child of the one before, 4 tokens each; those with
    a state enter the state LRU in order (node 1 least recently used)."""
    nodes, parent = [], core.root_node
    for i, has_state in enumerate(states, start=1):
        parent = core.add(i, parent, 4, torch.tensor([i]) if has_state else None)
        nodes.append(parent)
    return nodes


def _leaves(core: FakeCore, count: int, first_id: int = 1) -> list:
    """`count` leaves under the root, each with a state, least recently used first."""
    return [core.add(first_id + i, core.root_node, 4, torch.tensor([first_id + i])) for i in range(count)]


def _walk(core: FakeCore, config: TailReplayConfig = CONFIG, cache: Any = None) -> StateEvictionWalk:
    component = SimpleNamespace(tree_core=core, component_type=MAMBA)
    return StateEvictionWalk(component, lambda: config, cache if cache is not None else SimpleNamespace())


def _evict(walk: StateEvictionWalk, request_cnt: int) -> list[int]:
    """One eviction walk that must free `request_cnt` states; the ids freed, in order."""
    core = walk.site.tree_core
    before = len(core.freed)
    tracker, frees = {MAMBA: 0}, {MAMBA: []}
    walk.start(request_cnt)
    for _ in range(len(core.lru_lists[MAMBA].nodes) + 1):
        walk.next_node(tracker, frees, {MAMBA: []}, [])
    walk.end()
    return core.freed[before:]


# ---------------------------------------------------------------- the walk and its orders


@pytest.mark.parametrize(("order", "freed"), [("lru", [3, 1, 2]), ("ends", [1, 3, 2])])
def test_ends_frees_a_state_its_conversation_moved_past_first(order, freed):
    """Node 1 continues in one child (node 2) with a state: its conversation moved past it. Node 3
    is another conversation's end (least recently used)."""
    core = FakeCore()
    one = core.add(1, core.root_node, 4, torch.tensor([1]))
    core.add(2, one, 4, torch.tensor([2]))
    core.add(3, core.root_node, 4, torch.tensor([3]))
    core.lru_lists[MAMBA].nodes = [core.root_node.children[3], one, one.children[2]]
    config = CONFIG.replaced(state_order=order)
    assert _evict(_walk(core, config), 3) == freed


def test_approximate_first_frees_the_approximate_states_first_then_lru():
    core = FakeCore()
    nodes = _leaves(core, 4)
    for node in (nodes[1], nodes[3]):
        set_provenance(node, NodeProvenance(None, APPROXIMATE))
    config = CONFIG.replaced(state_order="approximate_first")
    assert _evict(_walk(core, config), 3) == [2, 4, 1]


def test_the_walk_stops_at_its_count_and_skips_locked_states():
    core = FakeCore()
    nodes = _leaves(core, 3)
    nodes[0].component_data[MAMBA].lock_ref = 1
    config = CONFIG.replaced(state_order="lru")
    walk = _walk(core, config)
    assert _evict(walk, 1) == [2]
    assert _evict(walk, 5) == [3]   # nothing unlocked is left
    assert nodes[0].component_data[MAMBA].value is not None


# ---------------------------------------------------------------- "stock_last"


def _stock_last(core: FakeCore, *, inserting=None, background: bool = False) -> StockLastOrder:
    record = SimpleNamespace(config=SimpleNamespace(background=background))
    return StockLastOrder(core, MAMBA, lambda: CONFIG, slots=lambda: 8, inserting_record=lambda: inserting,
                          request_record=lambda req: record)


def _insert(order: StockLastOrder, node) -> None:
    order.on_insert(node, 4, SimpleNamespace(mamba_value=node.component_data[MAMBA].value))


def test_stock_last_frees_approximate_then_what_stock_let_go_then_stocks_order():
    core = FakeCore()
    nodes = _leaves(core, 4)
    order = _stock_last(core)
    for node in nodes:
        _insert(order, node)
    set_provenance(nodes[2], NodeProvenance(None, APPROXIMATE))
    order.start(1)                          # both trees hold 4: stock frees its oldest (node 1)
    assert [n.id for n in order.shadow.in_order()] == [2, 3, 4]
    assert order.next_victim() is nodes[2]  # (1) the approximate state
    nodes[2].component_data[MAMBA].value = None
    core.lru_lists[MAMBA].nodes.remove(nodes[2])
    assert order.next_victim() is nodes[0]  # (2) an exact one stock let go
    nodes[0].component_data[MAMBA].value = None
    core.lru_lists[MAMBA].nodes.remove(nodes[0])
    order.on_match(SimpleNamespace(req=None), [nodes[1]])   # stock's match touches node 2
    assert [n.id for n in order.shadow.in_order()] == [3, 4, 2]
    order.end()
    order.start(0)
    assert order.next_victim() is nodes[3]  # (3) stock's order: node 4 before node 2


def test_stock_last_observes_only_what_stock_would_do():
    core = FakeCore()
    nodes = _leaves(core, 2)
    audit = SimpleNamespace(config=SimpleNamespace(audit_of="r1", repair_of=None), stock_branch_depth=None)
    order = _stock_last(core, inserting=audit)
    _insert(order, nodes[0])                 # an audit's reference run: stock runs none
    assert order.shadow.in_order() == []
    background = _stock_last(core, background=True)
    _insert(background, nodes[0])
    background.on_match(SimpleNamespace(req=object()), [nodes[0]])   # a background run's match: not stock's
    _insert(background, nodes[1])
    assert [n.id for n in background.shadow.in_order()] == [1, 2]
    background.reset()
    assert background.shadow.in_order() == []
    core.enable_hicache = True
    assert background.shadow is None


# ---------------------------------------------------------------- the provenance writer


def _writer(core: FakeCore, *, prompt_len=None, bounds=None, state_bound=0.0, record=None, freed=None):
    inserting = SimpleNamespace(prompt_len=prompt_len, record=record, state_bound=lambda depth: state_bound,
                                bounds=lambda a, b: bounds[a:b] if bounds is not None else torch.zeros(b - a))
    inserting.max_bound = lambda a, b: float(inserting.bounds(a, b).max()) if b > a else 0.0
    inserting.awaits_repair_at = lambda depth, bound: InsertContext.awaits_repair_at(inserting, depth, bound)
    return ProvenanceWriter(core, MAMBA, inserting=lambda: inserting,
                            free_state=(freed.append if freed is not None else None))


def _stock_commit(calls: list):
    def commit(node, is_new_leaf, params, result, cache_actions):
        calls.append(node.id)
        if node.component_data[MAMBA].value is None:
            node.component_data[MAMBA].value = params.mamba_value
    return commit


def test_a_new_leaf_gets_the_inserting_requests_bounds_and_answer_mark():
    core = FakeCore()
    leaf = core.add(1, core.root_node, 4)
    bounds = torch.tensor([0.0] * 8 + [0.0, 0.0, 0.25, 0.5])
    writer, calls = _writer(core, prompt_len=10, bounds=bounds, state_bound=0.5), []
    writer.on_commit(leaf, True, SimpleNamespace(mamba_value=torch.tensor([7])), SimpleNamespace(prefix_len=8), [],
                     stock=_stock_commit(calls))
    assert calls == [1] and int(leaf.component_data[MAMBA].value) == 7
    assert answer_from(leaf) == 2
    prov = provenance_of(leaf)
    assert prov.kv.tolist() == [0.0, 0.0, 0.25, 0.5] and prov.state == 0.5


@pytest.mark.parametrize(("old", "new", "kept"), [(0.9, 0.1, "request"), (0.1, 0.5, "tree")])
def test_a_worse_stored_state_is_replaced_a_better_one_kept(old, new, kept):
    core = FakeCore()
    node, other = _leaves(core, 2)
    set_provenance(node, NodeProvenance(None, old))
    freed, calls = [], []
    writer = _writer(core, state_bound=new, freed=freed)
    writer.on_commit(node, False, SimpleNamespace(mamba_value=torch.tensor([9])), SimpleNamespace(prefix_len=4), [],
                     stock=_stock_commit(calls))
    if kept == "request":
        assert int(node.component_data[MAMBA].value) == 9 and freed[0].tolist() == [1] and calls == []
        assert core.lru_lists[MAMBA].nodes == [other, node] and provenance_of(node).state == new
    else:
        assert int(node.component_data[MAMBA].value) == 1 and freed == [] and calls == [1]
        assert provenance_of(node).state == old


@pytest.mark.parametrize(("asked_at", "bound", "stored"), [(4, 0.5, False), (4, 0.0, True), (8, 0.5, True),
                                                           (None, 0.5, True)])
def test_a_request_stores_no_inexact_state_where_it_asked_a_repair_for_the_exact_one(asked_at, bound, stored):
    # the repair's exact state lands on that node later; the request's own, stored there, would hold
    # the node (its lock while it runs) against it
    core = FakeCore()
    node = core.add(1, core.root_node, 4)
    node.component_data[MAMBA].value = None
    record = TailReplayRequest(TailReplayConfig())
    record.repair_asked_at = asked_at
    calls = []
    writer = _writer(core, state_bound=bound, record=record)
    params, result = SimpleNamespace(mamba_value=torch.tensor([9])), SimpleNamespace(prefix_len=4, mamba_exist=False)
    writer.on_commit(node, False, params, result, [], stock=_stock_commit(calls))
    if stored:
        assert int(node.component_data[MAMBA].value) == 9 and calls == [1] and not result.mamba_exist
    else:   # SGLang frees the request's copy, as for a node that holds a state
        assert node.component_data[MAMBA].value is None and calls == [] and result.mamba_exist


def test_a_split_keeps_each_halfs_bounds_and_answer_mark():
    core = FakeCore()
    parent, child = core.add(1, core.root_node, 2), core.add(2, core.root_node, 2)
    set_provenance(child, NodeProvenance(torch.tensor([0.0, 0.1, 0.2, 0.3]), 0.3))
    setattr(child, ANSWER_FROM_ATTR, 1)
    ProvenanceWriter.on_split(parent, child)
    assert provenance_of(parent).kv.tolist() == pytest.approx([0.0, 0.1]) and provenance_of(parent).state == 0.0
    assert provenance_of(child).kv.tolist() == pytest.approx([0.2, 0.3]) and provenance_of(child).state == 0.3
    assert (answer_from(parent), answer_from(child)) == (1, 0)


def test_fresher_exact_kv_replaces_an_approximate_nodes_unless_locked():
    core = FakeCore()
    node = core.add(1, core.root_node, 4)
    node.component_data[FULL].value = torch.tensor([1, 2, 3, 4])
    set_provenance(node, NodeProvenance(torch.full((4,), 0.5)))
    params, actions = SimpleNamespace(prev_prefix_len=0), []
    consumed = _writer(core).on_overlap(node, 4, 0, torch.tensor([5, 6, 7, 8]), params, actions, 4)
    assert consumed == 0 and node.component_data[FULL].value.tolist() == [5, 6, 7, 8]
    assert isinstance(actions[0], FreeDeviceKV) and provenance_of(node) is None

    set_provenance(node, NodeProvenance(torch.full((4,), 0.5)))
    node.component_data[FULL].lock_ref = 1
    record = TailReplayRequest(TailReplayConfig())
    assert _writer(core, record=record).on_overlap(node, 4, 0, torch.tensor([9] * 4), params, [], 4) == 4
    assert node.component_data[FULL].value.tolist() == [5, 6, 7, 8] and record.floor == TAINT


# ---------------------------------------------------------------- the host-tier rules


def test_host_tier_rules_run_sglangs_steps_only_for_host_states():
    core, load = FakeCore(), [None]
    core.enable_hicache = True
    node = core.add(5, core.root_node, 4, torch.tensor([5]))
    calls: list = []

    def rules(keep: bool) -> HostTierRules:
        config = CONFIG.replaced(keep_checkpoints=keep)
        return HostTierRules(core, lambda: config, state_load_node=lambda: load[0],
                             inserting=lambda: SimpleNamespace(bounds=lambda a, b: torch.tensor([0.0, 0.7, 0.0, 0.0])))

    def stock(*args, **kwargs):
        calls.append(args)
        return "stock"

    kv_only = rules(False)
    assert not kv_only.host_states and not kv_only.needs_incremental_backup(node, stock)
    assert kv_only.build_hicache_transfers(node, CacheTransferPhase.BACKUP_HOST, stock) is None
    kv_only.drive_host_eviction(lambda: calls.append("evict"))
    assert calls == []
    states = rules(True)
    assert states.host_states and states.build_hicache_transfers(node, CacheTransferPhase.BACKUP_HOST, stock) == "stock"
    assert states.build_hicache_transfers(node, CacheTransferPhase.BACKUP_STORAGE, stock) is None
    assert states.build_hicache_transfers(node, CacheTransferPhase.LOAD_BACK, stock) is None   # not the plan's
    assert states.prepare_load_back(5, None, stock) != "stock"
    load[0] = 5
    assert states.build_hicache_transfers(node, CacheTransferPhase.LOAD_BACK, stock) == "stock"
    assert states.prepare_load_back(5, None, stock) == "stock"
    set_provenance(node, NodeProvenance(torch.tensor([0.5, 0.0, 0.0, 0.0]), 0.2))
    states.after_unevict(node, 0)
    assert provenance_of(node).kv.tolist() == pytest.approx([0.5, 0.7, 0.0, 0.0]) and provenance_of(node).state == 0.2


# ---------------------------------------------------------------- the branch-point track


class Match(NamedTuple):
    last_device_node: Any
    device_prefix_len: int
    full_kv_hit_length: int
    host_hit_length: int = 0
    mamba_branching_seqlen: Any = None


def _track(core: FakeCore, repair_kind=None):
    seen: dict = {}
    record = SimpleNamespace(config=SimpleNamespace(repair_kind=repair_kind))
    track = BranchPointTrack(core, MAMBA, 4, request_record=lambda req: record,
                             remember_matched_path=lambda path: seen.setdefault("path", path.nodes),
                             on_match=lambda params, nodes: seen.setdefault("match", nodes))
    return track, seen


@pytest.mark.parametrize(("state_below", "branching"), [(False, None), (True, 8)])
def test_the_branch_point_is_tracked_as_deep_as_stock_holds_the_kv(state_below, branching):
    """States at 4 and (or not) at 12; the match ends at 8. Without a state below 8, stock would
    have dropped the KV past 4 with its last state: nothing is tracked past the state at 4."""
    core = FakeCore()
    a, b, _ = _chain(core, [True, False, state_below])
    track, seen = _track(core)
    result = track.finalize(Match(b, 8, 8), SimpleNamespace(req=object()))
    assert result.mamba_branching_seqlen == branching
    assert seen == {"path": [a, b], "match": [a, b]}


def test_a_shared_state_repair_run_tracks_no_branch_point():
    core = FakeCore()
    _, b, _ = _chain(core, [True, False, True])
    track, seen = _track(core, repair_kind="shared_state")
    assert track.finalize(Match(b, 8, 8, mamba_branching_seqlen=4), SimpleNamespace(req=object())) \
        .mamba_branching_seqlen is None
    assert seen == {}


# ---------------------------------------------------------------- a running checkpoint without a slot


def _component_without_slots(record, evicted: list, frees: int = 0):
    """A Tail-Replay Mamba component over an extra-buffer cache whose state allocator has no slot
    (after `frees` evictions, one)."""
    from sglang_ext.tail_replay.component import TailReplayMambaComponent

    slots = []

    def evict_for_alloc(params):
        evicted.append(params.mamba_num)
        if len(evicted) <= frees:
            slots.append(torch.tensor([5]))

    component = object.__new__(TailReplayMambaComponent)
    allocator = SimpleNamespace(alloc=lambda n: slots.pop() if slots else None)
    component.cache = SimpleNamespace(
        enable_mamba_extra_buffer=True, page_size=1, request_record=lambda req: record, evict_for_alloc=evict_for_alloc,
        req_to_token_pool=SimpleNamespace(mamba_allocator=allocator, mamba_ckpt_pool=None,
                                          donate_mamba_ping_pong_slot=lambda req, slot: slot + 100))
    return component


def test_a_running_checkpoint_without_a_state_slot_keeps_no_state_instead_of_killing_the_scheduler():
    # one byte budget under load: every byte held by running requests; SGLang asserts there
    from unittest import mock

    from sglang_ext.tail_replay.component import StateSlotShortfall

    lazy_off = SimpleNamespace(mamba=SimpleNamespace(enable_mamba_extra_buffer_lazy=False))
    record, evicted = TailReplayRequest(CONFIG), []
    component = _component_without_slots(record, evicted)
    req = SimpleNamespace(kv=SimpleNamespace(mamba_last_track_seqlen=64))
    params = SimpleNamespace(mamba_value=torch.tensor([3]))
    with mock.patch("sglang.srt.runtime_context.get_exec", return_value=lazy_off):
        with pytest.raises(StateSlotShortfall):
            component._alloc_mamba_slot(req)
        assert evicted == [1]                                    # eviction was asked for one state first
        assert component.prepare_for_caching_req(req, params, 100, False) == 100   # the KV, in full
        assert params.mamba_value is None and record.state_withheld
        # a slot freed by the eviction: the tracked state is donated as SGLang does
        record2, evicted2 = TailReplayRequest(CONFIG), []
        ok = _component_without_slots(record2, evicted2, frees=1)
        params2 = SimpleNamespace(mamba_value=None)
        assert ok.prepare_for_caching_req(req, params2, 100, False) == 64
        assert int(params2.mamba_value) == 105 and not record2.state_withheld and evicted2 == [1]
