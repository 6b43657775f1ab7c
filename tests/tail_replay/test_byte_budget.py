"""Unified memory's byte budget (`tail_replay/byte_budget.py`): which state is worth less per byte
than KV, on a fake tree, and the state walk that stops at the first state worth more. The live
server under `--enable-unified-memory`: tests/e2e/test_tail_replay_server.py."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from sglang_ext.tail_replay.byte_budget import exact_state_above, goes_before_kv  # noqa: E402
from sglang_ext.tail_replay.provenance.bounds import NodeProvenance  # noqa: E402
from sglang_ext.tail_replay.provenance.tree import set_provenance  # noqa: E402
from tests.tail_replay.fake_tree import MAMBA, FakeCore  # noqa: E402
from tests.tail_replay.test_component_parts import CONFIG, _chain, _evict, _walk  # noqa: E402


@pytest.mark.parametrize(("depth", "above", "cost", "exact_mode", "goes"), [
    (100, 0, 3100, True, True),        # saves 100 tokens of recompute for the bytes of 3,100 KV tokens
    (5000, 1000, 3100, True, False),   # saves 4,000: worth more than its bytes of KV
    (4100, 1000, 3100, True, False),   # exactly its bytes: KV goes first (ties keep the state)
    (4099, 1000, 3100, True, True),
    (100, None, 3100, True, False),    # the only exact state on its path keeps the path's hits exact
    (100, None, 3100, False, True),    # "approximate": any state may go before KV
    (5000, 1000, 3100, False, True),
])
def test_a_state_goes_before_kv_when_it_saves_less_than_its_bytes_of_kv(depth, above, cost, exact_mode, goes):
    assert goes_before_kv(depth, above, cost, exact_mode=exact_mode) is goes


def test_where_the_next_request_resumes_a_state_stays_before_kv_under_the_exact_modes():
    """A conversation's end or a branch point (its conversation has not gone on past it)."""
    assert not goes_before_kv(100, 0, 3100, exact_mode=True, moved_past=False)
    assert goes_before_kv(100, 0, 3100, exact_mode=False, moved_past=False)


def test_the_exact_state_above_skips_approximate_and_stateless_nodes():
    core = FakeCore()
    one, two, three, four = _chain(core, [True, True, False, True])   # depths 4, 8, 12, 16
    set_provenance(two, NodeProvenance(None, 1.0))                     # approximate
    assert exact_state_above(four, MAMBA, CONFIG.threshold) == 4
    assert exact_state_above(two, MAMBA, CONFIG.threshold) == 4
    assert exact_state_above(one, MAMBA, CONFIG.threshold) is None      # the root holds no state
    assert exact_state_above(two, MAMBA, 2.0) == 4
    set_provenance(one, NodeProvenance(None, 1.0))
    assert exact_state_above(four, MAMBA, CONFIG.threshold) is None
    assert exact_state_above(four, MAMBA, 2.0) == 8                     # a looser threshold counts it


def test_a_gated_walk_frees_only_states_that_may_go_least_recently_used_first():
    core = FakeCore()
    _chain(core, [True, True, True, True])
    walk = _walk(core, CONFIG.replaced(state_order="lru"))
    with walk.gated(lambda node: node.id != 3):
        assert _evict(walk, 4) == [1, 2, 4]     # node 3 may not go: skipped, the walk goes on
        assert _evict(walk, 1) == []            # none left that may go: the walk ends
    assert walk.gate is None
    assert _evict(walk, 1) == [3]               # ungated, the config order runs again
    assert core.lru_lists[MAMBA].nodes == []


