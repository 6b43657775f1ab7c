"""`exactness: "exact_unless_pressed"` (no SGLang, no server): the policy's thresholds and
validation, the exact plan per case (not pressed: as "exact"; pressed: approximate only within the
tolerance), the arrival stamp taken once on the rank that pulls the requests and read, not
recomputed, by every rank's planner, and the client's refusal."""

from __future__ import annotations

import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest

from sglang_ext.patches.tail_replay import pressure as patch
from sglang_ext.tail_replay.config import TailReplayConfig, TailReplayConfigError, config_from_dict
from sglang_ext.tail_replay.decay_profile import DecayProfile
from sglang_ext.tail_replay.metrics import pressure_summary
from sglang_ext.tail_replay.planner import HitKind, exact_fallback, plan_replay, pressure_config, refused
from sglang_ext.tail_replay.pressure import (
    PRESSURE_PARAM_KEY,
    LoadSample,
    PressurePolicy,
    parse_policy,
    pressed_by,
    read_stamp,
    stamp,
)
from sglang_ext.tail_replay.request import TailReplayRequest
from sglang_ext.tail_replay.request_fields import check_request

#: slowest head's p90 decay 0.9: a fresh replay of W tokens is certified to 0.9 ** W
PROFILE = DecayProfile(source="test", slowest={10: 0.2, 50: 0.6, 90: 0.9}, heads=1)
POLICY = PressurePolicy(num_queue_reqs=4, token_usage=0.8, tolerance=0.01)
#: W = 64 for L = 300 (budget 0.05 -> 15, raised to 64): 0.9 ** 64 = 1.18e-3
BASE = TailReplayConfig.of(exactness="exact_unless_pressed", pressure=POLICY, profile=PROFILE, budget=0.05,
                        min_replay_tokens=64, min_match_tokens=128)
IDLE = LoadSample(num_queue_reqs=0, num_queue_tokens=0, token_usage=0.1, mamba_usage=0.2)


def _pressed(config: TailReplayConfig = BASE, *names: str) -> TailReplayConfig:
    return replace(config, pressed_by=names or ("num_queue_reqs",))


# ---------------------------------------------------------------- the policy


@pytest.mark.parametrize("load, expected", [
    (IDLE, ()),
    (replace(IDLE, num_queue_reqs=4), ("num_queue_reqs",)),             # at the threshold: met
    (replace(IDLE, num_queue_reqs=3, token_usage=0.8), ("token_usage",)),
    (replace(IDLE, num_queue_reqs=9, token_usage=0.95), ("num_queue_reqs", "token_usage")),
    (replace(IDLE, num_queue_tokens=10**6, mamba_usage=1.0), ()),          # not watched by POLICY
])
def test_pressed_by_names_the_thresholds_met(load, expected):
    assert pressed_by(POLICY, load) == expected


def test_the_queue_wait_threshold_is_met_once_the_oldest_request_has_waited_that_long():
    policy = parse_policy({"queue_wait_s": 0.5, "num_queue_reqs": 8})
    assert pressed_by(policy, replace(IDLE, queue_wait_s=0.49)) == ()
    assert pressed_by(policy, replace(IDLE, queue_wait_s=0.5)) == ("queue_wait_s",)
    assert pressed_by(policy, replace(IDLE, queue_wait_s=2.0, num_queue_reqs=8)) == ("queue_wait_s", "num_queue_reqs")
    assert pressed_by(policy, IDLE) == ()            # not read: never met
    assert stamp(policy, replace(IDLE, queue_wait_s=0.75))["load"]["queue_wait_s"] == 0.75
    assert read_stamp({PRESSURE_PARAM_KEY: {"pressed_by": ["queue_wait_s"]}}) == ("queue_wait_s",)


def test_the_oldest_wait_is_read_from_sglangs_queue_entry_stamps():
    def req(entered: float):
        return SimpleNamespace(origin_input_ids=[1, 2, 3], time_stats=SimpleNamespace(wait_queue_entry_time=entered))

    assert patch.oldest_wait_s([], now=100.0) == 0.0
    assert patch.oldest_wait_s([req(99.5), req(97.0), req(0.0)], now=100.0) == 3.0   # 0: not stamped yet
    assert patch.oldest_wait_s([req(0.0)], now=100.0) == 0.0
    queue = [req(98.0), req(99.0)]
    scheduler = SimpleNamespace(waiting_queue=queue, pool_stats_observer=SimpleNamespace(
        get_pool_stats=lambda: SimpleNamespace(full_token_usage=0.25, mamba_usage=None)))
    load = patch.scheduler_load(scheduler)
    assert (load.num_queue_reqs, load.num_queue_tokens, load.token_usage, load.mamba_usage) == (2, 6, 0.25, None)
    assert load.queue_wait_s is not None and load.queue_wait_s > 0.0


