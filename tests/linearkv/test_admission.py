"""LinearKV at admission: a round's state slots are budgeted for every request it
admits, LinearKV loads (their state and ping-pong slots, and the chunk states their read locks keep
out of the pool) included, so SGLang's `alloc_req_slots` after the round always finds the slots it
asserts on. Runs the adapter's own budget code (`assembly.ChunkAssembly`) and the admission seam
(`patches/linearkv/admission.py`) around a stand-in PrefillAdder over a stand-in state pool."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from sglang.srt.managers.schedule_policy import AddReqResult

from sglang_ext.linearkv.admission import RoundBudget, round_slots
from sglang_ext.linearkv.assembly import ChunkAssembly
from sglang_ext.patches.linearkv.admission import _wrap_add_one_req, _wrap_init

TRACKING = 2   # extra_buffer: two ping-pong slots per request


class Pool:
    """A LinearKV cache as the admission part sees it: a state pool of `free` slots, tree states
    (chunk nodes) evictable unless locked; its admission hooks delegate to the part, as
    `LinearKVRadixCache`'s do."""

    enable_mamba_extra_buffer = True

    def __init__(self, free: int, states: list[str]):
        self.free, self.states, self.locked = free, set(states), Counter()
        allocator = SimpleNamespace(schedulable_available_size=lambda: self.free)
        self.req_to_token_pool = SimpleNamespace(mamba_allocator=allocator, mamba_initial_tracking_slots=TRACKING)
        self.assembly = ChunkAssembly(self)

    @property
    def admission(self):
        return self.assembly.admission

    def open_admission_round(self, adder):
        return self.assembly.open_admission_round(adder)

    def round_slots_of(self, req) -> int:
        return self.assembly.round_slots_of(req)

    def mamba_evictable_size(self) -> int:
        return sum(1 for s in self.states if not self.locked[s])

    def lock(self, node):
        self.locked[node] += 1
        return node

    def unlock(self, lock) -> None:
        self.locked[lock] -= 1


class Adder:
    """SGLang's PrefillAdder as far as the seam sees it: admits every request it is given; a
    LinearKV request's load (`chunks`) runs inside its admission, as `init_load_back` does.
    `rem_mamba_slots`: SGLang's own budget (unified pool), which it debits a request's own state
    slot from when the request held none."""

    def __init__(self, tree_cache, rem_mamba_slots=None):
        self.tree_cache, self.rem_mamba_slots, self.can_run_list = tree_cache, rem_mamba_slots, []
        self.held: dict[str, int] = {}

    def add_one_req(self, req, has_chunked_req=False, truncation_align_size=None):
        if self.rem_mamba_slots is not None and not req.kv.holds_mamba:
            self.rem_mamba_slots -= 1
        if req.chunks:
            got = self.tree_cache.assembly.lock_sources(req, req.chunks, list(range(len(req.chunks))))
            if got is not None:
                if self.tree_cache.admission is not None:
                    self.tree_cache.admission.debit(got[1])
                self.held[req.rid] = got[1]
        self.can_run_list.append(req)
        return AddReqResult.CONTINUE


class SeamAdder(Adder):
    pass


SeamAdder.__init__ = _wrap_init(Adder.__init__)
SeamAdder.add_one_req = _wrap_add_one_req(Adder.add_one_req)


def _req(rid: str, chunks=(), holds=False, session=None):
    return SimpleNamespace(rid=rid, chunks=list(chunks), session=session,
                           kv=SimpleNamespace(holds_mamba=holds, mamba_ping_pong_track_buffer=None))


def _taken(adder) -> int:
    """State slots the round's admitted requests take (own + ping-pong) plus the states their
    loads keep locked: what `alloc_req_slots` needs from free slots and evictable states."""
    return sum(1 + TRACKING for _ in adder.can_run_list) + sum(adder.held.values())


