"""SAE's settings: validation names the key; ablations stay out of the product registry."""

from __future__ import annotations

import math

import pytest

from eval.trace_sim.ablations import SIM_POLICIES, SAEModelPolicy, make_sim_policy
from eval.trace_sim.cli import build_parser
from sglang_ext.eviction import POLICY_REGISTRY, SAEAblation, SAEConfig, make_policy
from sglang_ext.eviction.sae import SAEConfigError


@pytest.mark.parametrize("key, value", [("prior_reuse_s", 0.0), ("prior_reuse_s", math.inf),
                                        ("prior_log_sigma", -1.0), ("prior_reuse_prob", 1.5),
                                        ("min_sigma", 0.0), ("min_stat_rate", 0.0),
                                        ("horizon_rate", 2.0), ("expert_rate", -0.1),
                                        ("cost_power", -0.5), ("silence_quantile_z", math.nan),
                                        ("ghost_factor", -1.0), ("min_ghosts", -1)])
def test_bad_setting_names_its_key(key, value):
    with pytest.raises(SAEConfigError, match=f"SAEConfig key '{key}'"):
        SAEConfig(**{key: value})


@pytest.mark.parametrize("key, value", [("duel_cost_power", -1.0), ("duel_window", 0.0),
                                        ("duel_cap_factor", -1), ("horizon_scale", 0.0),
                                        ("session_rate", 1.5)])
def test_bad_ablation_names_its_key(key, value):
    with pytest.raises(SAEConfigError, match=f"SAEAblation key '{key}'"):
        SAEAblation(**{key: value})


def test_defaults_are_valid_and_frozen():
    config, ablation = SAEConfig(), SAEAblation()
    with pytest.raises(AttributeError):
        config.cost_power = 1.0  # type: ignore[misc]
    assert ablation.use_lru_expert and ablation.hit_density and config.learning


def test_ablation_policies_live_only_in_the_simulator():
    assert "sae-model" not in POLICY_REGISTRY
    with pytest.raises(ValueError, match="sae-model"):
        make_policy("sae-model")
    assert SIM_POLICIES["sae-model"] is SAEModelPolicy
    assert set(POLICY_REGISTRY) < set(SIM_POLICIES)
    policy = make_sim_policy("sae-model")
    assert not policy.ablation.use_lru_expert
    with pytest.raises(ValueError, match="use_lru_expert"):
        SAEModelPolicy(ablation=SAEAblation())
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        make_sim_policy("nope")


def test_simulator_cli_accepts_the_ablation():
    args = build_parser().parse_args(["run", "--policies", "sae,sae-model", "--out", "x"])
    assert args.policies == ["sae", "sae-model"]
