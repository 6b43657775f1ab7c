"""Ablation policies: variants of product policies run by the simulator only.

They are not in the product registry (``sglang_ext.eviction.POLICY_REGISTRY``); the
simulator's policy choices are ``SIM_POLICIES`` = the product policies plus these."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from sglang_ext.eviction import POLICY_REGISTRY, EvictionPolicy, SAEAblation, SAEConfig, SAEPolicy, SAEState


class SAEModelPolicy(SAEPolicy):
    """SAE's model alone, without the LRU expert (``sae-model`` in the simulator CLI)."""

    name = "sae-model"

    def __init__(self, config: SAEConfig = SAEConfig(), state: SAEState | None = None,
                 ablation: SAEAblation = SAEAblation(use_lru_expert=False)) -> None:
        if ablation.use_lru_expert:
            raise ValueError("sae-model runs without the LRU expert; got use_lru_expert=True")
        super().__init__(config, state, ablation)


ABLATIONS: Mapping[str, type[EvictionPolicy]] = MappingProxyType({SAEModelPolicy.name: SAEModelPolicy})
SIM_POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType({**POLICY_REGISTRY, **ABLATIONS})
if set(ABLATIONS) & set(POLICY_REGISTRY):
    raise RuntimeError(f"ablation names {sorted(set(ABLATIONS) & set(POLICY_REGISTRY))} shadow product policies")


def make_sim_policy(name: str, **kwargs) -> EvictionPolicy:
    """Instantiate a product or ablation policy by name (see ``SIM_POLICIES``)."""
    try:
        cls = SIM_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(SIM_POLICIES)}") from None
    return cls(**kwargs)
