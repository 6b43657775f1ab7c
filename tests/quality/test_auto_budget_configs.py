"""Decay-certified (`tr-auto-*`) eval configurations: names, overrides, report order, and the reuse
check planned with the server's own config (the model folder's decay.json found as the server does)."""

from __future__ import annotations

import json
import re

import pytest

from eval.quality import configs, runner
from eval.quality.samples import EvalSample
from eval.quality.servers import TAIL_REPLAY_SERVER_CONFIG, tail_replay_server_config

SAMPLE = EvalSample("perplexity", "essays", "1024-0", "", 0, (), 0, 1024, group="1K")
SHARED = runner.SharedPrefix(tokens=1000, page_size=1)
#: slowest head's decays: p90 0.9 -> tolerance 0.01 certifies 44 tokens, 0.1 -> 22; p10 0.5 -> 0.01: 7
PROFILE = {"layers": {"0": [{"head": 0, "decay_p10": 0.5, "decay_p50": 0.8, "decay_p90": 0.9},
                            {"head": 1, "decay_p10": 0.1, "decay_p50": 0.2, "decay_p90": 0.3}]}}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "decay.json").write_text(json.dumps(PROFILE))
    return tmp_path


def test_auto_names_and_overrides():
    c = configs.config_named("tr-auto-0.01")
    assert (c.name, c.budget, c.tolerance, c.decay_percentile, c.kv_mode) == ("tr-auto-0.01", "auto", 0.01, 90, "exact")
    assert c.overrides == {"budget": "auto", "tolerance": 0.01, "decay_percentile": 90, "kv_mode": "exact",
                           "min_replay_tokens": 0}
    assert c.auto and c.must_hit and c.warm
    r = configs.config_named("tr-auto-0.5-p10-recompute")
    assert (r.tolerance, r.decay_percentile, r.kv_mode, r.overrides["kv_mode"]) == (0.5, 10, "recompute", "recompute")
    # the default percentile is left out of the name; 1e-4 is named as it is printed
    assert configs.config_named("tr-auto-0.01-p90").name == "tr-auto-0.01"
    assert configs.config_named("tr-auto-1e-4").name == "tr-auto-0.0001"
    assert not configs.config_named("tr-5").auto


@pytest.mark.parametrize("name, error", [("tr-auto-1", "tolerance must be in (0, 1)"),
                                         ("tr-auto-0", "tolerance must be in (0, 1)"),
                                         ("tr-auto-0.1-p20", "percentile must be one of p10, p50, p90"),
                                         ("tr-auto-x", "unknown --configs name 'tr-auto-x'"),
                                         ("tr-auto-0.1-p90-exact", "unknown --configs name")])
def test_bad_auto_names_are_named(name, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        configs.parse_configs(name)


def test_report_puts_auto_after_fixed_budgets_of_the_same_kv_mode():
    names = ["tr-auto-0.01-recompute", "tr-auto-0.5-p10", "tr-10", "tr-auto-0.1", "tr-auto-0.01", "tr-5-recompute", "full"]
    ordered = sorted(names, key=lambda n: configs.report_order(configs.config_named(n)))
    assert ordered == ["full", "tr-10", "tr-auto-0.5-p10", "tr-auto-0.1", "tr-auto-0.01", "tr-5-recompute",
                       "tr-auto-0.01-recompute"]


def test_server_config_finds_the_model_profile_as_the_server_does(model_dir, tmp_path_factory):
    config = tail_replay_server_config(str(model_dir))
    assert config.knobs.keep_checkpoints is False and config.server.decay_profile == str(model_dir / "decay.json")
    assert config.server.profile.decay(90) == 0.9
    bare = tail_replay_server_config(str(tmp_path_factory.mktemp("no_profile")))
    assert bare.server.profile is None and bare == tail_replay_server_config(None)
    assert not TAIL_REPLAY_SERVER_CONFIG.get("decay_profile")


def _tr(matched, replayed):
    return runner.reuse_of({"cached_tokens": matched - replayed, "cached_tokens_details": {"tail_replay": {
        "kind": "approximate", "matched_tokens": matched, "replayed_tokens": replayed}}})


@pytest.mark.parametrize("name, replayed, error", [
    ("tr-auto-0.01", 44, None),
    ("tr-auto-0.1", 22, None),
    ("tr-auto-0.01-p10", 7, None),
    ("tr-auto-0.01", 50, "replayed 50 > the replay window 44 (certified for tolerance 0.01 at p90"),
    ("tr-auto-0.01-p10", 9, "replayed 9 > the replay window 7 (certified for tolerance 0.01 at p10"),
])
def test_reuse_check_plans_auto_with_the_models_profile(model_dir, name, replayed, error):
    server = tail_replay_server_config(str(model_dir))
    config = configs.config_named(name)
    if error:
        with pytest.raises(runner.ReuseCheckFailed, match=re.escape(error)):
            runner.check_reuse(config, SAMPLE, _tr(1000, replayed), SHARED, server)
    else:
        runner.check_reuse(config, SAMPLE, _tr(1000, replayed), SHARED, server)


def test_auto_against_a_server_without_a_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="needs the model's decay profile"):
        runner.check_reuse(configs.config_named("tr-auto-0.01"), SAMPLE, _tr(1000, 44), SHARED,
                           tail_replay_server_config(None))
