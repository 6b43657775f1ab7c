"""Eviction policy core: one interface (``EvictionPolicy``), SGLang's baselines, Marconi,
Belady's offline optimum and SAECache (``sae/``). Ablation variants are not
registered here; the simulator adds them (``eval/trace_sim/ablations.py``). Pure Python: no SGLang, no torch."""

from __future__ import annotations

from typing import Any

from .base import NEVER, POLICY_REGISTRY, TOKEN_TYPES, EntryInfo, EvictionPolicy, Key, LazyMinHeap, PriorityPolicy, RequestInfo, register
from .belady import BeladyPolicy
from .lfu import LFUPolicy
from .lru import LRUPolicy
from .marconi import MarconiConfig, MarconiPolicy
from .sae import SAEAblation, SAEConfig, SAEPolicy, SAEState
from .slru import SLRUConfig, SLRUPolicy
from .tlru import TLRUConfig, TLRUPolicy


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Instantiate a registered policy by name (see ``POLICY_REGISTRY``)."""
    try:
        cls = POLICY_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICY_REGISTRY)}") from None
    return cls(**kwargs)


__all__ = ["NEVER", "POLICY_REGISTRY", "TOKEN_TYPES", "BeladyPolicy", "EntryInfo",
           "EvictionPolicy", "Key", "LFUPolicy", "LRUPolicy", "LazyMinHeap", "MarconiConfig",
           "MarconiPolicy", "PriorityPolicy", "RequestInfo", "SAEAblation", "SAEConfig",
           "SAEPolicy", "SAEState", "SLRUConfig", "SLRUPolicy", "TLRUConfig", "TLRUPolicy", "make_policy",
           "register"]
