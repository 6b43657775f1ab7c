"""The provenance of what LinearKV's requests insert, as Tail-Replay's one decision
(`tail_replay.provenance.writes`) reads it from their Tail-Replay records: a chunk registration
prefilled from scratch is exact (it was UNTRACKED, an infinite bound, once inserts failed closed:
+Inf stored bounds, its chunk states evicted first under `approximate_first`); a registration hit
and an assembled request stay unknown (never exact)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_ext.linearkv.mamba_component import (
    CACHING,
    EXACT_FROM_SCRATCH,
    FROM_SCRATCH,
    PLANNED,
    UNKNOWN,
    track_provenance,
    untrack,
)
from sglang_ext.linearkv.serving import RECORD_ATTR, ChunkPlan, LinearKVRequest
from sglang_ext.tail_replay import DEFAULTS, HitKind, ReplayPlan, TailReplayRadixCache, record_of
from sglang_ext.tail_replay.metrics import record_first_forward
from sglang_ext.tail_replay.provenance.bounds import UNTRACKED
from sglang_ext.tail_replay.provenance.writes import insert_bounds, state_bound

N = 24   # a registration's tokens


def _req(record: LinearKVRequest, keep_state: bool = True) -> SimpleNamespace:
    custom = {"linearkv": {"register": True, "keep_state": keep_state}} if record.register else None
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom), rid="r")
    setattr(req, RECORD_ATTR, record)
    return req


class _Cache:
    """The cache's record factory, as `LinearKVRadixCache` inherits it from Tail-Replay's cache."""

    tail_replay_config = DEFAULTS
    request_record = TailReplayRadixCache.request_record


def _inserted(req) -> tuple[list[float], float]:
    record = record_of(req)
    return insert_bounds(record, 0, N, caching=True).tolist(), state_bound(record, N, caching=True)


def test_the_table_says_what_each_kinds_provenance_is_decided_from():
    assert {k: rule.provenance for k, rule in CACHING.items()} == {
        "plain": PLANNED, "fallback": PLANNED, "register_kv": EXACT_FROM_SCRATCH,
        "register_state": EXACT_FROM_SCRATCH, "register_hit": UNKNOWN, "assembled": UNKNOWN}


@pytest.mark.parametrize("keep_state", [True, False])
def test_a_registration_from_scratch_inserts_exact_kv_and_state(keep_state):
    req = _req(LinearKVRequest(register=True, keep_state=keep_state), keep_state)
    assert _inserted(req) == ([UNTRACKED] * N, UNTRACKED)   # no record: fail closed
    track_provenance(_Cache(), req)
    record = record_of(req)
    assert record.plan == FROM_SCRATCH and record.plan.kind is HitKind.MISS and record.plan.prefix_len == 0
    assert record.config == DEFAULTS and record.carry is None and record.floor == 0.0
    assert _inserted(req) == ([0.0] * N, 0.0)
    record_first_forward(record)   # the server's own run: not counted as Tail-Replay traffic
    assert {"plan_recorded", "exactness_recorded"} <= record.done


def test_a_registration_hit_and_an_assembled_request_stay_unknown():
    hit = _req(LinearKVRequest(register=True, register_hit=True))
    track_provenance(_Cache(), hit)
    assert record_of(hit) is None and _inserted(hit) == ([UNTRACKED] * N, UNTRACKED)

    again = _req(LinearKVRequest(register=True))   # matched from scratch, retracted, re-matched as a hit
    track_provenance(_Cache(), again)
    untrack(again)   # the re-match begins
    assert record_of(again).plan is None
    getattr(again, RECORD_ATTR).register_hit = True
    track_provenance(_Cache(), again)
    assert _inserted(again) == ([UNTRACKED] * N, UNTRACKED)

    assembled = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None), rid="a")
    setattr(assembled, RECORD_ATTR, LinearKVRequest(plan=ChunkPlan(((4, 20),), "predecessor"), assembled=True))
    _Cache().request_record(assembled).set_plan(ReplayPlan(HitKind.MISS, 0, 0, 0))   # its plan over P
    record_of(assembled).drop_plan()   # at its load (`assembly.ChunkAssembly._assemble`)
    track_provenance(_Cache(), assembled)
    assert _inserted(assembled) == ([UNTRACKED] * N, UNTRACKED)
