"""SAE learns in the right direction from constructed feedback sequences."""

from __future__ import annotations

import math
from dataclasses import replace

from sglang_ext.eviction import EntryInfo, RequestInfo, SAEConfig, SAEPolicy


def _info(token_type: str, start: int = 0) -> EntryInfo:
    return EntryInfo(n_blocks=1, n_tokens=64, start_token=start, token_type=token_type)


def _req(i: int, t: float, session: int = 1) -> RequestInfo:
    return RequestInfo(index=i, time=t, prompt_tokens=64, session=session)


def _evict_and_maybe_return(policy: SAEPolicy, returning_type: str, rounds: int = 30) -> None:
    """Each round admits one entry per type and evicts it 10 s later; only the
    ``returning_type`` one is re-referenced, 5-11 s after its eviction (a ghost hit)."""
    t = 0.0
    for r in range(rounds):
        for token_type in ("tool_output", "user"):
            key = (token_type, r)
            policy.admit(key, _info(token_type), _req(r, t))
            policy.set_evictable(key, True)
            policy.evicted(key, None, t + 10.0)
        back = t + 10.0 + 5.0 + r % 7
        key = (returning_type, r)
        policy.admit(key, _info(returning_type), _req(r, back))  # ghost hit
        policy.set_evictable(key, True)
        policy.evicted(key, None, back + 10.0)
        t = back + 10.0


def test_reused_ghosts_raise_their_type_weight():
    policy = SAEPolicy()
    _evict_and_maybe_return(policy, "tool_output")
    weights = policy.state.type_weight
    assert weights["tool_output"] > 1.0 > weights["user"]
    other = SAEPolicy()
    _evict_and_maybe_return(other, "user")
    assert other.state.type_weight["user"] > other.state.type_weight["tool_output"]


def test_ghost_hits_raise_the_reuse_probability_of_their_class():
    policy = SAEPolicy()
    _evict_and_maybe_return(policy, "tool_output")
    reused = policy.stats(("session", "tool_output")).reuse_prob
    assert reused > SAEConfig().prior_reuse_prob


def test_reuse_time_model_fits_observed_leaf_intervals():
    policy = SAEPolicy()
    policy.admit("k", _info("tool_call"), _req(0, 0.0))
    policy.set_evictable("k", True)
    for i in range(1, 200):
        policy.touch("k", _info("tool_call"), _req(i, 5.0 * i))
    model = policy.stats(("session", "tool_call")).reuse_time
    assert math.exp(model.mu) == __import__("pytest").approx(5.0, rel=0.05)
    assert math.sqrt(model.var) < 0.05 and model.sigma == model.min_sigma  # floored


def test_entries_reused_by_a_second_session_move_to_the_shared_queue():
    policy = SAEPolicy()
    policy.admit("p", _info("system"), _req(0, 0.0, session=1))
    policy.set_evictable("p", True)
    policy.touch("p", _info("system"), _req(1, 1.0, session=2))
    assert policy._entries["p"].klass == ("shared", "system")
    assert policy.victim(2.0) == "p"


def test_learning_off_keeps_every_parameter():
    policy = SAEPolicy(replace(SAEConfig(), learning=False))
    before = policy.state.snapshot()
    _evict_and_maybe_return(policy, "tool_output")
    assert policy.state.type_weight == before.type_weight
    assert policy.state.classes == before.classes
    assert policy.state.horizon_s == before.horizon_s


def test_low_value_class_is_evicted_before_an_older_high_value_one():
    # few ghosts: unreturned "user" ghosts expire and count as "not reused"
    policy = SAEPolicy(replace(SAEConfig(), min_ghosts=8, ghost_factor=0.0))
    _evict_and_maybe_return(policy, "tool_output", rounds=60)
    assert policy.stats(("session", "user")).reuse_prob < 0.2
    now = 10_000.0
    policy.admit("old-tool", _info("tool_output"), _req(100, now))
    policy.admit("new-user", _info("user"), _req(101, now + 1.0))
    for key in ("old-tool", "new-user"):
        policy.set_evictable(key, True)
    assert policy.victim(now + 2.0) == "new-user"
    lru_like = SAEPolicy()  # without feedback both classes look alike: the older goes
    lru_like.admit("old-tool", _info("tool_output"), _req(100, now))
    lru_like.admit("new-user", _info("user"), _req(101, now + 1.0))
    for key in ("old-tool", "new-user"):
        lru_like.set_evictable(key, True)
    assert lru_like.victim(now + 2.0) == "old-tool"


def test_warm_start_copies_state_instead_of_sharing_it():
    source = SAEPolicy()
    _evict_and_maybe_return(source, "tool_output")
    warm = SAEPolicy(state=source.state)
    _evict_and_maybe_return(warm, "user")
    assert source.state.type_weight["tool_output"] > source.state.type_weight["user"]
