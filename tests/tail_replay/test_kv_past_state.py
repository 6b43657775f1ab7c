"""When a finished request's KV past its last tracked state is inserted under the extra buffer
(`kv_past_state.KvPastTheState.keeps`); the insert itself runs in the real server
(tests/e2e/test_tail_replay_extra_buffer.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.kv_past_state import KvPastTheState
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan
from sglang_ext.tail_replay.request import RECORD_ATTR, TailReplayRequest


def _cache(**overrides):
    base = dict(enable_mamba_extra_buffer=True, disable=False, enable_session_radix_cache=False, page_size=1,
                _components_tuple=(SimpleNamespace(component_type=ComponentType.FULL),
                                   SimpleNamespace(component_type=ComponentType.MAMBA)))
    return SimpleNamespace(**{**base, **overrides})


def _record(planned=True, dropped=False) -> TailReplayRequest:
    record = TailReplayRequest(TailReplayConfig())
    if planned:
        record.set_plan(ReplayPlan(HitKind.MISS, 0, 0, 0))
    if dropped:
        record.drop_plan()   # another wing served the request (LinearKV's assembled chunks)
    return record


def _req(finished=True, protected=192, holds_kv=True, skip=False, record=None):
    return SimpleNamespace(finished=lambda: finished, skip_radix_cache_insert=skip,
                           kv=SimpleNamespace(holds_kv=holds_kv, cache_protected_len=protected),
                           **{RECORD_ATTR: _record() if record is None else record})


def keeps(cache, req, up_to=200) -> bool:
    return KvPastTheState(cache, claims=None).keeps(req, up_to)


def test_a_finished_request_under_the_extra_buffer_inserts_the_kv_past_its_state():
    assert keeps(_cache(), _req())
    assert keeps(_cache(page_size=4), _req(), up_to=196)           # one whole page past 192


@pytest.mark.parametrize("cache, req, up_to", [
    (_cache(), _req(finished=False), 200),                       # a chunk's insert: the next one goes on
    (_cache(enable_mamba_extra_buffer=False), _req(), 200),      # no_buffer inserts the whole KV already
    (_cache(disable=True), _req(), 200),
    (_cache(enable_session_radix_cache=True), _req(), 200),      # the session keeps the first insert's leaf
    (_cache(), _req(holds_kv=False), 200),
    (_cache(), _req(skip=True), 200),
    (_cache(), _req(protected=200), 200),                        # SGLang's insert reached the end
    (_cache(page_size=16), _req(), 200),                         # less than a page past the state
    # untracked provenance: nothing past what SGLang's insert took
    (_cache(), _req(record=_record(dropped=True)), 200),          # a dropped plan (LinearKV's assembly)
    (_cache(), _req(record=_record(planned=False)), 200),         # a record without a plan
    (_cache(), SimpleNamespace(**{**vars(_req()), RECORD_ATTR: None}), 200),   # no record (a session turn)
    (_cache(_components_tuple=(SimpleNamespace(component_type=ComponentType.FULL),
                               SimpleNamespace(component_type=ComponentType.MAMBA),
                               SimpleNamespace(component_type=ComponentType.SWA))), _req(), 200),
])
def test_nothing_more_is_inserted_otherwise(cache, req, up_to):
    assert not keeps(cache, req, up_to)
