"""`budget: "auto"`: the replay window certified by the model's decay profile (config, planner,
start-up), on hand-made profiles and on the two trained models' profiles."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sglang_ext.tail_replay import (
    AUTO,
    ServerFacts,
    StartupError,
    TailReplayConfigError,
    check_start,
    config_from_dict,
    parse_config,
    replay_window,
    request_overrides,
    with_model_profile,
)
from sglang_ext.tail_replay.decay_profile import (
    DecayProfileError,
    certified_window,
    load_profile,
    profile_from_dict,
    window_bound,
)

ROOT = Path(__file__).resolve().parents[2]


def _profile(tmp_path: Path, p90: float = 0.9, p50: float = 0.5, p10: float = 0.1) -> Path:
    heads = [{"head": 0, "decay_p10": p10 / 2, "decay_p50": p50 / 2, "decay_p90": p90 / 2},
             {"head": 1, "decay_p10": p10, "decay_p50": p50, "decay_p90": p90}]
    path = tmp_path / "decay.json"
    path.write_text(json.dumps({"layers": {"0": heads, "2": heads[:1]}}))
    return path


@pytest.mark.parametrize("decay, tolerance, window", [
    (0.5, 0.01, 7), (0.9, 0.01, 44), (0.9, 0.1, 22), (0.0, 0.01, 0), (1.0, 0.01, None), (0.99982, 0.01, 25582)])
def test_certified_window_is_the_fewest_tokens_under_the_tolerance(decay, tolerance, window):
    assert certified_window(decay, tolerance) == window
    if window:
        assert window_bound(decay, window) <= tolerance < window_bound(decay, window - 1)


def test_the_slowest_head_decides(tmp_path):
    profile = load_profile(str(_profile(tmp_path)))
    assert profile.slowest == {10: 0.1, 50: 0.5, 90: 0.9} and profile.heads == 3


@pytest.mark.parametrize("raw, field", [
    ({}, "'layers'"), ({"layers": {"0": []}}, "'layers.0'"),
    ({"layers": {"3": [{"decay_p10": 0.1, "decay_p50": 0.2}]}}, "'layers.3[0].decay_p90'"),
    ({"layers": {"3": [{"decay_p10": 0.1, "decay_p50": 1.2, "decay_p90": 0.5}]}}, "'layers.3[0].decay_p50'"),
])
def test_bad_profiles_name_the_field(raw, field):
    with pytest.raises(DecayProfileError, match=re.escape(f"prof.json: field {field}")):
        profile_from_dict(raw, "prof.json")


def test_auto_window_follows_the_profile_and_the_clamps(tmp_path):
    path = str(_profile(tmp_path))
    config = config_from_dict({"budget": AUTO, "decay_profile": path, "min_replay_tokens": 0})
    assert replay_window(10_000, config) == 44 == replay_window(500, config)     # independent of L
    assert replay_window(500, config.replaced(tolerance=0.1)) == 22
    p50 = config_from_dict({"budget": AUTO, "decay_profile": path, "decay_percentile": 50, "min_replay_tokens": 0})
    assert replay_window(500, p50) == math.ceil(math.log(0.01) / math.log(0.5))
    clamped = config_from_dict({"budget": AUTO, "decay_profile": path, "min_replay_tokens": 64})
    assert replay_window(500, clamped) == 64
    (tmp_path / "forever").mkdir()       # (profiles are read once per path and process)
    forever = config_from_dict({"budget": AUTO, "decay_profile": str(_profile(tmp_path / "forever", p90=1.0)),
                                "max_replay_tokens": 300})
    assert replay_window(5000, forever) == 300                                 # nothing certifies it


def test_per_request_auto_and_tolerance(tmp_path):
    base = config_from_dict({"decay_profile": str(_profile(tmp_path)), "min_replay_tokens": 0})
    auto = request_overrides(base, {"tail_replay": {"budget": "auto", "tolerance": 0.1}})
    assert replay_window(1000, auto) == 22
    with pytest.raises(TailReplayConfigError, match="'budget': 'auto' needs the model's decay profile"):
        request_overrides(config_from_dict({}), {"tail_replay": {"budget": "auto"}})
    with pytest.raises(TailReplayConfigError, match="'decay_profile': is a server setting"):
        request_overrides(base, {"tail_replay": {"decay_profile": "/etc/passwd"}})
    for bad, needle in ((0.0, "'tolerance': must be in (0, 1)"), (2, "'tolerance': must be in (0, 1)")):
        with pytest.raises(TailReplayConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            request_overrides(base, {"tail_replay": {"budget": "auto", "tolerance": bad}})
    with pytest.raises(TailReplayConfigError, match="'decay_percentile': must be one of"):
        request_overrides(base, {"tail_replay": {"decay_percentile": 95}})


def test_start_up_refuses_auto_without_a_profile_naming_the_model_path(tmp_path):
    with pytest.raises(StartupError, match=f"no decay.json in --model-path '{tmp_path}'"):
        check_start(parse_config('{"budget": "auto"}'), ServerFacts(model_path=str(tmp_path)))
    with pytest.raises(TailReplayConfigError, match="'decay_profile': decay profile /nope/decay.json not found"):
        parse_config('{"budget": "auto", "decay_profile": "/nope/decay.json"}')


def test_the_model_folders_profile_is_found_at_start_up(tmp_path):
    assert with_model_profile('{"budget": 0.1}', str(tmp_path)) == '{"budget": 0.1}'   # no decay.json
    _profile(tmp_path)
    text = with_model_profile('{"budget": "auto"}', str(tmp_path))
    config = parse_config(text)
    assert config.server.decay_profile == str(tmp_path / "decay.json") and config.knobs.budget == AUTO
    (line,) = check_start(config, ServerFacts(model_path=str(tmp_path)))
    assert "certified window for tolerance 0.01: 44 tokens" in line
    assert with_model_profile(text, "/elsewhere") == text                              # named already


@pytest.mark.parametrize("model, window", [("gdn-ruler", 133), ("mamba2-ruler", None)])
def test_the_trained_models_profiles(model, window):
    """The committed profiles: GDN's slowest p90 head certifies 1 % in 133 tokens; one of the
    Mamba-2 model's heads keeps 99.98 % per token at p90, which no window under 25K certifies."""
    profile = load_profile(str(ROOT / "trained_models" / model / "decay.json"))
    certified = certified_window(profile.decay(90), 0.01)
    assert certified == window or (window is None and certified > 20_000)
