"""SAE's match and insert events: which cached nodes a request read, and which it
added, with the request's token types and session.

Targets (SGLang 0.5.23): `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.match_prefix`
(a request's prefix match: the matched nodes are touched) and
`UnifiedRadixCache.checkpoint_into_tree` (a request's tokens go into the tree, chunk by chunk
and at finish: new nodes are admitted, grown / split ones resized). Subclasses (the
`tail_replay` backend) inherit both. A no-op unless the tree core's eviction strategy is
SAE's (`sglang_ext.eviction.sglang_adapter.strategy_of`).
"""

from __future__ import annotations

import functools

TARGET = ("srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.match_prefix, "
          "UnifiedRadixCache.checkpoint_into_tree")


def _wrap_match(original):
    @functools.wraps(original)
    def match_prefix(self, params):
        result = original(self, params)
        req = getattr(params, "req", None)
        if req is not None and not self.disable:
            from sglang_ext.eviction.sglang_adapter import on_request_path

            on_request_path(self.tree_core, req, result.last_device_node, params.key.token_ids, hit=True)
        return result

    return match_prefix


def _wrap_checkpoint(original):
    @functools.wraps(original)
    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs):
        original(self, req, up_to=up_to, **kwargs)
        if not self.disable:
            from sglang_ext.eviction.sglang_adapter import on_request_path

            on_request_path(self.tree_core, req, req.last_node, req.full_untruncated_fill_ids[:up_to],
                            hit=False)

    return checkpoint_into_tree


def apply() -> None:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    UnifiedRadixCache.match_prefix = _wrap_match(UnifiedRadixCache.match_prefix)
    UnifiedRadixCache.checkpoint_into_tree = _wrap_checkpoint(UnifiedRadixCache.checkpoint_into_tree)