class _FakeCache:
    """What `ByteBudget` reads of the SGLang cache: the allocator's exchange rate and move gate,
    the Mamba component's state walk (on the fake tree), `_evict` (one walk, as SGLang runs it:
    until a step frees nothing or the target is met) and the capacity views (each freed state
    gives one state's room, or `token_cost` KV tokens')."""

    def __init__(self, core: FakeCore, config=CONFIG, *, token_cost: int = 6, blocked: bool = False) -> None:
        from types import SimpleNamespace

        self.core = core
        self.token_cost = token_cost
        self.tail_replay_config = config
        states = SimpleNamespace(moves_blocked=lambda: blocked)
        self.token_to_kv_pool_allocator = SimpleNamespace(mamba_full_cache_donor=lambda: object(),
                                                          mamba_slot_full_token_cost=lambda: token_cost,
                                                          mamba_allocator=states)
        self.walk = _walk(core, config)
        self.components = {MAMBA: SimpleNamespace(states=self.walk)}
        self.targets: list = []
        self.recorded: list = []
        #: the KV leaves SGLang's eviction could take now, and the KV tokens evicted of them
        from sglang.srt.mem_cache.evict_policy import LRUStrategy

        self.tree_core = SimpleNamespace(evictable_device_leaves=set(), eviction_strategy=LRUStrategy())
        self.kv_freed = 0

    def mamba_evictable_size(self) -> int:
        return self.core.component_evictable_size(MAMBA)

    def _component_available_size(self, component_type) -> int:
        return len(self.core.freed) * (1 if component_type == MAMBA else self.token_cost) + \
            (0 if component_type == MAMBA else self.kv_freed)

    def _evict(self, params, targets):
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        self.targets.append(targets)
        if ComponentType.FULL in targets:   # KV leaves in SGLang's order (recency), as its walk takes them
            kind, target = targets[ComponentType.FULL]
            evicted = 0
            for leaf in sorted(self.tree_core.evictable_device_leaves, key=lambda n: n.last_access_time):
                if evicted >= params.num_tokens or self._component_available_size(kind) >= target:
                    break
                self.tree_core.evictable_device_leaves.discard(leaf)
                evicted += len(leaf.key)
                self.kv_freed += len(leaf.key)
            return EvictResult(num_tokens_evicted=evicted)
        kind, target = targets[MAMBA]
        before = len(self.core.freed)
        tracker, frees = {MAMBA: 0}, {MAMBA: []}
        self.walk.start(params.mamba_num)
        while self._component_available_size(kind) < target:
            freed = tracker[MAMBA]
            self.walk.next_node(tracker, frees, {MAMBA: []}, [])
            if tracker[MAMBA] == freed:
                break
        self.walk.end()
        return EvictResult(mamba_num_evicted=len(self.core.freed) - before)


def _budget_on_chain(order: list[int], config=CONFIG, **kwargs):
    """States at depths 4, 8, 12, 16 on one path (nodes 1-4), all exact, in the LRU as `order`;
    a state costs the bytes of 6 KV tokens."""
    from sglang_ext.tail_replay.byte_budget import ByteBudget

    core = FakeCore()
    nodes = _chain(core, [True, True, True, True])
    core.lru_lists[MAMBA].nodes = [nodes[i - 1] for i in order]
    cache = _FakeCache(core, config.replaced(state_order="lru"), **kwargs)
    return ByteBudget(cache, record=lambda shortfall, n: cache.recorded.append((shortfall, n))), cache, core


def test_on_a_state_shortfall_states_worth_less_than_their_bytes_go_first():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    budget, cache, core = _budget_on_chain([3, 2, 1, 4])
    result, rest = budget.states_first(EvictParams(mamba_num=1))
    # node 3 (depth 12) saves 12 - 8 = 4 tokens of recompute (node 2's exact state above), less than its 6
    assert core.freed == [3] and result.mamba_num_evicted == 1 and budget.states_freed == 1
    assert cache.targets == [{MAMBA: (MAMBA, 1)}] and rest == EvictParams(mamba_num=0)
    assert cache.recorded == [("state", 1)]
    result, rest = budget.states_first(EvictParams(mamba_num=3))
    # node 2 saves 8 - 4 = 4: goes; node 1 has no exact state above: stays; node 4 now saves
    # 16 - 4 = 12 >= 6: stays. Stock's eviction gets the other 2.
    assert core.freed == [3, 2] and result.mamba_num_evicted == 1 and rest == EvictParams(mamba_num=2)


def test_the_only_exact_state_on_a_path_never_goes_before_kv_under_the_exact_modes():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    budget, _, core = _budget_on_chain([1, 2, 3, 4])
    budget.states_first(EvictParams(mamba_num=4))
    # node 1 is its path's only exact state; node 3 then saves 8; node 4 is the conversation's end
    assert core.freed == [2]
    budget, _, core = _budget_on_chain([1, 2, 3, 4], CONFIG.replaced(exactness="approximate"))
    budget.states_first(EvictParams(mamba_num=2))
    assert core.freed == [1, 2]     # "approximate": every state may go, least recently used first


def test_a_kv_shortfall_frees_states_only_while_their_bytes_can_reach_the_kv_side():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    budget, cache, core = _budget_on_chain([2, 3, 1, 4])
    result, rest = budget.states_first(EvictParams(num_tokens=10))
    assert core.freed == [2] and cache.targets == [{MAMBA: (ComponentType.FULL, 10)}]
    assert rest == EvictParams(num_tokens=4) and cache.recorded == [("kv", 1)]   # 6 of the 10 tokens
    budget, cache, core = _budget_on_chain([2, 3, 1, 4], blocked=True)   # a transfer holds the pages
    result, rest = budget.states_first(EvictParams(num_tokens=10))
    assert result.mamba_num_evicted == 0 and rest == EvictParams(num_tokens=10)
    assert core.freed == [] and cache.targets == []


def test_both_shortfalls_at_once_free_for_the_states_then_for_the_kv():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    budget, cache, core = _budget_on_chain([2, 3, 1, 4], CONFIG.replaced(exactness="approximate"))
    result, rest = budget.states_first(EvictParams(num_tokens=4, mamba_num=1))
    assert core.freed == [2, 3] and cache.recorded == [("state", 1), ("kv", 1)]
    assert rest == EvictParams(num_tokens=0, mamba_num=0)


