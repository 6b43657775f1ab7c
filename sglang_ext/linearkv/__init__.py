"""LinearKV: position-independent chunk caching for hybrid models (attention + GDN / Mamba-2).

Pure core (no SGLang import): `store` (chunk cache keyed by content and model), `initializers`
(seeds for the linear layers' recomputed spans), `selectors` (which tokens to recompute), `ops`
(state composition, key re-rotation; backed by `hybrid_kernels`). `reference` runs the method over
transformers models (registration, assembly, greedy decode) as the ground truth the SGLang adapter
must reproduce.

Serving (`--radix-cache-backend linearkv`), pure: `config` (the server's config, selectors and
state rules, namespaces), `plan` (a request's chunk plan), `serving` (the per-request record and
its summary; also serves the names of `config` and `plan`), `metrics` (Prometheus counters). The
SGLang adapter, served from here on first use (so importing this face loads no SGLang module):
`sglang_cache` (match and release), `assembly` (admission), `mamba_component` (state rules per
request kind), `model_layers` (rotary layers, KV relocation), `prepass` (EPIC's heads in the
worker), `factory` (start-up).
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

#: names served from the SGLang adapter's modules (they import SGLang), loaded on first use
_FROM_ADAPTER = {"LinearKVRadixCache": "sglang_cache", "linearkv_record": "sglang_cache",
                 "linearkv_cache_factory": "factory", "server_linearkv_config": "factory"}
_FROM_CACHE = tuple(_FROM_ADAPTER)

__all__ = ["STATE_RULES", "get_state_rule", "SELECTOR_KINDS", "Selector", "parse_selector", "ChunkEntry",
           "ChunkReferenceError", "ChunkStore", "LinearLayerState", "chunk_id",
           "BACKEND_NAME", "COMPOSING_RULES", "DEFAULT_EPIC_K", "META_KEY", "NAMESPACE_PREFIX",
           "ChunkPlan", "LinearKVConfig", "LinearKVConfigError", "LinearKVRequest",
           "capture_of", "composes", "epic_k", "check_server_flags", "namespace", "plan_chunks", "spans_of_segments", "split_by_separator",
           "request_field", "summary", "parse_server_config", "fallback_record", "is_chunk_namespace",
           "keeps_state", "tenant_namespace", "register_hooks", "needs_worker", *_FROM_CACHE]


def __getattr__(name: str) -> Any:
    if name in _FROM_ADAPTER:
        import importlib

        return getattr(importlib.import_module(f"sglang_ext.linearkv.{_FROM_ADAPTER[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
