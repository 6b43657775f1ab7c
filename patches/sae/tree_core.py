"""SAE needs the Python tree core: the compiled (Rust) tree core evicts by the built-in
policy names only, so a Python policy object is never consulted there.

Target (SGLang 0.5.23): `srt/mem_cache/unified_cache/tree_core_registry.py:
resolve_tree_core_backend`, SGLang's own compatibility fallback ("rust" -> "python" when a
feature needs the Python core, e.g. the session radix cache). With `eviction_policy == "sae"`
the resolution is "python" (logged once), whatever the backend: the default backend and
`--radix-cache-backend tail_replay` (which already runs the Python core) alike. An explicit
non-Rust, non-Python backend with sae is refused naming both.
"""

from __future__ import annotations

import functools
import logging

TARGET = "srt/mem_cache/unified_cache/tree_core_registry.py: resolve_tree_core_backend"
logger = logging.getLogger(__name__)


def _wrap(original):
    @functools.wraps(original)
    def resolve_tree_core_backend(name, params):
        from sglang_ext.eviction.sglang_adapter import POLICY_NAME

        if str(getattr(params, "eviction_policy", "") or "").lower() != POLICY_NAME:
            return original(name, params)
        if name not in ("rust", "python"):
            raise ValueError(f"--radix-eviction-policy {POLICY_NAME} needs the Python tree core; "
                             f"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND={name!r} is not it")
        if name == "rust":
            logger.info("Using the Python TreeCore: --radix-eviction-policy %s is a Python policy", POLICY_NAME)
        return "python"

    return resolve_tree_core_backend


def apply() -> None:
    from sglang.srt.mem_cache.unified_cache import tree_core_registry

    tree_core_registry.resolve_tree_core_backend = _wrap(tree_core_registry.resolve_tree_core_backend)