def test_a_gated_step_asks_only_the_least_recently_used_states_up_to_its_limit():
    from sglang_ext.tail_replay.state_order import first_unlocked_state

    core = FakeCore()
    nodes = _chain(core, [True, True, True, True])
    lru = core.lru_lists[MAMBA]
    asked = []

    def last_only(node):
        asked.append(node.id)
        return node.id == 4

    assert first_unlocked_state(lru, MAMBA, last_only, limit=2) is None and asked == [1, 2]
    nodes[0].component_data[MAMBA].lock_ref = 1            # a locked state is not counted
    asked.clear()
    assert first_unlocked_state(lru, MAMBA, last_only, limit=3) is nodes[3] and asked == [2, 3, 4]
    assert first_unlocked_state(lru, MAMBA, last_only) is nodes[3]


def test_a_gated_walk_starts_no_order_so_the_stock_shadow_sees_no_walk():
    """The byte budget's walk asks to free every evictable state (its gate and target stop it): if
    the config order were started with that count, `stock_last` would drop its whole shadow of
    stock's states (`stock_shortfall`)."""
    core = FakeCore()
    _chain(core, [True, True, True, True])
    walk = _walk(core, CONFIG.replaced(state_order="lru"))
    calls = []
    walk._config_order = SimpleNamespace(start=lambda n: calls.append(("start", n)), end=lambda: calls.append("end"),
                                         next_victim=lambda: None)
    with walk.gated(lambda node: node.id == 2):
        assert _evict(walk, 4) == [2]
    assert calls == [] and walk.walk_order is None
    _evict(walk, 1)
    assert calls == [("start", 1), "end"]


def test_byte_budget_is_a_server_setting_checked_by_type_and_refused_from_a_request():
    from sglang_ext.tail_replay.config import TailReplayConfigError, config_from_dict
    from sglang_ext.tail_replay.request_fields import check_request

    assert config_from_dict({}).server.byte_budget is True
    assert config_from_dict({"byte_budget": False}).server.byte_budget is False
    with pytest.raises(TailReplayConfigError, match="'byte_budget'.*wrong type"):
        config_from_dict({"byte_budget": 1})
    with pytest.raises(TailReplayConfigError, match="'byte_budget'"):
        check_request(config_from_dict({}), {"tail_replay": {"byte_budget": False}})


def test_a_kv_shortfall_takes_the_kv_past_the_states_before_any_state():
    """Under the exact modes the stateless leaves past a request's last state serve no exact hit
    (`kv_past_state.to_eviction_front` demotes them): a KV shortfall takes them first, and only
    them, before any state goes; what is still short goes on to the states, then to stock."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from sglang_ext.tail_replay.kv_past_state import DEMOTION

    class Leaf:   # hashable, as SGLang's tree nodes
        def __init__(self, tokens: int, last_access_time: int) -> None:
            self.key, self.last_access_time = [0] * tokens, last_access_time

    budget, cache, core = _budget_on_chain([2, 3, 1, 4])
    tails = [Leaf(3, 7 - DEMOTION), Leaf(5, 9 - DEMOTION)]
    live = Leaf(8, 1)       # a leaf an exact hit may read
    cache.tree_core.evictable_device_leaves = {*tails, live}
    result, rest = budget.states_first(EvictParams(num_tokens=4))
    assert cache.tree_core.evictable_device_leaves == {live} and core.freed == []
    assert result.num_tokens_evicted == 8 and rest == EvictParams(num_tokens=0)
    assert cache.targets == [{ComponentType.FULL: (ComponentType.FULL, 4)}]
    budget, cache, core = _budget_on_chain([2, 3, 1, 4])
    cache.tree_core.evictable_device_leaves = {tails[0], live}
    result, rest = budget.states_first(EvictParams(num_tokens=10))
    # the 3 demoted tokens, then node 2's state (6 tokens' bytes); the live leaf is stock's to take
    assert cache.tree_core.evictable_device_leaves == {live} and core.freed == [2]
    assert result.num_tokens_evicted == 3 and rest == EvictParams(num_tokens=1)
    # under a policy that does not take demoted leaves first (here `mru`), this pass leaves the KV
    # to that policy: the states go as before
    from sglang.srt.mem_cache.evict_policy import MRUStrategy

    budget, cache, core = _budget_on_chain([2, 3, 1, 4])
    cache.tree_core.evictable_device_leaves = {tails[0], live}
    cache.tree_core.eviction_strategy = MRUStrategy()
    result, rest = budget.states_first(EvictParams(num_tokens=10))
    assert cache.tree_core.evictable_device_leaves == {tails[0], live} and core.freed == [2]
    assert result.num_tokens_evicted == 0 and rest == EvictParams(num_tokens=4)