def test_a_round_that_fills_stops_before_the_pool_is_exhausted():
    """6 free slots, 4 evictable chunk states: a plain request (3), a LinearKV load whose read
    locks keep the 4 chunk states (3 + 4) fill the round; the next plain request is not admitted
    (without the budget it was, and the round needed 13 of the pool's 10: SGLang's assert)."""
    pool = Pool(free=6, states=["c1", "c2", "c3", "c4"])
    adder = SeamAdder(pool)
    budget = pool.admission
    assert budget.adder is adder and budget.remaining == 10
    assert adder.add_one_req(_req("plain-a")) == AddReqResult.CONTINUE
    assert adder.add_one_req(_req("linearkv", chunks=["c1", "c2", "c3", "c4"])) == AddReqResult.CONTINUE
    assert adder.held == {"linearkv": 4} and budget.remaining == 0
    assert adder.add_one_req(_req("plain-b")) == AddReqResult.NO_TOKEN
    assert [r.rid for r in adder.can_run_list] == ["plain-a", "linearkv"]
    assert budget.debited == _taken(adder) == 10 <= 6 + 4

    unbudgeted = Adder(Pool(free=6, states=["c1", "c2", "c3", "c4"]))
    for req in (_req("plain-a"), _req("linearkv", chunks=["c1", "c2", "c3", "c4"]), _req("plain-b")):
        unbudgeted.add_one_req(req)
    assert _taken(unbudgeted) == 13 > 10   # what the seam prevents


def test_a_load_whose_held_states_do_not_fit_is_declined_and_unlocked():
    pool = Pool(free=8, states=["c1", "c2", "c3"])
    adder = SeamAdder(pool)   # 11 slots
    for rid in ("a", "b"):
        adder.add_one_req(_req(rid))
    assert pool.admission.remaining == 5
    # its own 3 slots fit, its 3 held states do not: served as a plain prefill, nothing locked
    assert adder.add_one_req(_req("linearkv", chunks=["c1", "c2", "c3"])) == AddReqResult.CONTINUE
    assert adder.held == {} and not +pool.locked and pool.admission.remaining == 2
    assert pool.admission.debited == _taken(adder) == 9


def test_a_state_already_locked_costs_nothing_more():
    pool = Pool(free=6, states=["c1", "c2"])
    pool.locked["c1"] = 1   # a running request holds it already: not evictable, not in the budget
    adder = SeamAdder(pool)
    assert pool.admission.remaining == 7
    adder.add_one_req(_req("linearkv", chunks=["c1", "c2", "c2"]))   # a chunk twice: one state
    assert adder.held == {"linearkv": 1} and pool.admission.remaining == 3


def test_sglangs_own_budget_is_the_counter_where_it_keeps_one():
    """Unified memory pool: SGLang's `rem_mamba_slots` is the round's budget; SGLang debits a
    request's own slot, the seam its ping-pong slots and a load's held states."""
    pool = Pool(free=100, states=["c1", "c2"])
    adder = SeamAdder(pool, rem_mamba_slots=9)
    assert pool.admission.sglang_keeps and pool.admission.remaining == 9
    adder.add_one_req(_req("a"))
    assert adder.rem_mamba_slots == 6
    adder.add_one_req(_req("linearkv", chunks=["c1", "c2"]))
    assert adder.rem_mamba_slots == 1 and adder.held == {"linearkv": 2}
    assert adder.add_one_req(_req("b")) == AddReqResult.NO_TOKEN and adder.rem_mamba_slots == 1


def test_other_backends_and_stale_rounds_pass_untouched():
    plain_cache = SimpleNamespace()   # not LinearKV's: no budget
    adder = SeamAdder(plain_cache)
    for i in range(5):
        assert adder.add_one_req(_req(str(i))) == AddReqResult.CONTINUE
    pool = Pool(free=3, states=[])
    first = SeamAdder(pool)
    other = Adder(pool)   # an adder whose round the cache did not open (its budget is first's)
    first.add_one_req(_req("a"))
    assert other.add_one_req(_req("b")) == AddReqResult.CONTINUE and first.add_one_req(_req("c")) == AddReqResult.NO_TOKEN


@pytest.mark.parametrize(("holds", "session", "tracking", "slots"), [
    (False, False, 2, 3), (True, False, 2, 3), (True, True, 0, 0), (False, True, 0, 1), (True, False, 0, 1)])
def test_round_slots(holds, session, tracking, slots):
    """A slot taken at this round's match counts (the round began before it); one a streaming
    session held before the round does not."""
    assert round_slots(holds, session, tracking) == slots


def test_round_budget_counter():
    budget = RoundBudget(SimpleNamespace(rem_mamba_slots=None), 4)
    assert budget.fits(4) and not budget.fits(5)
    budget.debit(3)
    budget.debit(0)
    assert budget.remaining == 1 and budget.debited == 3
    assert budget.counted_by_sglang(own_slot_free=True) == 0
    assert RoundBudget(SimpleNamespace(rem_mamba_slots=2), 2).counted_by_sglang(own_slot_free=True) == 1