def test_thresholds_at_zero_are_always_met_and_a_missing_state_pool_never_is():
    policy = parse_policy({"num_queue_reqs": 0, "num_queue_tokens": 0, "token_usage": 0, "mamba_usage": 0})
    assert pressed_by(policy, IDLE) == ("num_queue_reqs", "num_queue_tokens", "token_usage", "mamba_usage")
    assert pressed_by(policy, replace(IDLE, mamba_usage=None)) == ("num_queue_reqs", "num_queue_tokens",
                                                                   "token_usage")
    assert policy.tolerance == 0.01 and policy.as_dict()["num_queue_reqs"] == 0


@pytest.mark.parametrize("raw, message", [
    ({"num_queue_reqs": 1, "queue": 3}, "'pressure.queue': unknown key"),
    ({"num_queue_reqs": 1.5}, "'pressure.num_queue_reqs': has the wrong type"),
    ({"num_queue_reqs": True}, "'pressure.num_queue_reqs': has the wrong type"),
    ({"num_queue_tokens": -1}, "'pressure.num_queue_tokens': must be >= 0"),
    ({"token_usage": 1.5}, "'pressure.token_usage': must be in \\[0, 1\\]"),
    ({"mamba_usage": -0.1}, "'pressure.mamba_usage': must be in \\[0, 1\\]"),
    ({"token_usage": 0.5, "tolerance": 0}, "'pressure.tolerance': must be in \\(0, 1\\]"),
    ({"queue_wait_s": -0.1}, "'pressure.queue_wait_s': must be a finite number of seconds >= 0"),
    ({"queue_wait_s": float("inf")}, "'pressure.queue_wait_s': must be a finite number of seconds >= 0"),
    ({"queue_wait_s": "1s"}, "'pressure.queue_wait_s': has the wrong type"),
    ({"tolerance": 0.1}, "'pressure': sets no threshold"),
    ([1], "'pressure': has the wrong type"),
])
def test_a_bad_policy_fails_at_start_up_naming_the_key(raw, message):
    with pytest.raises(TailReplayConfigError, match=message):
        config_from_dict({"exactness": "exact_unless_pressed", "pressure": raw})


def test_the_mode_needs_thresholds_and_they_are_the_servers():
    with pytest.raises(TailReplayConfigError, match="'exactness': needs the 'pressure' thresholds"):
        config_from_dict({"exactness": "exact_unless_pressed"})
    with pytest.raises(TailReplayConfigError, match="'pressure': must be a JSON object"):
        parse_policy([1], TailReplayConfigError)
    server = config_from_dict({"exactness": "exact_unless_pressed", "pressure": {"token_usage": 0.9}})
    assert server.server.pressure == PressurePolicy(token_usage=0.9)
    with pytest.raises(TailReplayConfigError, match="'pressure': is a server setting"):
        check_request(server, {"tail_replay": {"pressure": {"token_usage": 0.0}}})
    # a request may opt out (exact) on such a server, and may not opt in where the server has no policy
    assert check_request(server, {"tail_replay": {"exactness": "exact"}}).strict
    with pytest.raises(TailReplayConfigError, match="'exactness': needs the 'pressure' thresholds"):
        check_request(TailReplayConfig(), {"tail_replay": {"exactness": "exact_unless_pressed"}})


def test_a_client_sending_the_stamp_is_refused_naming_it():
    with pytest.raises(TailReplayConfigError, match=rf"custom_params\['{PRESSURE_PARAM_KEY}'\] is set by the "
                                                    "server at arrival; a request cannot set it"):
        check_request(BASE, {PRESSURE_PARAM_KEY: {"pressed_by": ["token_usage"]}})


# ---------------------------------------------------------------- plans


def test_not_pressed_plans_as_exact():
    assert BASE.strict and not _pressed().strict
    assert plan_replay(300, None, 1, BASE) == plan_replay(300, None, 1, BASE.replaced(exactness="exact"))
    plan = plan_replay(300, None, 1, BASE, (290, 1e-4))
    assert (plan.kind, plan.prefix_len, plan.pressure, plan.planned_bound) == (HitKind.MISS, 0, None, None)
    plan = plan_replay(300, 128, 1, BASE)
    assert (plan.kind, plan.prefix_len, plan.pressure) == (HitKind.EXACT_CHECKPOINT, 128, None)


