"""The default state eviction order never lets Tail-Replay's own states displace an exact state
stock SGLang still holds.

The model: stock SGLang (its own `UnifiedRadixCache` with its own `MambaComponent`, state LRU
and leaf eviction) and Tail-Replay (`TailReplayRadixCache`, the server's default config but for
small replay limits) on the kit's real pools, the same number of state slots, a KV pool large
enough that only state pressure evicts, driven by the same requests one at a time (admit with
the state copy-on-write, lock, the scheduler's state reclaim, row + KV, decode, finish).

The property, checked after every request: an exact state Tail-Replay drops in a step is not
held by stock after that step. (An approximate state cannot be held by stock: where
Tail-Replay's default replays approximately, stock missed and computed the same position
exactly; that exact state is out of reach of any eviction order, see docs/tail_replay.md.)
Under SGLang's LRU order ("lru") the property fails on such sequences (the approximate states
take slots stock gives to its exact ones); under the default order it holds.

Unit tests below pin the order itself with exact slot ids.
"""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from array import array  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocation import ensure_mamba_capacity  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as kit  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402

from sglang_ext.hooks import add_state_order  # noqa: E402
from sglang_ext.tail_replay.cache import TailReplayMambaComponent, TailReplayRadixCache, provenance_of  # noqa: E402
from sglang_ext.tail_replay.config import BACKGROUND_PARAM_KEY, REQUEST_PARAM_KEY, TailReplayConfig  # noqa: E402
from sglang_ext.tail_replay.planner import HitKind  # noqa: E402
from sglang_ext.tail_replay.provenance import bounds as provenance  # noqa: E402
from sglang_ext.tail_replay.repair import repair_overrides  # noqa: E402
from sglang_ext.tail_replay.request import plan_of, record_of  # noqa: E402
from sglang_ext.tail_replay.request_fields import background_mark  # noqa: E402
from sglang_ext.tail_replay.state_order import (  # noqa: E402
    GoesFirstOrder,
    StockStateShadow,
    is_approximate,
    register_orders,
    resolved_order,
    stock_shortfall,
)
from tests.tail_replay.tree_walk import assert_slots_accounted, tree_nodes  # noqa: E402

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA
#: the server defaults (`exactness: "exact_first"`, `state_order: "auto"`) with small replay limits
CONFIG = TailReplayConfig.of(budget=0.1, min_replay_tokens=4, max_replay_tokens=64, min_match_tokens=8)


