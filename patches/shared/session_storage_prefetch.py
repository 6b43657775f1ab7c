"""A streaming session's turn on a server with HiCache's storage tier: no storage prefetch, no crash.

Targets (SGLang 0.5.23) `srt/managers/scheduler.py::Scheduler._prefetch_kvcache` (~line 3342), which
runs for every request that enters the waiting queue when `--hicache-storage-backend` is set, and
asks the tree about the request's `last_host_node` (`is_backuped`, `is_root`, in buffer mode
`get_last_hash_value`): `srt/mem_cache/unified_radix_cache.py::UnifiedRadixCache` (~line 2022). A
turn of a streaming session (`--enable-streaming-session`) matched its session's slot, whose match
returns the slot's stand-in node (`srt/session/streaming_session.py::_VirtualNode`) as
`last_host_node`; the tree has no such node and raises `KeyError` in the scheduler, which kills the
server (found by the exactness fuzzer's `l3` configuration on the first session turn that follows
another turn; stock SGLang's hybrid cache takes the same path).

A session's turn continues its own slot's KV: there is nothing for the storage tier to add. The
three queries answer for a stand-in node as for a node that is neither the root nor backed up (no
hash), so `_prefetch_kvcache` prefetches nothing for it; every other node is answered by SGLang.
Applied in both modes: the bug is SGLang's, on GPUs too.
"""

from __future__ import annotations

import functools

TARGET = ("srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.is_backuped / is_root / get_last_hash_value "
          "(called by srt/managers/scheduler.py: Scheduler._prefetch_kvcache with a session's stand-in node)")

#: what each query answers for a session slot's stand-in node
_STAND_IN_ANSWER = {"is_backuped": False, "is_root": False, "get_last_hash_value": None}


def _wrap(original, answer):
    from sglang.srt.session.streaming_session import is_virtual_node

    @functools.wraps(original)
    def query(self, node_id, *args, **kwargs):
        if is_virtual_node(node_id):
            return answer
        return original(self, node_id, *args, **kwargs)

    query._sglang_ext_patched = True
    return query


def apply() -> None:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    for name, answer in _STAND_IN_ANSWER.items():
        method = getattr(UnifiedRadixCache, name)
        if not getattr(method, "_sglang_ext_patched", False):
            setattr(UnifiedRadixCache, name, _wrap(method, answer))