def test_pressed_takes_an_approximate_replay_within_the_tolerance():
    plan = plan_replay(300, None, 1, _pressed())
    assert (plan.kind, plan.prefix_len, plan.replayed_tokens) == (HitKind.APPROXIMATE, 236, 64)
    assert plan.pressure == "approximate" and plan.planned_bound == pytest.approx(0.9 ** 64)


def test_pressed_beyond_the_tolerance_stays_exact():
    tight = _pressed(replace(BASE, server=replace(BASE.server, pressure=replace(POLICY, tolerance=1e-4))))
    plan = plan_replay(300, None, 1, tight)
    assert (plan.kind, plan.pressure) == (HitKind.APPROXIMATE, "beyond_tolerance")   # the caller plans again
    fallback = exact_fallback(tight)
    assert fallback.strict and fallback.server.pressure == tight.server.pressure
    exact = refused(plan_replay(300, None, 1, fallback), plan)
    assert (exact.kind, exact.prefix_len, exact.pressure) == (HitKind.MISS, 0, "beyond_tolerance")
    assert exact.planned_bound == pytest.approx(0.9 ** 64)
    # ... and the request is then served as a never-pressed one: strictly (no inexact tree KV
    # taken at a chunk boundary), labelled against threshold 0
    record = TailReplayRequest(config=tight)
    assert not record.strict and record.threshold == tight.server.exact_threshold
    record.set_plan(exact)
    assert record.strict and record.threshold == 0.0
    record.set_plan(plan_replay(300, None, 1, _pressed()))   # within the tolerance: approximate
    assert not record.strict


def test_pressed_without_a_decay_profile_is_certified_only_to_one():
    config = _pressed(replace(BASE, server=replace(BASE.server, profile=None)))
    assert plan_replay(300, None, 1, config).pressure == "beyond_tolerance"
    loose = replace(config, server=replace(config.server, pressure=replace(POLICY, tolerance=1.0)))
    plan = plan_replay(300, None, 1, loose)
    assert (plan.kind, plan.pressure, plan.planned_bound) == (HitKind.APPROXIMATE, "approximate", 1.0)


@pytest.mark.parametrize("bound, tolerance, verdict", [(1e-3, 0.01, "approximate"),
                                                       (1e-3, 5e-4, "beyond_tolerance")])
def test_pressed_resumes_an_approximate_checkpoint_within_the_tolerance(bound, tolerance, verdict):
    config = _pressed(replace(BASE, server=replace(BASE.server, pressure=replace(POLICY, tolerance=tolerance))))
    plan = plan_replay(300, None, 1, config, (280, bound))
    assert (plan.kind, plan.prefix_len, plan.pressure, plan.planned_bound) == (
        HitKind.APPROXIMATE_CHECKPOINT, 280, verdict, bound)


def test_pressed_with_an_exact_plan_says_so():
    plan = plan_replay(300, 260, 1, _pressed(BASE, "token_usage"))
    assert (plan.kind, plan.prefix_len, plan.pressure, plan.planned_bound) == (
        HitKind.EXACT_CHECKPOINT, 260, "exact", None)


def test_other_modes_are_untouched_by_a_stamp():
    params = {PRESSURE_PARAM_KEY: stamp(POLICY, replace(IDLE, num_queue_reqs=9))}
    for exactness in ("approximate", "exact_first", "exact"):
        config = BASE.replaced(exactness=exactness)
        assert pressure_config(config, params) is config
        assert plan_replay(300, None, 1, config).pressure is None


# ---------------------------------------------------------------- the stamp


def test_the_planner_reads_the_stamp_and_fails_closed_without_one():
    params = {PRESSURE_PARAM_KEY: stamp(POLICY, replace(IDLE, token_usage=0.9)), "tail_replay": {}}
    assert pressure_config(BASE, params).pressed_by == ("token_usage",)
    for no_stamp in (None, {}, {PRESSURE_PARAM_KEY: "x"}, {PRESSURE_PARAM_KEY: {"pressed_by": ["clock"]}}):
        assert read_stamp(no_stamp) == ()
        assert pressure_config(BASE, no_stamp).strict


