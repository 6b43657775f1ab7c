"""Size the recurrent-state pool for Tail-Replay without checkpoints: one slot per request.

Targets `srt/mem_cache/kv_cache_configurator.py::KVCacheConfigurator._calculate_mamba_ratio`
(SGLang 0.5.23), which reserves ~3 state slots per running request (the request's state, a
copy-on-write source and the state donated to the tree). With `--radix-cache-backend tail_replay`
and `keep_checkpoints: false` the tree holds no states and nothing is copied, so a request needs
exactly its own slot, as with a disabled radix cache: `--max-mamba-cache-size N` then admits N
running requests.
"""

from __future__ import annotations

import functools

TARGET = "srt/mem_cache/kv_cache_configurator.py: KVCacheConfigurator._calculate_mamba_ratio"


def tree_holds_no_states() -> bool:
    from sglang.srt.runtime_context import get_memory

    from sglang_ext.env import read_tail_replay_config
    from sglang_ext.tail_replay.config import BACKEND_NAME

    return (get_memory().radix_cache_backend == BACKEND_NAME
            and not read_tail_replay_config().keep_checkpoints)


def _wrap(original):
    @functools.wraps(original)
    def _calculate_mamba_ratio(self) -> int:
        return 1 if tree_holds_no_states() else original(self)

    return _calculate_mamba_ratio


def apply() -> None:
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    KVCacheConfigurator._calculate_mamba_ratio = _wrap(KVCacheConfigurator._calculate_mamba_ratio)
