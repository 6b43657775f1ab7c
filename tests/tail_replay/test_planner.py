"""Pure Tail-Replay planner and config tests (no SGLang, no torch): exact plans for constructed
cases, window clamping, config errors that name the key, and a hypothesis property test."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.tail_replay.config import (
    REQUEST_PARAM_KEY,
    TailReplayConfig,
    TailReplayConfigError,
    config_from_dict,
    parse_config,
    user_settings,
)
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan, plan_replay, replay_window
from sglang_ext.tail_replay.request_fields import with_overrides

# W = clamp(ceil(0.1 * L), 16, 1000); matches below 32 tokens are not reused approximately.
#: `exactness: "approximate"`, the mode these tests exercise (the default, "exact_first", takes any
#: exact state on the path: tests/tail_replay/test_provenance.py)
CFG = TailReplayConfig.of(budget=0.1, min_replay_tokens=16, max_replay_tokens=1000, min_match_tokens=32,
                       exactness="approximate")


# ---------------------------------------------------------------- replay_window


@pytest.mark.parametrize(
    "matched, expected",
    [
        (0, 16),        # ceil(0) = 0 -> raised to the minimum
        (100, 16),      # ceil(10) = 10 -> raised to the minimum
        (160, 16),      # exactly the minimum
        (161, 17),      # ceil(16.1) = 17: rounds up
        (1000, 100),
        (9999, 1000),   # ceil(999.9) = 1000: exactly the maximum
        (20000, 1000),  # 2000 -> clamped to the maximum
    ],
)
def test_replay_window_clamps(matched, expected):
    assert replay_window(matched, CFG) == expected


def test_replay_window_budget_edges():
    assert replay_window(1000, TailReplayConfig.of(budget=0.0, min_replay_tokens=0)) == 0
    assert replay_window(1000, TailReplayConfig.of(budget=1.0, max_replay_tokens=10**6)) == 1000
    # min == max pins W whatever the budget
    pinned = TailReplayConfig.of(budget=0.5, min_replay_tokens=7, max_replay_tokens=7)
    assert [replay_window(n, pinned) for n in (0, 10, 10**6)] == [7, 7, 7]


# ---------------------------------------------------------------- plan_replay: exact values


def test_checkpoint_within_window_is_exact_checkpoint():
    # L = 500 -> W = 50; checkpoint at 460 is 40 <= 50 tokens back
    plan = plan_replay(500, 460, 1, CFG)
    assert plan == ReplayPlan(HitKind.EXACT_CHECKPOINT, 500, 460, 460)
    assert plan.replayed_tokens == 40
    assert plan.state_is_exact and not plan.reuses_tail_kv


def test_checkpoint_exactly_at_window_edge_is_exact_checkpoint():
    assert plan_replay(500, 450, 4, CFG) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 500, 450, 450)


def test_checkpoint_at_full_match_replays_nothing():
    plan = plan_replay(500, 500, 16, CFG)
    assert plan == ReplayPlan(HitKind.EXACT_CHECKPOINT, 500, 500, 500)
    assert plan.replayed_tokens == 0


def test_checkpoint_outside_window_gives_approximate():
    # L = 500, W = 50: checkpoint at 449 is 51 back -> approximate from L - W = 450
    plan = plan_replay(500, 449, 1, CFG)
    assert plan == ReplayPlan(HitKind.APPROXIMATE, 500, 450, 450)
    assert plan.replayed_tokens == 50
    assert not plan.state_is_exact and plan.reuses_tail_kv


def test_zero_budget_reuses_the_whole_match_and_replays_nothing():
    zero = CFG.replaced(budget=0.0, min_replay_tokens=0)
    plan = plan_replay(500, None, 1, zero)
    assert plan == ReplayPlan(HitKind.APPROXIMATE, 500, 500, 500)
    assert plan.replayed_tokens == 0 and not plan.state_is_exact and not plan.reuses_tail_kv
    assert plan_replay(500, None, 64, zero).replayed_tokens == 500 - 448   # back to a page boundary


def test_window_cut_to_the_grid_reaching_an_exact_state_resumes_there():
    # L = 500, W = 50, grid 64: the window's start, cut to the grid, is 448; an exact state at 448
    # (or deeper than the start) is where the request resumes, exactly; one above the start is not
    assert plan_replay(500, 448, 64, CFG) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 500, 448, 448)
    assert plan_replay(500, 449, 64, CFG) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 500, 449, 449)
    assert plan_replay(500, 384, 64, CFG) == ReplayPlan(HitKind.APPROXIMATE, 500, 448, 448)
    assert plan_replay(500, 449, 1, CFG) == ReplayPlan(HitKind.APPROXIMATE, 500, 450, 450)
    # a deeper approximate checkpoint within the window is still taken first (the approximate mode)
    assert plan_replay(500, 448, 64, CFG, (490, 0.3)) == ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 500, 490, 490)


@pytest.mark.parametrize(
    "matched, page, expected_prefix",
    [
        (500, 1, 450),     # W = 50
        (500, 16, 448),    # floor(450 / 16) * 16
        (500, 64, 448),    # floor(450 / 64) * 64
        (1234, 1, 1110),   # W = ceil(123.4) = 124
        (1234, 32, 1088),  # floor(1110 / 32) * 32
        (20000, 128, 18944),  # W = 1000 (max); floor(19000 / 128) * 128
    ],
)
def test_approximate_prefix_is_page_floor_of_l_minus_w(matched, page, expected_prefix):
    window = replay_window(matched, CFG)
    assert expected_prefix == (matched - window) // page * page
    plan = plan_replay(matched, None, page, CFG)
    assert plan == ReplayPlan(HitKind.APPROXIMATE, matched, expected_prefix, expected_prefix)
    assert plan.replayed_tokens == matched - expected_prefix
    assert window <= plan.replayed_tokens < window + page


@pytest.mark.parametrize("matched", [1, 10, 16])
def test_short_accidental_match_is_a_miss(matched):
    # L < min_match_tokens (32), no checkpoint: nothing is reused, and it is counted as a miss
    assert plan_replay(matched, None, 1, CFG) == ReplayPlan(HitKind.MISS, matched, 0, 0)


@pytest.mark.parametrize("matched", [1, 10, 16])
def test_window_covering_match_is_exact_replay_from_zero(matched):
    # W = 16 >= L: the whole match is replayed from the zero state (exact at position 0)
    plan = plan_replay(matched, None, 1, CFG.replaced(min_match_tokens=0))
    assert plan == ReplayPlan(HitKind.EXACT_REPLAY, matched, 0, 0)
    assert plan.replayed_tokens == matched
    assert plan.state_is_exact and plan.reuses_tail_kv


def test_full_budget_prefers_a_checkpoint_over_replay_from_zero():
    # budget 1.0: W = L, so every checkpoint is within the window and wins (fewer tokens
    # replayed); without one the whole match is replayed from the zero state.
    full = TailReplayConfig.of(budget=1.0, min_replay_tokens=0, max_replay_tokens=10**6, min_match_tokens=0)
    assert plan_replay(300, None, 1, full) == ReplayPlan(HitKind.EXACT_REPLAY, 300, 0, 0)
    assert plan_replay(300, 100, 1, full) == ReplayPlan(HitKind.EXACT_CHECKPOINT, 300, 100, 100)


def test_no_match_is_miss():
    plan = plan_replay(0, None, 1, CFG)
    assert plan == ReplayPlan(HitKind.MISS, 0, 0, 0)
    assert plan.replayed_tokens == 0


def test_below_min_match_without_checkpoint_is_miss():
    # L = 20 > W = 16 but L < min_match_tokens = 32
    plan = plan_replay(20, None, 1, CFG)
    assert plan == ReplayPlan(HitKind.MISS, 20, 0, 0)
    assert plan.replayed_tokens == 0 and plan.state_is_exact and not plan.reuses_tail_kv


def test_below_min_match_with_checkpoint_uses_checkpoint():
    # L = 30 < min_match 32, W = 16, checkpoint at 5 is 25 back (outside W): still exact
    plan = plan_replay(30, 5, 1, CFG)
    assert plan == ReplayPlan(HitKind.EXACT_CHECKPOINT, 30, 5, 5)
    assert plan.replayed_tokens == 25


def test_at_min_match_is_approximate():
    plan = plan_replay(32, None, 1, CFG)
    assert plan == ReplayPlan(HitKind.APPROXIMATE, 32, 16, 16)


def test_replay_plan_properties_per_kind():
    assert ReplayPlan(HitKind.MISS, 20, 0, 0).replayed_tokens == 0
    assert ReplayPlan(HitKind.EXACT_REPLAY, 20, 0, 0).replayed_tokens == 20
    assert [k.value for k in HitKind] == ["exact_checkpoint", "exact_replay", "approximate",
                                          "approximate_checkpoint", "miss"]
    assert ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 20, 12, 12).replayed_tokens == 8
    assert not ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 20, 12, 12).state_is_exact
    assert ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, 20, 12, 12).from_checkpoint


# ---------------------------------------------------------------- config parsing


def test_defaults():
    assert parse_config(None) == TailReplayConfig()
    assert parse_config("") == TailReplayConfig()
    cfg = TailReplayConfig()
    assert (cfg.knobs.budget, cfg.knobs.min_replay_tokens, cfg.knobs.max_replay_tokens, cfg.knobs.min_match_tokens,
            cfg.knobs.keep_checkpoints, cfg.knobs.kv_mode) == (0.05, 64, 4096, 128, True, "exact")


def test_parse_json_object():
    cfg = parse_config('{"budget": 0.1, "min_replay_tokens": 8, "max_replay_tokens": 512, '
                       '"min_match_tokens": 0, "keep_checkpoints": false, "kv_mode": "recompute"}')
    assert cfg == TailReplayConfig.of(budget=0.1, min_replay_tokens=8, max_replay_tokens=512,
                                   min_match_tokens=0, keep_checkpoints=False, kv_mode="recompute")


def test_parse_integer_budget_is_accepted():
    assert parse_config('{"budget": 1}').knobs.budget == 1
    assert parse_config('  {"budget": 0}').knobs.budget == 0


def test_parse_json_file_path(tmp_path):
    path = tmp_path / "tail_replay.json"
    path.write_text(json.dumps({"budget": 0.2, "keep_checkpoints": False}))
    assert parse_config(str(path)) == TailReplayConfig.of(budget=0.2, keep_checkpoints=False)


def test_parse_bad_file_in_path_names_the_key(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"max_replay_tokens": 1, "min_replay_tokens": 2}')
    with pytest.raises(TailReplayConfigError, match="'max_replay_tokens'"):
        parse_config(str(path))


def test_parse_missing_file():
    with pytest.raises(TailReplayConfigError, match="neither a JSON object nor a file"):
        parse_config("/nonexistent/tail_replay.json")


@pytest.mark.parametrize("text", ['{"budget": 0.1', '{budget: 0.1}', "{'budget': 0.1}"])
def test_parse_bad_json(text):
    with pytest.raises(TailReplayConfigError, match="not valid JSON"):
        parse_config(text)


def test_parse_bad_json_in_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(TailReplayConfigError, match="not valid JSON"):
        parse_config(str(path))


def test_parse_non_object_json_file(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(TailReplayConfigError, match="must be a JSON object"):
        parse_config(str(path))


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"budgett": 0.1}, "budgett"),                      # unknown key
        ({"budget": 0.1, "replay_window": 5}, "replay_window"),
        ({"budget": "0.1"}, "budget"),                      # wrong type
        ({"budget": True}, "budget"),                       # bool is not a number here
        ({"min_replay_tokens": 8.0}, "min_replay_tokens"),  # float for int
        ({"min_replay_tokens": True}, "min_replay_tokens"),  # bool for int
        ({"max_replay_tokens": False}, "max_replay_tokens"),
        ({"min_match_tokens": "128"}, "min_match_tokens"),
        ({"keep_checkpoints": 1}, "keep_checkpoints"),      # int for bool
        ({"keep_checkpoints": "false"}, "keep_checkpoints"),
        ({"kv_mode": 1}, "kv_mode"),
        ({"kv_mode": None}, "kv_mode"),
        ({"budget": -0.05}, "budget"),                      # negative budget
        ({"budget": 1.5}, "budget"),                        # above 1
        ({"min_replay_tokens": -1}, "min_replay_tokens"),
        ({"min_match_tokens": -1}, "min_match_tokens"),
        ({"min_replay_tokens": 100, "max_replay_tokens": 99}, "max_replay_tokens"),  # max < min
        ({"max_replay_tokens": 10}, "max_replay_tokens"),   # below the default min (64)
        ({"kv_mode": "approximate"}, "kv_mode"),            # bad kv_mode
        ({"kv_mode": "EXACT"}, "kv_mode"),
        ({"exactness": "exact-first"}, "exactness"),        # a value that is not one of EXACTNESS
        ({"state_order": "approximate"}, "state_order"),    # nor of STATE_ORDERS
    ],
)
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(TailReplayConfigError, match=f"'{key}'") as err:
        config_from_dict(raw)
    assert isinstance(err.value, ValueError)
    # the same through the JSON front door
    with pytest.raises(TailReplayConfigError, match=f"'{key}'"):
        parse_config(json.dumps(raw))


def test_unknown_key_message_lists_known_keys():
    with pytest.raises(TailReplayConfigError) as err:
        config_from_dict({"nope": 1})
    message = str(err.value)
    for known in ("budget", "min_replay_tokens", "max_replay_tokens", "min_match_tokens",
                  "keep_checkpoints", "kv_mode"):
        assert known in message


def test_direct_construction_validates():
    with pytest.raises(TailReplayConfigError, match="'budget'"):
        TailReplayConfig.of(budget=-1.0)
    with pytest.raises(TailReplayConfigError, match="'max_replay_tokens'"):
        TailReplayConfig.of(min_replay_tokens=10, max_replay_tokens=9)


def test_config_is_frozen():
    cfg = TailReplayConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.knobs.budget = 0.5  # type: ignore[misc]


# ---------------------------------------------------------------- with_overrides


def test_with_overrides_none_and_empty_return_base():
    base = TailReplayConfig.of(budget=0.2)
    assert with_overrides(base, None) is base
    assert with_overrides(base, {}) == base


def test_with_overrides_replaces_only_given_keys():
    base = TailReplayConfig.of(budget=0.2, min_replay_tokens=8, keep_checkpoints=False)
    out = with_overrides(base, {"budget": 0.5, "kv_mode": "recompute"})
    assert out.knobs == TailReplayConfig.of(budget=0.5, min_replay_tokens=8, keep_checkpoints=False,
                                         kv_mode="recompute").knobs
    assert out.server == base.server   # a request's options change its knobs, not the server's config
    assert base.knobs.budget == 0.2    # the base is untouched


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"bogus": 1}, "bogus"),
        ({"budget": 2.0}, "budget"),
        ({"min_replay_tokens": True}, "min_replay_tokens"),
        ({"max_replay_tokens": 1}, "max_replay_tokens"),  # below the base's min (64)
        ({"kv_mode": "fast"}, "kv_mode"),
        ({"exactness": "exact_frist"}, "exactness"),
        ({"state_order": "approximate_first"}, "state_order"),   # a server setting, refused per request
    ],
)
def test_with_overrides_errors_name_the_key(overrides, key):
    with pytest.raises(TailReplayConfigError, match=f"'{key}'"):
        with_overrides(TailReplayConfig(), overrides)


@pytest.mark.parametrize("overrides", [[("budget", 0.1)], "budget=0.1", 0.1])
def test_with_overrides_requires_an_object(overrides):
    with pytest.raises(TailReplayConfigError, match=REQUEST_PARAM_KEY):
        with_overrides(TailReplayConfig(), overrides)


# ---------------------------------------------------------------- property test

configs = st.builds(
    lambda budget, lo, extra, min_match, keep, mode, exactness: TailReplayConfig.of(
        budget=budget, min_replay_tokens=lo, max_replay_tokens=lo + extra,
        min_match_tokens=min_match, keep_checkpoints=keep, kv_mode=mode, exactness=exactness),
    st.floats(0.0, 1.0, allow_nan=False),
    st.integers(0, 300),
    st.integers(0, 3000),
    st.integers(0, 500),
    st.booleans(),
    st.sampled_from(["exact", "recompute"]),
    st.sampled_from(["approximate", "exact_first", "exact"]),
)


@st.composite
def plan_inputs(draw):
    matched = draw(st.integers(0, 20000))
    # the cache passes the depth of the deepest state on the path, never 0 (no state: None)
    checkpoint = draw(st.none() | st.integers(1, matched)) if matched else None
    page = draw(st.sampled_from([1, 2, 4, 16, 64, 128]))
    return matched, checkpoint, page, draw(configs)


@settings(max_examples=400, deadline=None)
@given(plan_inputs())
def test_plan_properties(args):
    matched, checkpoint, page, cfg = args
    plan = plan_replay(matched, checkpoint, page, cfg)
    window = replay_window(matched, cfg)

    assert plan.matched_tokens == matched
    assert 0 <= plan.prefix_len <= matched
    assert plan.replay_start == plan.prefix_len
    if plan.kind is HitKind.MISS:
        assert plan.prefix_len == 0 and plan.replayed_tokens == 0
        assert checkpoint is None or matched == 0
    else:
        assert plan.replayed_tokens == matched - plan.prefix_len
    if plan.kind is HitKind.APPROXIMATE:
        assert plan.prefix_len % page == 0
        assert plan.prefix_len == (matched - window) // page * page > 0
        assert window <= plan.replayed_tokens < window + page
        assert matched >= cfg.knobs.min_match_tokens and window < matched
        assert not plan.state_is_exact
        assert checkpoint is None or plan.prefix_len > checkpoint   # never from zero above an exact state
    else:
        assert plan.state_is_exact
    if plan.kind is HitKind.EXACT_CHECKPOINT:
        assert plan.prefix_len == checkpoint
    if plan.kind is HitKind.EXACT_REPLAY:   # the window, cut to whole pages, reaches token 0
        assert plan.prefix_len == 0 and 0 < matched < window + page
    # a checkpoint within the window always wins
    if checkpoint is not None and matched - checkpoint <= window:
        assert plan.kind is HitKind.EXACT_CHECKPOINT
    # exact_first and exact: never approximate where an exact state is on the path; exact: never
    if checkpoint is not None and cfg.knobs.exactness != "approximate" or cfg.knobs.exactness == "exact":
        assert plan.state_is_exact
    # the window is clamped
    assert cfg.knobs.min_replay_tokens <= window <= cfg.knobs.max_replay_tokens
    assert window == min(max(math.ceil(cfg.knobs.budget * matched), cfg.knobs.min_replay_tokens), cfg.knobs.max_replay_tokens)
    # pure: same inputs, same plan (also through an equal, separately built config)
    twin = TailReplayConfig.of(**user_settings(cfg))
    assert plan_replay(matched, checkpoint, page, twin) == plan
    assert plan_replay(matched, checkpoint, page, cfg) == plan