def _request(tokens: int, custom_params: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(input_ids=list(range(tokens)), sampling_params=SimpleNamespace(custom_params=custom_params))


class _Loads:
    """A load reader that counts its reads."""

    def __init__(self, load: LoadSample) -> None:
        self.load, self.reads = load, 0

    def __call__(self) -> LoadSample:
        self.reads += 1
        return self.load


def test_a_poll_is_stamped_once_per_request_with_its_predecessors_counted():
    policy = PressurePolicy(num_queue_reqs=3, num_queue_tokens=250)
    reqs = [_request(100, {"tail_replay": {"budget": 0.1}}), _request(100), _request(100)]
    loads = _Loads(replace(IDLE, num_queue_reqs=1, num_queue_tokens=60))
    assert patch.stamp_arrivals(reqs, policy, loads) == 3 and loads.reads == 1
    stamps = [r.sampling_params.custom_params[PRESSURE_PARAM_KEY] for r in reqs]
    assert [s["load"]["num_queue_reqs"] for s in stamps] == [1, 2, 3]
    assert [s["load"]["num_queue_tokens"] for s in stamps] == [60, 160, 260]
    assert [s["pressed_by"] for s in stamps] == [[], [], ["num_queue_reqs", "num_queue_tokens"]]
    assert reqs[0].sampling_params.custom_params["tail_replay"] == {"budget": 0.1}
    # stamped requests (a later pipeline stage) are left as they are, and the load is not read again
    loads.load = replace(IDLE, num_queue_reqs=50)
    assert patch.stamp_arrivals(reqs, policy, loads) == 0 and loads.reads == 1
    assert [r.sampling_params.custom_params[PRESSURE_PARAM_KEY] for r in reqs] == stamps


def test_every_rank_plans_from_the_stamp_the_first_rank_took(monkeypatch):
    """Two TP ranks: rank 0 pulls the requests and stamps them before the broadcast (pickled, as
    `broadcast_pyobj` sends them); rank 1 gets None to broadcast into and reads no load. Each rank's
    planner reads the stamp: the plans agree though rank 1's own queue would say otherwise."""
    monkeypatch.setattr(patch, "_generate_reqs", lambda reqs: iter(reqs))
    rank0, rank1 = object(), object()
    loads0, loads1 = _Loads(replace(IDLE, num_queue_reqs=4)), _Loads(IDLE)
    monkeypatch.setitem(patch._ARRIVALS, id(rank0), (POLICY, loads0))
    monkeypatch.setitem(patch._ARRIVALS, id(rank1), (POLICY, loads1))
    sent: list = []

    def broadcast(self, recv_reqs, local_reqs=None):
        if recv_reqs is not None:
            sent.append(pickle.dumps(recv_reqs))
        return pickle.loads(sent[-1])

    wrapped = patch._wrap_broadcast(broadcast)
    on_rank0 = wrapped(rank0, [_request(300)], [])
    on_rank1 = wrapped(rank1, None, [])
    assert (loads0.reads, loads1.reads) == (1, 0)
    configs = [pressure_config(BASE, reqs[0].sampling_params.custom_params) for reqs in (on_rank0, on_rank1)]
    assert configs[0].pressed_by == configs[1].pressed_by == ("num_queue_reqs",)
    plans = [plan_replay(300, None, 1, config) for config in configs]
    assert plans[0] == plans[1] and plans[0].pressure == "approximate"


def test_a_server_without_a_policy_stamps_nothing(monkeypatch):
    monkeypatch.setattr(patch, "_generate_reqs", lambda reqs: iter(reqs))
    receiver, reqs = object(), [_request(10)]
    patch._wrap_broadcast(lambda self, recv, local=None: recv)(receiver, reqs, [])
    assert reqs[0].sampling_params.custom_params is None


# ---------------------------------------------------------------- what the answer says


def test_the_summary_says_which_threshold_and_what_the_plan_did():
    record = TailReplayRequest(config=_pressed(BASE, "token_usage", "mamba_usage"))
    record.set_plan(plan_replay(300, None, 1, record.config))
    assert pressure_summary(record) == {"pressed_by": ["token_usage", "mamba_usage"], "outcome": "approximate",
                                        "planned_bound": pytest.approx(0.9 ** 64)}
    calm = TailReplayRequest(config=BASE)
    calm.set_plan(plan_replay(300, None, 1, BASE))
    assert pressure_summary(calm) == {"pressed_by": [], "outcome": "not_pressed", "planned_bound": None}
    other = TailReplayRequest(config=BASE.replaced(exactness="exact_first"))
    other.set_plan(plan_replay(300, None, 1, other.config))
    assert pressure_summary(other) is None