class Server:
    """One cache on the kit's pools (Tail-Replay's, or stock SGLang's when `config` is None) and
    a scheduler serving one request at a time."""

    def __init__(self, config: TailReplayConfig | None, *, mamba_size: int, kv_size: int = 2048):
        cfg = CacheConfig(page_size=1, components=(FULL, MAMBA), kv_size=kv_size, mamba_cache_size=mamba_size,
                          max_num_reqs=3, max_context_len=512, num_layers=2, full_attention_layer_ids=(1,),
                          head_num=1, head_dim=8, mamba_intermediate_size=32, mamba_num_heads=2,
                          mamba_head_dim=16, mamba_state_size=4)
        self.config = config
        if config is None:
            self.cache, self.alloc, self.pool = kit.build_fixture(cfg)
        else:
            cache_class = type("TailReplayRadixCache", (TailReplayRadixCache,), {"tail_replay_config": config})
            with mock.patch.object(kit, "UnifiedRadixCache", cache_class):
                self.cache, self.alloc, self.pool = kit.build_fixture(
                    cfg, component_registry_override={MAMBA: TailReplayMambaComponent})
        self.kv_total, self.mamba_total = kv_size, mamba_size
        self.rid = 0

    def run(self, tokens: list[int], output: list[int] = (), overrides: dict | None = None,
            background: dict | None = None, branch: int | None = None) -> Req:
        """Serve one request; `background`: the server's mark on its own background run
        (`BACKGROUND_PARAM_KEY`); `branch`: the branch point the request's match found (as
        `_note_shared_repair` records it under the extra buffer, which this kit does not run; its
        repair ask has left with the first output by the time the request inserts)."""
        self.rid += 1
        custom = {REQUEST_PARAM_KEY: overrides} if overrides is not None else {}
        if background is not None:
            custom[BACKGROUND_PARAM_KEY] = background
        req = Req(rid=f"r{self.rid}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=8, custom_params=custom or None))
        req.init_next_round_input(self.cache)
        if branch is not None:
            record_of(req).stock_branch_depth = branch
        req.lock = self.cache.lock(req.last_node)
        assert ensure_mamba_capacity(self.pool, [req], self.cache)   # the scheduler's state reclaim
        assert self.pool.alloc([req]) is not None
        prefix = self.cache.prefix_device_indices(req) if req.prefix_len else torch.empty(0, dtype=torch.int64)
        new = self.alloc.alloc(len(tokens) - req.prefix_len + len(output))
        assert new is not None, "the KV pool is sized so that only state pressure evicts"
        row = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        self.pool.write((req.kv.req_pool_idx, slice(0, len(row))), row.to(torch.int32))
        req.output_ids.extend(output)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(row)
        req.extend_end = len(tokens)
        req.finished_reason = FINISH_LENGTH(length=len(output))
        release_kv_cache(req, self.cache, checkpoint=True)
        assert_slots_accounted(self.cache, self.pool, self.alloc, [], self.kv_total, self.mamba_total)
        self.cache.sanity_check()
        return req

    def states(self) -> dict[tuple[int, ...], bool]:
        """{the token path to a held state: whether it counts exact} (stock's are all exact)."""
        out = {}
        for node, _ in tree_nodes(self.cache):
            if node.component_data[MAMBA].value is None:
                continue
            path, n = [], node
            while n is not self.cache.tree_core.root_node:
                path[:0] = list(n.key.token_ids)
                n = n.parent
            prov = provenance_of(node) if self.config is not None else None
            out[tuple(path)] = prov is None or provenance.counts_exact(prov.state, self.config.threshold)
        return out


STEMS = [list(range(1000 * (i + 1), 1000 * (i + 1) + 40)) for i in range(3)]
#: a request: a stem's prefix plus new tokens, or (None) a follow-up of an earlier request
requests = st.tuples(st.sampled_from([0, 1, 2, None]), st.integers(0, 40), st.integers(1, 12),
                     st.integers(0, 3), st.integers(0, 2**16))


def served_pairs(order: str, script, mamba_size: int, exactness: str = "exact_first") -> list[str]:
    """Serve `script` on stock and on Tail-Replay (state order `order`); the violations, one line
    each (empty: none after any request):

    - Tail-Replay dropped, in a step, an exact state stock still holds after it (but one, in a
      step whose request resumed deeper than stock: it holds the state it resumed from locked,
      and when that is one stock let go and nothing else can be freed, one of stock's goes);
    - stock resumed a request from an exact state that Tail-Replay held, exact, before the request,
      and Tail-Replay did not resume from an exact state at least as deep."""
    stock = Server(None, mamba_size=mamba_size)
    tr = Server(CONFIG.replaced(state_order=order, exactness=exactness), mamba_size=mamba_size)
    history: list[list[int]] = []
    violations = []
    for step, (stem, cut, new, out, salt) in enumerate(script):
        base = history[salt % len(history)] if stem is None and history else STEMS[stem or 0][:cut]
        tokens = base + [50_000 + salt * 16 + i for i in range(new)]
        output = [60_000 + salt * 4 + i for i in range(out)]
        if len(tokens) + len(output) > 400:
            continue
        before = tr.states()
        ours, theirs = tr.run(tokens, output), stock.run(tokens, output)
        history.append(tokens + output)
        held, after = stock.states(), tr.states()
        plan = plan_of(ours)
        dropped = [len(path) for path, exact in before.items() if exact and path not in after and path in held]
        # the one trade allowed: the request resumed deeper than stock, from a state stock let go,
        # which it holds locked while it runs; with nothing else to free, one of stock's goes
        traded = plan.kind is HitKind.EXACT_CHECKPOINT and ours.prefix_len > theirs.prefix_len and len(dropped) == 1
        if dropped and not traded:
            violations.append(f"step {step}: dropped the exact states at depths {dropped} stock still holds")
        if theirs.prefix_len and before.get(tuple(tokens[:theirs.prefix_len])) is True and not (
                plan.kind is HitKind.EXACT_CHECKPOINT and plan.prefix_len >= theirs.prefix_len):
            violations.append(f"step {step}: stock resumed exactly at {theirs.prefix_len}, "
                              f"Tail-Replay {plan.kind.value} at {plan.prefix_len}")
    return violations


MODEL_SETTINGS = settings(max_examples=int(os.environ.get("TAIL_REPLAY_EXAMPLES", "40")), deadline=None,
                          derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@MODEL_SETTINGS
@given(script=st.lists(requests, min_size=4, max_size=24), mamba_size=st.integers(4, 6),
       exactness=st.sampled_from(["exact_first", "exact"]))
def test_the_default_order_never_drops_an_exact_state_stock_still_holds(script, mamba_size, exactness):
    assert served_pairs("auto", script, mamba_size, exactness) == []


@pytest.mark.parametrize("order", ["auto", "lru", "ends", "approximate_first"])
def test_no_order_gives_back_stocks_exact_state_where_tail_replay_replayed_approximately(order):
    """Where the default replays approximately (no exact state on the path: stock misses and
    computes the same position exactly), the next turn resumes from stock's exact state on stock
    and from the approximate one here, whatever the order and with slots to spare: only a repair
    (an exact recomputation) can give that state back."""
    stock, tr = Server(None, mamba_size=8), Server(CONFIG.replaced(state_order=order), mamba_size=8)
    turn = STEMS[0][:20] + list(range(7000, 7008))
    for tokens in (STEMS[0], turn):
        stock.run(tokens)
        tr.run(tokens)
    assert tr.states()[tuple(turn)] is False and tuple(turn) in stock.states()
    theirs, ours = stock.run(turn + [9000, 9001]), tr.run(turn + [9000, 9001])
    assert theirs.prefix_len == len(turn)                                   # stock: its exact state
    assert plan_of(ours).kind is HitKind.APPROXIMATE_CHECKPOINT and ours.prefix_len == len(turn)


def _exact_first(site):
    """A wrong order: exact states before approximate ones."""
    return GoesFirstOrder(site.tree_core, site.component_type,
                          lambda node: not is_approximate(node, site.config().threshold))


def test_the_model_catches_an_order_that_puts_exact_states_first():
    """The property is not vacuous: a (wrong) order that frees exact states before approximate
    ones drops exact states stock still holds, on a short script."""
    script = [(0, 40, 4, 0, 1), (0, 20, 8, 0, 2), (1, 40, 4, 0, 3), (2, 40, 4, 0, 4), (1, 20, 8, 0, 5),
              (2, 20, 8, 0, 6)]
    add_state_order("approximate_first", _exact_first)   # the registered order, replaced
    try:
        assert served_pairs("approximate_first", script, 4) != []
    finally:
        register_orders()
    assert served_pairs("auto", script, 4) == []


# ---------------------------------------------------------------- the order, exact ids


@pytest.mark.parametrize(("exactness", "order"), [("exact_first", "stock_last"), ("exact", "stock_last"),
                                                   ("approximate", "lru")])
def test_auto_resolves_by_the_servers_exactness(exactness, order):
    assert resolved_order(CONFIG.replaced(exactness=exactness)) == order
    assert resolved_order(CONFIG.replaced(exactness=exactness, state_order="ends")) == "ends"
    assert TailReplayConfig().server.state_order == "auto"


@pytest.mark.parametrize("exactness", ["exact_first", "approximate"])
def test_the_default_frees_the_approximate_state_before_the_least_recently_used_exact_one(exactness):
    """Four state slots, the default order: A's exact state at 40 (slot 1, least recently used),
    an approximate end state at 28 (a replay of A's first 20 tokens), B's and C's exact states.
    D needs a slot: under "exact_first" the approximate state goes (A's next turn resumes exactly
    from 40, as on stock); under "approximate" SGLang's LRU order frees A's state."""
    tr = Server(CONFIG.replaced(exactness=exactness), mamba_size=4)
    a = STEMS[0]
    tr.run(a)
    replay = tr.run(a[:20] + list(range(7000, 7008)))
    assert plan_of(replay).kind is HitKind.APPROXIMATE
    tr.run(STEMS[1])

    def held() -> dict[int, tuple[int, bool]]:   # state slot -> (depth, exact)
        return {int(n.component_data[MAMBA].value.item()): (d, provenance_of(n) is None)
                for n, d in tree_nodes(tr.cache) if n.component_data[MAMBA].value is not None}

    assert held() == {1: (40, True), 2: (28, False), 3: (40, True)}
    tr.run(STEMS[2])                       # the fourth slot: no eviction yet
    tr.run(list(range(8000, 8040)))        # D takes the slot of the state that goes
    taken = 2 if exactness == "exact_first" else 1
    assert held() == {1: (40, True), 2: (28, False), 3: (40, True), 4: (40, True)} | {taken: (40, True)}
    gone = tuple(a[:20] + list(range(7000, 7008))) if exactness == "exact_first" else tuple(a)
    assert gone not in tr.states()
    nxt = tr.run(a + [9000])
    assert plan_of(nxt).kind is (HitKind.EXACT_CHECKPOINT if exactness == "exact_first" else HitKind.APPROXIMATE)


@pytest.mark.parametrize("order", ["auto", "approximate_first", "lru"])
def test_an_exact_state_stock_let_go_goes_before_one_stock_holds(order):
    """Four slots. Stock frees the conversation's state at 40 (its least recently used) while
    Tail-Replay frees an approximate one instead and keeps it. The next turn through 40 resumes
    there on Tail-Replay and touches it; stock resumes from 20 and touches that. Under
    "approximate_first" the state at 20 then ages here as if unused and goes at the next pressure
    while stock still holds it, and the turn after, branching at 20, replays approximately where
    stock resumes exactly. The default frees the state at 40 first (stock let it go) and keeps
    stock's order for the rest."""
    stock, tr = Server(None, mamba_size=4), Server(CONFIG.replaced(state_order=order), mamba_size=4)
    s0, s1, s2 = STEMS

    def serve(tokens):
        before = tr.states()
        theirs, ours = stock.run(tokens), tr.run(tokens)
        dropped = [len(p) for p, exact in before.items() if exact and p not in tr.states() and p in stock.states()]
        return theirs, ours, dropped

    for tokens in (s0[:20], s0[:40], s1[:40], s1[:20] + list(range(7100, 7108)), s0[:20] + list(range(7000, 7004))):
        serve(tokens)
    theirs, ours, _ = serve(s0[:40] + list(range(7200, 7204)))
    # Tail-Replay kept the state at 40 (SGLang's LRU order frees it as stock does)
    assert (theirs.prefix_len, ours.prefix_len) == (20, 20 if order == "lru" else 40)
    _, _, dropped = serve(s2[:40])
    theirs, ours, _ = serve(s0[:20] + list(range(7300, 7304)))
    assert theirs.prefix_len == 20
    if order == "approximate_first":
        assert dropped == [20] and plan_of(ours).kind is HitKind.APPROXIMATE
    else:
        assert dropped == [] and plan_of(ours).kind is HitKind.EXACT_CHECKPOINT and ours.prefix_len == 20


def test_the_shadow_holds_no_more_nodes_than_the_pool_has_slots():
    """KV pressure frees states without a state eviction step (the shadow does not follow it):
    the shadow still keeps at most as many nodes as stock's pool has slots, least recently used
    going first."""
    from types import SimpleNamespace

    shadow = StockStateShadow(3)
    nodes = [SimpleNamespace(id=i) for i in range(5)]
    for node in nodes:
        shadow.touch(node)
    assert [n.id for n in shadow.in_order()] == [2, 3, 4]
    shadow.touch_deepest([nodes[0], nodes[3], nodes[1]])     # the deepest node stock holds: 3
    assert [n.id for n in shadow.in_order()] == [2, 4, 3]
    shadow.evict()
    assert [n.id for n in shadow.in_order()] == [4, 3]
    shadow.evict(5)
    assert shadow.in_order() == [] and len(shadow) == 0


@pytest.mark.parametrize(("request_cnt", "held", "stock_held", "stock_frees"), [
    (1, 4, 4, 1),    # both trees hold the same states: stock is short as many slots
    (1, 5, 4, 0),    # Tail-Replay holds a state stock does not (its approximate one): stock has a slot free
    (3, 6, 4, 1),
    (1, 3, 4, 2),    # stock still holds a state Tail-Replay let go: stock is short one more
])
def test_an_eviction_walk_frees_as_many_of_stocks_states_as_stock_is_short_of(request_cnt, held, stock_held,
                                                                             stock_frees):
    assert stock_shortfall(request_cnt, held, stock_held) == stock_frees


def _shadow_depths(tr: Server) -> list[int]:
    def depth(node) -> int:
        total = 0
        while node is not tr.cache.tree_core.root_node:
            total, node = total + len(node.key), node.parent
        return total

    return sorted(depth(node) for node in tr.cache.components[MAMBA].states.config_order.shadow.in_order())


def test_a_shared_state_repair_holds_stocks_branch_state_in_the_shadow():
    """Where the default replays approximately at a branch (the branch rule, under the extra
    buffer), stock's miss kept its exact state at the branch point, not at the approximate
    request's end: the shadow counts the shared-state repair run's exact state there as stock's
    and the approximate one not. (Before, the repair's state was nobody's in the shadow and went
    first under the next state pressure, while stock still held it: the agentic replay's lost
    exact hits at 192.) A request that branched nowhere keeps its approximate state in the
    shadow's count: stock computed a state at the same depth."""
    tr = Server(CONFIG, mamba_size=8)
    tr.run(STEMS[0])
    branching = tr.run(STEMS[0][:20] + list(range(7000, 7008)), branch=16)
    assert plan_of(branching).kind is HitKind.APPROXIMATE and record_of(branching).shared_repair is None
    assert _shadow_depths(tr) == [40]
    repair = tr.run(STEMS[0][:16], background=background_mark(repair_overrides("r2", "shared_state")))
    assert plan_of(repair).state_is_exact
    assert _shadow_depths(tr) == [16, 40]
    other = tr.run(STEMS[1][:20] + list(range(7100, 7108)))   # no state on its path: a miss, exact
    tr.run(STEMS[1][:20] + list(range(7200, 7208)))           # approximate, branched nowhere
    assert plan_of(other).kind is HitKind.MISS
    assert _shadow_depths(tr) == [16, 28, 28, 40]


def test_a_flushed_tree_forgets_the_stock_shadow_and_the_sessions_provenance():
    """`/flush_cache` (SGLang's full reset) rebuilds the tree and the session slots: the stock
    shadow (its nodes are gone; stock's tree would be empty) and the streaming sessions'
    provenance (a stale entry would label a new slot of the same session id) go too."""
    tr = Server(CONFIG, mamba_size=8)
    tr.run(STEMS[0])
    assert _shadow_depths(tr) == [40]
    tr.cache.session_provenance()["s"] = object()
    tr.cache.reset()   # as the scheduler's flush does, with its pools
    tr.pool.clear()
    tr.alloc.clear()
    assert tr.cache.session_provenance() == {}
    assert tr.cache.components[MAMBA].states.config_order.shadow.in_order() == []
    tr.run(STEMS[0])
    assert _shadow_depths(tr) == [40]
