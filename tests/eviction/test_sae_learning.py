"""SAE learns in the right direction from constructed feedback sequences."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from eval.trace_sim.synthetic import SyntheticSpec, WorkloadMix, generate
from eval.trace_sim.testing import run
from sglang_ext.eviction import EntryInfo, RequestInfo, SAEAblation, SAEConfig, SAEPolicy
from sglang_ext.eviction.sae import RankClass, ReuseClass, ReuseTimeModel, hit_density, soon
from sglang_ext.eviction.sae.expert import Proposals


def _info(token_type: str, start: int = 0, blocks: int = 1, cost: float = 0.0) -> EntryInfo:
    return EntryInfo(n_blocks=blocks, n_tokens=64 * blocks, start_token=start,
                     token_type=token_type, compute_cost=cost)


def _req(i: int, t: float, session: int | None = 1) -> RequestInfo:
    return RequestInfo(index=i, time=t, prompt_tokens=64, session=session)


def _session_turns(policy: SAEPolicy, session: int, out_type: str, gap: float, turns: int,
                   t0: float = 0.0, index0: int = 0) -> float:
    """One session: each request admits one input and one output entry; the next request
    comes ``gap`` seconds later. Returns the time of the last request."""
    t = t0
    for k in range(turns):
        t = t0 + k * gap
        policy.admit((session, k, "in"), _info("user", 2 * k), _req(index0 + k, t, session))
        policy.admit((session, k, "out"), _info(out_type, 2 * k + 1), _req(index0 + k, t, session))
    return t


def test_session_gaps_fit_the_class_of_the_last_output():
    policy = SAEPolicy()
    _session_turns(policy, 1, "tool_call", gap=5.0, turns=50)
    _session_turns(policy, 2, "response", gap=300.0, turns=50, index0=1000)
    tool = policy.reuse_model(("session", ("tool_call", 1)))
    response = policy.reuse_model(("session", ("response", 1)))
    assert math.exp(tool.mu) == pytest.approx(5.0, rel=0.05)
    assert math.exp(response.mu) == pytest.approx(300.0, rel=0.05)
    assert tool.sigma == tool.min_sigma  # exact gaps: the floor regularises the fit


def test_size_classes_follow_a_shift_of_their_type():
    policy = SAEPolicy()
    _session_turns(policy, 1, "tool_call", gap=5.0, turns=50)  # size class 1
    offset = policy.stats(("session", ("tool_call", 1))).reuse_time.mu
    # the type's gap moves to 200 s, seen only through a different size class
    for k in range(300):
        t = 1e4 + 200.0 * k
        policy.admit((2, k), _info("tool_call", k, blocks=5), _req(5000 + k, t, session=2))
    assert policy.stats(("session", ("tool_call", 1))).reuse_time.mu == offset  # no new samples
    assert math.exp(policy.reuse_model(("session", ("tool_call", 1))).mu) > 50.0  # but it moved


def test_output_size_classes_can_be_switched_off():
    policy = SAEPolicy(ablation=SAEAblation(output_size_classes=False))
    _session_turns(policy, 1, "tool_call", gap=5.0, turns=10)
    assert ("session", "tool_call") in policy.state.classes


def test_silent_sessions_lower_the_reuse_probability_of_their_class():
    policy = SAEPolicy()
    # many sessions end after one response; a long-lived one keeps sending requests
    for s in range(40):
        _session_turns(policy, 100 + s, "response", gap=10.0, turns=1, t0=10.0 * s,
                       index0=10 * s)
    _session_turns(policy, 1, "tool_call", gap=10.0, turns=500, index0=10_000)
    ended = policy.stats(("session", ("response", 1))).reuse_prob
    assert ended < 0.5 * SAEConfig().prior_reuse_prob


def test_horizon_is_littles_law_residence_time():
    policy = SAEPolicy()
    for i in range(200):  # 100 cached blocks, one block evicted every 2 s -> ~200 s
        policy.admit(i, _info("user"), _req(i, 2.0 * i, session=None))
        policy.set_evictable(i, True)
        if i >= 100:
            policy.evicted(i - 100, None, 2.0 * i)
    assert policy.state.horizon_s == pytest.approx(200.0, rel=0.05)


def test_fast_returning_session_is_kept_over_a_slow_one():
    policy = SAEPolicy()
    _session_turns(policy, 1, "tool_call", gap=5.0, turns=30)
    _session_turns(policy, 2, "response", gap=600.0, turns=30, index0=1000)
    now = 20_000.0
    # session 2 (slow: a user must answer) is more recent than session 1 (a tool is running)
    policy.admit("tool-leaf", _info("tool_call"), _req(5000, now, session=1))
    policy.admit("resp-leaf", _info("response"), _req(5001, now + 2.0, session=2))
    for key in ("tool-leaf", "resp-leaf"):
        policy.set_evictable(key, True)
    assert policy.victim(now + 3.0) == "resp-leaf"


def test_overdue_session_goes_before_a_fresh_one_of_the_same_class():
    policy = SAEPolicy()
    _session_turns(policy, 1, "tool_call", gap=5.0, turns=100)
    now = 10_000.0
    policy.admit("overdue", _info("tool_call"), _req(5000, now, session=2))
    policy.admit("fresh", _info("tool_call"), _req(5001, now + 120.0, session=3))
    for key in ("overdue", "fresh"):
        policy.set_evictable(key, True)
    assert policy.victim(now + 121.0) == "overdue"  # 2 minutes late for a 5 s gap: ended


def test_cost_power_prefers_keeping_expensive_blocks():
    config = SAEConfig(cost_power=1.0)
    policy = SAEPolicy(config)
    policy.admit("deep", _info("user", start=100_000, cost=8.0), _req(0, 0.0, session=1))
    policy.admit("shallow", _info("user", start=0, cost=1.0), _req(1, 0.0, session=2))
    for key in ("deep", "shallow"):
        policy.set_evictable(key, True)
    assert policy.victim(1.0) == "shallow"


def test_entries_reused_by_a_second_session_move_to_the_shared_queue():
    policy = SAEPolicy()
    policy.admit("p", _info("system"), _req(0, 0.0, session=1))
    policy.set_evictable("p", True)
    policy.touch("p", _info("system"), _req(1, 1.0, session=2))
    owner = policy.queues.owner_of("p")
    assert (owner.queue, owner.state) == ("shared", "system")
    assert policy.victim(2.0) == "p"


def test_duels_score_the_model_by_which_candidate_returns_first():
    policy = SAEPolicy(ablation=SAEAblation(use_lru_expert=True))
    start = policy.state.model_win_rate
    for r in range(20):  # the model evicts "m", LRU would have evicted "l"; "m" comes back first
        policy.expert.proposals = Proposals(("m", r), ("l", r))
        for key in (("m", r), ("l", r)):
            policy.admit(key, _info("user"), _req(2 * r, float(r), session=None))
            policy.set_evictable(key, True)
        policy.evicted(("m", r), None, r + 0.5)
        policy.admit(("m", r), _info("user"), _req(2 * r + 1, r + 0.7, session=None))
    assert policy.state.model_win_rate < start
    model, lru = policy._model_victim(100.0), policy.expert.lru.peek()
    if model != lru:
        assert policy.victim(100.0) == lru  # losing model: LRU decides


def test_learning_off_keeps_every_parameter():
    policy = SAEPolicy(SAEConfig(learning=False))
    before = policy.state.snapshot()
    _session_turns(policy, 1, "tool_call", gap=5.0, turns=30)
    for i in range(30):
        policy.set_evictable((1, i, "in"), True)
        policy.evicted((1, i, "in"), None, 1000.0 + i)
    for stats in policy.state.classes.values():  # priors only
        assert stats.reuse_time.n == stats.outcomes == 0
        assert stats.reuse_prob == SAEConfig().prior_reuse_prob
    assert replace(policy.state, classes={}) == before


def test_warm_start_copies_state_instead_of_sharing_it():
    source = SAEPolicy()
    _session_turns(source, 1, "tool_call", gap=5.0, turns=30)
    warm = SAEPolicy(state=source.state)
    _session_turns(warm, 1, "tool_call", gap=50.0, turns=30, t0=1e4, index0=100)
    klass = ("session", ("tool_call", 1))
    assert math.exp(source.reuse_model(klass).mu) == pytest.approx(5.0, rel=0.05)
    assert warm.reuse_model(klass).mu > source.reuse_model(klass).mu


@pytest.mark.parametrize("settings, overrides", [({}, {}), ({}, {"hit_density": False}),
                                                 ({"cost_power": 1.0}, {"use_lru_expert": True, "session_rate": 0.5})])
def test_variants_are_deterministic_on_a_synthetic_trace(settings, overrides):
    mix = WorkloadMix(system_blocks=4, template_blocks=3, tool_output_blocks=3, n_templates=5)
    trace = generate(SyntheticSpec(phases=((mix, 300.0),), arrival_rate=0.3, seed=5))
    capacity = max(4, trace.n_blocks // 8)
    config, ablation = SAEConfig(**settings), SAEAblation(**overrides)
    first = run(trace, SAEPolicy(config, ablation=ablation), capacity, check=True)
    second = run(trace, SAEPolicy(config, ablation=ablation), capacity)
    assert first.cached == second.cached
    assert first.stats.hit_blocks == second.stats.hit_blocks
    assert first.stats.evicted_blocks > 0


def test_duel_outcomes_are_weighted_by_what_was_at_stake():
    policy = SAEPolicy()
    policy.expert.score(True, stake=10.0)  # one expensive duel won ...
    for _ in range(3):
        policy.expert.score(False, stake=1.0)  # ... outweighs three cheap ones lost
    assert policy.state.model_win_rate > 0.5
    frozen = SAEPolicy(SAEConfig(learning=False))
    frozen.expert.score(False, stake=10.0)
    assert frozen.state.model_win_rate == 0.5


def _late_return_run(late_returns: bool) -> SAEPolicy:
    """Sessions of a 5 s tool-call class; ten of them stay silent for 300 s (far past the
    class's 99th percentile, so they are declared ended) and then come back."""
    policy = SAEPolicy(ablation=SAEAblation(late_returns=late_returns))
    _session_turns(policy, 1, "tool_call", gap=5.0, turns=20)  # t = 0..95
    for i in range(10):
        policy.admit(("slow", i, 0), _info("tool_call"), _req(1000 + i, 100.0 + i, session=100 + i))
    _session_turns(policy, 2, "tool_call", gap=5.0, turns=60, t0=100.0, index0=2000)  # to t = 395
    for i in range(10):
        policy.admit(("slow", i, 1), _info("user", 1), _req(3000 + i, 400.0 + i, session=100 + i))
    return policy


def test_sessions_declared_ended_that_come_back_are_learned():
    klass = ("session", ("tool_call", 1))
    learned, censored = _late_return_run(True), _late_return_run(False)
    # the ten "ended" verdicts lowered rho; only the learning run takes them back ...
    assert censored.stats(klass).reuse_prob < 0.9 < learned.stats(klass).reuse_prob
    # ... and sees the long gaps (without it they are censored by the verdict itself)
    assert learned.reuse_model(klass).mu > censored.reuse_model(klass).mu + 0.5
    assert learned.reuse_model(klass).sigma > censored.reuse_model(klass).sigma


def _duel(policy: SAEPolicy, r: int, cost: float, model_right: bool) -> None:
    """The model evicts ("m", r), LRU would have evicted ("l", r); both cost ``cost``."""
    m, lru = ("m", r), ("l", r)
    for j, key in enumerate((m, lru)):
        policy.admit(key, _info("user", cost=cost), _req(10 * r + j, 10.0 * r, session=None))
        policy.set_evictable(key, True)
    policy.expert.proposals = Proposals(m, lru)
    policy.evicted(m, None, 10.0 * r + 1)
    if model_right:
        policy.touch(lru, _info("user", cost=cost), _req(10 * r + 5, 10.0 * r + 2, session=None))
    else:
        policy.admit(m, _info("user", cost=cost), _req(10 * r + 5, 10.0 * r + 2, session=None))


@pytest.mark.parametrize("duel_cost_power, model_ahead", [(None, True), (0.0, False)])
def test_duel_cost_power_sets_what_the_judge_counts(duel_cost_power, model_ahead):
    policy = SAEPolicy(ablation=SAEAblation(duel_cost_power=duel_cost_power))
    _duel(policy, 0, cost=1024.0, model_right=True)  # one expensive block kept rightly
    for r in range(1, 4):
        _duel(policy, r, cost=1.0, model_right=False)  # three cheap blocks lost
    # cost-weighted (cost_power 0.5): 32 vs 3 for the model; blocks only: 1 vs 3
    assert (policy.state.model_win_rate > 0.5) == model_ahead


def test_hit_density_keeps_the_session_that_returns_sooner_when_both_will():
    """Both classes are sure to return (rho = 1) well within the horizon, so g ~ 1 for
    both; the hit density (references per block-second held) prefers the one that holds
    the space for less time: the 5 s tool-call class over the 60 s response class."""
    policies = {density: SAEPolicy(ablation=SAEAblation(hit_density=density))
                for density in (True, False)}
    for policy in policies.values():
        _session_turns(policy, 1, "tool_call", gap=5.0, turns=30)
        _session_turns(policy, 2, "response", gap=60.0, turns=30, index0=1000)
        for state in (("tool_call", 1), ("response", 1)):
            policy.stats(("session", state)).reuse_prob = 1.0
    slow = RankClass(ReuseClass("session", ("response", 1)), cost_bucket=0, pace=0)
    fast = RankClass(ReuseClass("session", ("tool_call", 1)), cost_bucket=0, pace=0)
    horizon = 1e4
    g = policies[False]
    assert g.value(slow, 1.0, horizon) == pytest.approx(g.value(fast, 1.0, horizon), rel=1e-6)
    density = policies[True]
    ratio = density.value(slow, 1.0, horizon) / density.value(fast, 1.0, horizon)
    assert ratio == pytest.approx(5.0 / 60.0, rel=0.3)  # ~ the ratio of the expected waits


def _numeric_integral(model: ReuseTimeModel, lo: float, hi: float, steps: int = 20_000) -> float:
    a, b = math.log(lo), math.log(hi)  # midpoint rule in log time
    width = (b - a) / steps
    points = (math.exp(a + (k + 0.5) * width) for k in range(steps))
    return sum(model.survival(t) * t for t in points) * width


@pytest.mark.parametrize("lo", [0.5, 20.0, 150.0, 700.0])
def test_survival_integral_is_accurate_from_the_body_to_the_far_tail(lo):
    model = ReuseTimeModel(mu=math.log(5.0), var=0.5 ** 2)  # at 700 s: 10 sigma out
    for width in (1.0, 100.0, 1e4):
        exact = _numeric_integral(model, lo, lo + width)
        assert model.survival_integral(lo, lo + width) == pytest.approx(exact, rel=1e-5)
    assert model.survival_integral(lo, lo) == 0.0


def test_hit_density_of_an_overdue_owner_sure_to_return_is_its_tail_rate():
    """rho = 1 and 40 sigma-widths overdue: all remaining hits come within H, so the
    density is H / (mean residual time); rounding must not turn it into 0 or 1e-9."""
    model = ReuseTimeModel(mu=math.log(5.0), var=0.5 ** 2)
    age, horizon = 150.0, 1000.0
    hits = model.survival(age) - model.survival(age + horizon)
    expected = hits * horizon / _numeric_integral(model, age, age + horizon)
    assert hit_density(model, 1.0, age, horizon) == pytest.approx(expected, rel=1e-4)
    assert hit_density(model, 1.0, 1e30, horizon) == 0.0  # survival underflows: no hit left


def test_hit_density_is_unimodal_in_age():
    """The decision looks only at the oldest and the youngest owner of each heap, which
    finds the least valuable one only if the value never falls and then rises in age."""
    ages = [0.0] + [math.exp(k / 8.0) for k in range(-24, 100)]
    for mu, sigma, rho, horizon in itertools.product((0.0, 3.0, 6.0), (0.5, 1.5, 3.0),
                                                     (0.05, 0.7, 0.999), (1.0, 100.0, 1e4)):
        model = ReuseTimeModel(mu=mu, var=sigma ** 2)
        values = [hit_density(model, rho, a, horizon) for a in ages]
        steps = [b - a for a, b in zip(values, values[1:]) if abs(b - a) > 1e-12 * max(a, 1e-300)]
        assert not any(x < 0 < y for x, y in zip(steps, steps[1:])), (mu, sigma, rho, horizon)
        assert all(v >= soon(model, rho, a, horizon) * (1 - 1e-9) for v, a in zip(values, ages))
