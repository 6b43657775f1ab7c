"""Streaming sessions' provenance (`tail_replay/sessions.py`) on a stand-in for SGLang's cache and
session: each turn handed to its session carries the session's bounds forward, an aborted turn's
release sees its session's history, a closed session forgets it."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import (sessions.py imports SGLang's session module)

import math  # noqa: E402
from array import array  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_ext.tail_replay.config import TailReplayConfig  # noqa: E402
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan  # noqa: E402
from sglang_ext.tail_replay.provenance.bounds import TAINT, UNTRACKED, CarryBound  # noqa: E402
from sglang_ext.tail_replay.request import RECORD_ATTR, TailReplayRequest  # noqa: E402
from sglang_ext.tail_replay.sessions import StreamingTurns  # noqa: E402


class _Cache:
    """What the part reads of SGLang's UnifiedRadixCache (its session) and what the adapter hands
    it (SGLang's own `claim_kv_row`: the session keeps a finished turn), wired as
    `TailReplayRadixCache` wires them."""

    def __init__(self):
        self.released = []
        self.session = SimpleNamespace(borrowed_slot=lambda req: object())
        self.turns = StreamingTurns(self, lambda req: getattr(req, RECORD_ATTR))

    def claim_kv_row(self, req):
        return self.turns.claim_kv_row(req, lambda r: not r.aborted)

    def release_session(self, session_id):
        self.turns.release_session(session_id)
        self.released.append(session_id)

    def session_provenance(self):
        return self.turns.table

    def session_history(self, req):
        return self.turns.history(req)


def _turn(session_id, prompt, output, plan, carry=None, floor=0.0, aborted=False):
    record = TailReplayRequest(TailReplayConfig())
    record.set_plan(plan, carry, floor)
    return SimpleNamespace(session=SimpleNamespace(session_id=session_id, streaming=True), aborted=aborted,
                           origin_input_ids=array("q", range(prompt)), finished_len=output, output_ids=[],
                           **{RECORD_ATTR: record})


def test_each_turn_hands_its_bounds_to_its_session_and_an_aborted_turn_inserts_them():
    cache = _Cache()
    # turn 1: an approximate replay from 2 over a 6-token prompt, 2 tokens of answer
    first = _turn("s", 6, 2, ReplayPlan(HitKind.APPROXIMATE, 4, 2, 2), CarryBound(2, math.log(0.5)))
    assert cache.claim_kv_row(first)
    kept = cache.session_provenance()["s"]
    assert kept.kv.tolist() == pytest.approx([0.0, 0.0] + [0.5] * 6) and not kept.reads_inexact
    # turn 2 continues at 8 (planned from the session); it is aborted: its release sees turn 1's bounds
    second = _turn("s", 12, 1, ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 8, 8, 8), CarryBound(8, math.log(0.5)),
                   TAINT, aborted=True)
    assert not cache.claim_kv_row(second)
    assert "s" not in cache.session_provenance()
    assert torch.equal(cache.session_history(second), kept.kv)
    assert cache.session_history(first) is None


def test_a_session_of_untracked_turns_stays_untracked_and_a_closed_session_is_forgotten():
    cache = _Cache()
    unplanned = _turn("u", 4, 1, ReplayPlan(HitKind.MISS, 0, 0, 0))
    getattr(unplanned, RECORD_ATTR).drop_plan()
    assert cache.claim_kv_row(unplanned)
    assert cache.session_provenance()["u"].kv.tolist() == [UNTRACKED] * 5
    cache.release_session("u")
    assert "u" not in cache.session_provenance() and cache.released == ["u"]
