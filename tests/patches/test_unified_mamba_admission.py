"""`patches/shared/unified_mamba_admission.py`: on SGLang's unified pool with the extra buffer, the
prefill adder reserves a new request's tracking slots beside its state slot (SGLang's own method,
patched, on a stand-in adder with the attributes it reads)."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from sglang.srt.managers.schedule_policy import PrefillAdder  # noqa: E402

COST = 49   # full-token equivalents of one state slot's bytes


def _adder(cost: int, extra_buffer: bool, tracking: int = 1) -> SimpleNamespace:
    pool = SimpleNamespace(enable_mamba_extra_buffer=extra_buffer, mamba_initial_tracking_slots=tracking)
    return SimpleNamespace(_mamba_slot_cost=cost, tree_cache=SimpleNamespace(req_to_token_pool=pool))


def _req(holds_mamba: bool, has_buffer: bool, host_hit: int = 0) -> SimpleNamespace:
    kv = SimpleNamespace(holds_mamba=holds_mamba, mamba_ping_pong_track_buffer=object() if has_buffer else None)
    return SimpleNamespace(kv=kv, mamba_host_hit_length=host_hit)


@pytest.mark.parametrize(("adder", "req", "reserve"), [
    (_adder(COST, True), _req(False, False), 2 * COST),           # its state slot + 1 tracking slot
    (_adder(COST, True, tracking=2), _req(False, False), 3 * COST),  # the overlap scheduler's 2
    (_adder(COST, True), _req(True, True), 0),                    # a continuing chunk holds both
    (_adder(COST, True), _req(True, False), COST),                # holds its state, not its buffer yet
    (_adder(COST, False), _req(False, False), COST),              # no extra buffer: SGLang's reserve
    (_adder(0, True), _req(False, False), 0),                     # not the unified pool: nothing
])
def test_a_new_request_reserves_its_tracking_slots_on_the_unified_pool(adder, req, reserve):
    assert PrefillAdder._mamba_gap_budget_for_req(adder, req) == reserve


def test_the_host_hit_reserve_stays_sglangs():
    assert PrefillAdder._mamba_gap_budget_for_req(_adder(COST, True), _req(False, False, host_hit=1),
                                                  include_host_hit=True) == 3 * COST
