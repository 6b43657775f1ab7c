"""Provenance core (pure): the carried bound's arithmetic, node splits, the path summary, and the
planner's use of it (exact mode, approximate checkpoints)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_ext.tail_replay.config import TailReplayConfig, TailReplayConfigError, config_from_dict
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan, plan_replay
from sglang_ext.tail_replay.provenance.bounds import (
    TAINT,
    UNKNOWN,
    CarryBound,
    NodeProvenance,
    carried_bounds,
    carry_segments,
    counts_exact,
    path_provenance,
)
from sglang_ext.tail_replay.request_fields import with_overrides

CFG = TailReplayConfig.of(budget=0.1, min_replay_tokens=4, max_replay_tokens=64, min_match_tokens=8)


def test_carried_bound_is_the_product_of_decays_per_head_max_over_heads_and_layers():
    # a replay from position 10 (bound 1 there), two layers, two heads
    carry = CarryBound(start=10)
    carry.add_rows(0, 10, torch.tensor([[-1.0, -0.2]] * 3))
    carry.add_rows(1, 10, torch.tensor([[-0.1, -0.3]] * 3))
    bounds = carried_bounds(carry, 10, 13, 0.0)
    # after t tokens: max(exp(-0.2 t), exp(-0.1 t)) = exp(-0.1 t)
    torch.testing.assert_close(bounds, torch.tensor([math.exp(-0.1 * t) for t in (1, 2, 3)], dtype=torch.float32))
    assert carry.complete()


def test_chunks_continue_the_running_sum_and_decode_keeps_the_last_rows_bound():
    carry = CarryBound(start=0, base_log=math.log(0.5))   # a checkpoint of bound 0.5
    carry.add_rows(0, 0, torch.full((2, 1), -1.0))
    carry.add_rows(0, 2, torch.full((2, 1), -1.0))        # the next prefill chunk
    bounds = carried_bounds(carry, 0, 6, 0.0)             # positions 4, 5: decode tokens
    expected = [0.5 * math.exp(-t) for t in (1, 2, 3, 4, 4, 4)]
    torch.testing.assert_close(bounds, torch.tensor(expected, dtype=torch.float32))


def test_the_memoized_bounds_follow_every_change_of_the_carry():
    """`carried_bounds` memoizes the filled bounds on the carry: a shorter or longer span, a new
    chunk, a second layer's rows over the same chunk and another floor each answer what a fresh
    carry with the same rows answers."""
    def fresh(steps):
        carry = CarryBound(start=2, base_log=math.log(0.5))
        for layer, position, decay in steps:
            carry.add_rows(layer, position, torch.full((2, 1), decay))
        return carry

    steps = [(0, 2, -1.0)]
    carry = fresh(steps)
    for start, end, floor in [(0, 8, 0.0), (3, 5, 0.0), (0, 12, TAINT), (0, 4, 0.0)]:
        assert torch.equal(carried_bounds(carry, start, end, floor), carried_bounds(fresh(steps), start, end, floor))
    for step in [(0, 4, -0.5), (1, 2, -0.25), (1, 4, -3.0)]:   # another chunk; layer 1 over both
        carry.add_rows(step[0], step[1], torch.full((2, 1), step[2]))
        steps.append(step)
        for start, end in [(0, 9), (2, 4), (5, 7)]:
            assert torch.equal(carried_bounds(carry, start, end, 0.0), carried_bounds(fresh(steps), start, end, 0.0))


def test_an_unseen_chunk_carries_the_last_seen_bound_and_later_chunks_keep_their_positions():
    carry = CarryBound(start=0)
    carry.add_rows(0, 0, torch.full((2, 1), -1.0))
    carry.add_rows(0, 4, torch.full((2, 1), -1.0))        # rows 2, 3 ran unseen (a CUDA graph)
    bounds = carried_bounds(carry, 0, 6, 0.0).tolist()
    # the later chunk's sum misses the unseen decays: larger than the truth, never smaller
    assert bounds == pytest.approx([math.exp(-1), math.exp(-2), math.exp(-2), math.exp(-2),
                                    math.exp(-3), math.exp(-4)], rel=1e-6)
    assert carried_bounds(CarryBound(start=0, base_log=math.log(0.25)), 0, 2, 0.0).tolist() == [0.25, 0.25]


def test_positions_before_the_carry_get_the_floor_and_an_incomplete_carry_is_unknown():
    carry = CarryBound(start=3)
    assert carried_bounds(carry, 0, 3, TAINT).tolist() == [TAINT] * 3
    assert carried_bounds(carry, 0, 5, TAINT).tolist() == [TAINT] * 3 + [UNKNOWN] * 2   # no rows seen: the start
    assert carried_bounds(None, 0, 2, 0.0).tolist() == [0.0, 0.0]
    # a layer that missed rows (an unhooked layer kind): the max over layers is unknown
    carry = CarryBound(start=0)
    carry.add_rows(0, 0, torch.full((3, 2), -1.0))
    carry.add_rows(1, 0, torch.full((2, 2), -1.0))
    assert not carry.complete()
    assert carried_bounds(carry, 0, 3, 0.0).tolist() == [UNKNOWN] * 3


def test_a_carried_position_is_never_strictly_exact_even_when_its_bound_underflows():
    carry = CarryBound(start=0)
    carry.add_rows(0, 0, torch.full((3, 1), -200.0))
    bounds = carried_bounds(carry, 0, 3, 0.0)
    assert (bounds > 0).all() and bool((bounds <= 1e-30).all())
    assert counts_exact(float(bounds[-1]), 1e-5) and not counts_exact(float(bounds[-1]), 0.0)


def test_carry_segments_index_the_rows_of_each_request_after_its_start():
    a, b = CarryBound(start=12), CarryBound(start=0)
    segments = carry_segments([a, None, b], prefix_lens=[10, 0, 4], extend_lens=[5, 3, 2])
    assert segments.rows.tolist() == [2, 3, 4, 8, 9] and segments.end == 10
    assert [p[1:] for p in segments.parts] == [(12, 0, 3), (4, 3, 2)]
    segments.accumulate(0, torch.full((5, 2), -1.0))
    assert [c[0] for c in a.chunks] == [12] and a.tokens == {0: 3} and b.tokens == {0: 2}
    assert carry_segments([None, CarryBound(start=50)], [0, 0], [4, 4]) is None


def test_node_split_keeps_each_halfs_tokens_and_the_state_with_the_rest():
    prov = NodeProvenance(torch.tensor([0.5, 0.4, 0.3, 0.2]), state=0.1)
    head, rest = prov.split(1)
    assert head.kv.tolist() == pytest.approx([0.5]) and head.state == 0.0
    assert rest.kv.tolist() == pytest.approx([0.4, 0.3, 0.2]) and rest.state == 0.1


def test_path_provenance_finds_the_first_inexact_token_and_states_deepest_first():
    path = [(4, None, True, "a"),                                     # exact, state at 4
            (3, NodeProvenance(torch.tensor([0.0, 0.2, 0.1]), 0.05), True, "b"),   # state at 7
            (2, NodeProvenance(None, 1e-7), True, "c")]               # exact KV, state at 9
    prov = path_provenance(path)
    assert prov.matched == 9 and prov.first_inexact == 5
    assert [s.depth for s in prov.states] == [9, 7, 4]
    assert prov.deepest_exact_state(1e-5, strict=False).node_id == "c"
    assert prov.deepest_exact_state(1e-5, strict=True).node_id == "a"   # 9 and 7 are past an inexact token
    assert prov.deepest_approximate_state(1e-5).node_id == "b"
    assert prov.read_floor(5) == 0.0 and prov.read_floor(6) == TAINT


def test_an_exact_replay_is_preferred_to_an_approximate_checkpoint():
    whole = CFG.replaced(budget=1.0, max_replay_tokens=4096)
    assert plan_replay(300, None, 1, whole, (280, 0.3)).kind is HitKind.EXACT_REPLAY


def test_planner_resumes_from_an_approximate_checkpoint_within_the_window():
    # L = 500, W = 50: an approximate state at 480 (the previous turn's end) is resumed from
    assert plan_replay(500, None, 1, CFG, (480, 0.3)) == ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 500, 480, 480)
    # outside the window: a fresh replay
    assert plan_replay(500, None, 1, CFG, (400, 0.3)).kind is HitKind.APPROXIMATE
    # an exact checkpoint within the window wins, and so does a deeper-or-equal exact one
    assert plan_replay(500, 470, 1, CFG, (480, 0.3)).kind is HitKind.EXACT_CHECKPOINT
    assert plan_replay(500, 490, 1, CFG, (480, 0.3)).kind is HitKind.EXACT_CHECKPOINT


def test_exact_mode_never_plans_an_approximation():
    strict = CFG.replaced(exactness="exact")
    assert plan_replay(500, None, 1, strict, (480, 0.3)) == ReplayPlan(HitKind.MISS, 500, 0, 0)
    assert plan_replay(500, 100, 1, strict) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 500, 100, 100)
    assert plan_replay(500, 460, 1, strict).kind is HitKind.EXACT_CHECKPOINT
    assert plan_replay(30, None, 1, strict.replaced(budget=1.0)).kind is HitKind.EXACT_REPLAY   # W >= L


def test_exact_first_takes_any_exact_checkpoint_and_approximates_only_without_one():
    first = CFG
    assert first.knobs.exactness == "exact_first" == TailReplayConfig().knobs.exactness   # the default
    approx = CFG.replaced(exactness="approximate")
    # an exact state far behind the match (stock SGLang's hit): resumed from, the rest recomputed,
    # where "approximate" replays the last W tokens approximately
    assert plan_replay(500, 100, 1, first) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 500, 100, 100)
    assert plan_replay(500, 100, 1, approx).kind is HitKind.APPROXIMATE
    # ... and wins over a deeper approximate state ("approximate" resumes from that one)
    assert plan_replay(500, 100, 1, first, (480, 0.3)).kind is HitKind.EXACT_CHECKPOINT
    assert plan_replay(500, 100, 1, approx, (480, 0.3)).kind is HitKind.APPROXIMATE_CHECKPOINT
    # no exact state on the path (where stock misses): approximate as by default
    assert plan_replay(500, None, 1, first, (480, 0.3)) == ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 500, 480, 480)
    assert plan_replay(500, None, 1, first) == ReplayPlan(HitKind.APPROXIMATE, 500, 450, 450)
    # a window that reaches the first token is an exact replay (it reuses the whole match's KV)
    assert plan_replay(60, None, 1, first.replaced(budget=1.0)) == ReplayPlan(HitKind.EXACT_REPLAY, 60, 0, 0)
    assert first.exact_first and not first.strict and first.threshold == CFG.server.exact_threshold
    assert config_from_dict({"exactness": "exact_first"}).exact_first


def test_exactness_keys_are_validated_and_the_threshold_is_the_servers():
    assert config_from_dict({"exactness": "exact"}).threshold == 0.0
    assert config_from_dict({"exact_threshold": 1e-3}).threshold == 1e-3
    with pytest.raises(TailReplayConfigError, match="'exactness': must be one of"):
        config_from_dict({"exactness": "maybe"})
    with pytest.raises(TailReplayConfigError, match="'exact_threshold': must be in"):
        config_from_dict({"exact_threshold": 2})
    with pytest.raises(TailReplayConfigError, match="'exact_threshold': is a server setting"):
        with_overrides(CFG, {"exact_threshold": 0.5})
    assert with_overrides(CFG, {"exactness": "exact"}).strict


# ---------------------------------------------------------------- fail closed


def _planned(carry=None, floor=0.0):
    from sglang_ext.tail_replay.request import TailReplayRequest

    record = TailReplayRequest(CFG)
    record.set_plan(ReplayPlan(HitKind.APPROXIMATE, 40, 30, 30), carry, floor)
    return record


def test_an_insert_by_a_planned_request_carries_its_bounds():
    from sglang_ext.tail_replay.provenance.writes import insert_bounds, state_bound

    record = _planned(CarryBound(start=30), floor=TAINT)
    bounds = insert_bounds(record, 28, 34, caching=True)
    assert bounds[:2].tolist() == [TAINT, TAINT] and bool((bounds[2:] == UNKNOWN).all())   # no gates seen
    assert state_bound(record, 34, caching=True) == UNKNOWN and state_bound(record, 0, caching=True) == 0.0
    assert insert_bounds(_planned(), 0, 3, caching=True).tolist() == [0.0] * 3            # an exact plan


def test_an_insert_of_unknown_provenance_is_untracked_never_exact():
    from sglang_ext.tail_replay.provenance.bounds import UNTRACKED
    from sglang_ext.tail_replay.provenance.writes import insert_bounds, state_bound, tracks
    from sglang_ext.tail_replay.request import TailReplayRequest

    dropped = _planned()
    dropped.drop_plan()                                   # LinearKV's assembly serves it instead
    unplanned = TailReplayRequest(CFG)                    # a record made at caching, never matched
    for record in (None, dropped, unplanned):
        assert not tracks(record)
        assert insert_bounds(record, 5, 9, caching=True).tolist() == [UNTRACKED] * 4
        assert state_bound(record, 9, caching=True) == UNTRACKED
        assert not counts_exact(UNTRACKED, CFG.server.exact_threshold) and not counts_exact(UNTRACKED, 0.0)
    # transferred KV (PD decode): whatever the request's own plan says
    assert insert_bounds(_planned(), 0, 2, caching=True, transferred=True).tolist() == [UNTRACKED] * 2
    # a state the request withheld that reaches the tree anyway
    withheld = _planned()
    withheld.withhold_state()
    assert state_bound(withheld, 9, caching=True) == UNTRACKED
    # no request caching (SGLang's storage prefetch: the storage tier holds strictly exact KV only)
    assert insert_bounds(None, 0, 2, caching=False).tolist() == [0.0, 0.0]


def test_untracked_kv_cuts_the_exact_mode_and_is_never_an_approximate_checkpoint():
    from sglang_ext.tail_replay.provenance.bounds import UNTRACKED

    prov = path_provenance([(16, None, False, 1), (24, NodeProvenance(torch.full((24,), UNTRACKED), UNTRACKED), True, 2)])
    assert prov.first_inexact == 16
    assert prov.deepest_exact_state(CFG.server.exact_threshold, strict=True) is None
    assert prov.deepest_exact_state(CFG.server.exact_threshold, strict=False) is None
    state = prov.deepest_approximate_state(CFG.server.exact_threshold)
    plan = plan_replay(40, None, 1, CFG, (state.depth, state.bound))
    assert plan.kind is not HitKind.APPROXIMATE_CHECKPOINT


# ---------------------------------------------------------------- streaming sessions


def _session(kv, reads_inexact=False):
    from sglang_ext.tail_replay.sessions import SessionProvenance

    return SessionProvenance(torch.tensor(kv, dtype=torch.float32), reads_inexact)


EXACT_FIRST = CFG.replaced(exactness="exact_first")
STRICT = CFG.replaced(exactness="exact")


def test_a_session_turn_continues_its_slot_with_the_slots_bound():
    from sglang_ext.tail_replay.sessions import session_plan

    exact = _session([0.0] * 6)
    plan, carry, floor = session_plan(exact, 6, STRICT)
    assert plan == ReplayPlan(HitKind.EXACT_CHECKPOINT, 6, 6, 6) and carry is None and floor == 0.0
    approx = _session([0.0, 0.0, 0.5, 0.25, 0.1, 0.05])       # turn 1 replayed from position 2
    plan, carry, floor = session_plan(approx, 6, EXACT_FIRST)
    assert plan.kind is HitKind.APPROXIMATE_CHECKPOINT and plan.prefix_len == 6 and floor == TAINT
    assert carry.start == 6 and math.exp(carry.base_log) == pytest.approx(0.05)
    # the turn's own positions carry the slot's bound on (no gates seen: the start bound)
    assert carried_bounds(carry, 6, 8, floor).tolist() == pytest.approx([0.05, 0.05])
    tainted = _session([TAINT] * 6)                             # an exact state that read approximate KV
    plan, carry, floor = session_plan(tainted, 6, EXACT_FIRST)
    assert plan.kind is HitKind.EXACT_CHECKPOINT and floor == TAINT and carry is not None


def test_exactness_exact_is_refused_by_a_session_that_cannot_honour_it():
    from sglang_ext.tail_replay.sessions import refusal

    assert refusal(_session([0.0] * 6), 6, STRICT, "s") is None
    assert refusal(_session([0.0, 0.1, 0.0]), 3, EXACT_FIRST, "s") is None     # only the exact mode asks more
    for prov in (_session([0.0, 0.1, 0.0]), _session([0.0] * 3, reads_inexact=True), None):
        why = refusal(prov, 3, STRICT, "s1")
        assert "'exactness': 'exact' cannot be honoured in streaming session 's1'" in why
        assert "custom_params['tail_replay']" in why


def test_an_aborted_session_turn_inserts_its_sessions_bounds_below_its_own():
    from sglang_ext.tail_replay.provenance.writes import insert_bounds
    from sglang_ext.tail_replay.request import TailReplayRequest

    record = TailReplayRequest(CFG)                   # turn 2: continues at 4 from a slot of bound 0.5
    record.set_plan(ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 4, 4, 4), CarryBound(4, math.log(0.5)), TAINT)
    history = torch.tensor([0.0, 1.0, 0.75, 0.5])     # turn 1 replayed from 1
    bounds = insert_bounds(record, 2, 6, caching=True, history=history)
    assert bounds.tolist() == pytest.approx([0.75, 0.5, 0.5, 0.5])
    # without its session's history (the fail-open default before): the floor below its prefix
    assert insert_bounds(record, 2, 4, caching=True).tolist() == pytest.approx([TAINT, TAINT])


def test_the_scalar_bound_of_an_insert_is_the_max_of_its_bounds_in_every_case():
    """`insert_max_bound` reads the common exact case without a tensor: it must equal the tensor's
    max whatever the record (none, unplanned, exact, carried from inside or past the span, a taint
    floor, a carry with seen rows), session history, transfer or caching."""
    from sglang_ext.tail_replay.provenance.writes import insert_bounds, insert_max_bound
    from sglang_ext.tail_replay.request import TailReplayRequest

    seen = CarryBound(start=30)
    seen.add_rows(0, 30, torch.tensor([[-0.5], [-0.25], [-1.0]]))
    records = [None, TailReplayRequest(CFG), _planned(), _planned(floor=TAINT), _planned(CarryBound(start=30)),
               _planned(CarryBound(start=30), floor=TAINT), _planned(seen), _planned(CarryBound(30, math.log(0.5)))]
    histories = [None, torch.zeros(40), torch.tensor([0.0] * 20 + [0.25] * 20)]
    spans = [(0, 0), (0, 1), (0, 30), (28, 30), (29, 31), (30, 33), (31, 32), (33, 38), (0, 40)]
    for record in records:
        for history in histories:
            for caching in (True, False):
                for transferred in (False, True):
                    for start, end in spans:
                        kw = dict(caching=caching, transferred=transferred, history=history)
                        tensor = insert_bounds(record, start, end, **kw)
                        expected = float(tensor.max()) if tensor.numel() else 0.0
                        assert insert_max_bound(record, start, end, **kw) == expected, (record, history, kw, start, end)
