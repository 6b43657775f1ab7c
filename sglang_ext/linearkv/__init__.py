"""LinearKV: position-independent chunk caching for hybrid models (attention + GDN / Mamba-2).

Pure core (no SGLang import): `store` (chunk cache keyed by content and model), `initializers`
(seeds for the linear layers' recomputed spans), `selectors` (which tokens to recompute), `ops`
(state composition, key re-rotation; backed by `hybrid_kernels`). `reference` runs the method over
transformers models (registration, assembly, greedy decode) as the ground truth the SGLang adapter
must reproduce.

Serving (`--radix-cache-backend linearkv`): `serving` (config, request fields, per-request record;
pure) and `sglang_cache` (the SGLang adapter, served from here on first use, so importing this face
loads no SGLang module); `metrics` (Prometheus counters).
"""

from typing import Any

from sglang_ext.linearkv.initializers import STATE_RULES, get_state_rule
from sglang_ext.linearkv.selectors import SELECTOR_KINDS, Selector, parse_selector
from sglang_ext.linearkv.serving import (
    BACKEND_NAME,
    COMPOSING_RULES,
    DEFAULT_EPIC_K,
    META_KEY,
    NAMESPACE_PREFIX,
    ChunkPlan,
    LinearKVConfig,
    LinearKVConfigError,
    LinearKVRequest,
    capture_of,
    check_server_flags,
    composes,
    epic_k,
    fallback_record,
    is_chunk_namespace,
    keeps_state,
    namespace,
    needs_worker,
    plan_chunks,
    register_hooks,
    request_field,
    spans_of_segments,
    split_by_separator,
    summary,
    tenant_namespace,
)
from sglang_ext.linearkv.serving import parse_config as parse_server_config
from sglang_ext.linearkv.store import ChunkEntry, ChunkReferenceError, ChunkStore, LinearLayerState, chunk_id

#: names served from `sglang_cache` (it imports SGLang), loaded on first use
_FROM_CACHE = ("LinearKVRadixCache", "linearkv_cache_factory", "linearkv_record", "server_linearkv_config")

__all__ = ["STATE_RULES", "get_state_rule", "SELECTOR_KINDS", "Selector", "parse_selector", "ChunkEntry",
           "ChunkReferenceError", "ChunkStore", "LinearLayerState", "chunk_id",
           "BACKEND_NAME", "COMPOSING_RULES", "DEFAULT_EPIC_K", "META_KEY", "NAMESPACE_PREFIX",
           "ChunkPlan", "LinearKVConfig", "LinearKVConfigError", "LinearKVRequest",
           "capture_of", "composes", "epic_k", "check_server_flags", "namespace", "plan_chunks", "spans_of_segments", "split_by_separator",
           "request_field", "summary", "parse_server_config", "fallback_record", "is_chunk_namespace",
           "keeps_state", "tenant_namespace", "register_hooks", "needs_worker", *_FROM_CACHE]


def __getattr__(name: str) -> Any:
    if name in _FROM_CACHE:
        from sglang_ext.linearkv import sglang_cache

        return getattr(sglang_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
