"""Size the recurrent-state pool for Tail-Replay without checkpoints: only the request's own slots.

Targets `srt/mem_cache/kv_cache_configurator.py::KVCacheConfigurator._calculate_mamba_ratio`
(SGLang 0.5.23), the number of state slots reserved per running request:
`--max-mamba-cache-size N` admits N // ratio running requests. Stock SGLang reserves 3 (the
request's state, a copy-on-write source and the state donated to the tree), plus, under the
`extra_buffer` strategies, the request's ping-pong track slots
(`allocation_sizing.get_mamba_tracking_slots`: 2 with the overlap scheduler, 1 without; the
lazy variant allocates the second one at track boundaries), so 3 / 4 / 5.

With `--radix-cache-backend tail_replay` and `keep_checkpoints: false` the tree holds no states
and nothing is copied into or out of it, so a request holds exactly its own slots, from
admission to finish: its state, plus its ping-pong track slots under `extra_buffer` (the
tracked states are withheld from the tree and freed with the request, see
`sglang_ext/tail_replay/cache.py`). Nothing in the tree can be evicted to make room, so the
lazy variant is sized for the second slot it takes at a boundary. Ratio: 1 (`no_buffer`),
2 (`extra_buffer` without overlap), 3 (`extra_buffer` / `extra_buffer_lazy` with overlap).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TARGET = "srt/mem_cache/kv_cache_configurator.py: KVCacheConfigurator._calculate_mamba_ratio"


def state_slots_per_request(*, extra_buffer: bool, overlap: bool) -> int:
    """State slots a running request holds at most when the tree holds none: its own state,
    plus its ping-pong track slots under `extra_buffer` (both of them for the lazy variant)."""
    from sglang.srt.mem_cache.allocation_sizing import get_mamba_tracking_slots

    return 1 + get_mamba_tracking_slots(extra_buffer=extra_buffer, overlap=overlap, lazy=False)


def tree_holds_no_states() -> bool:
    from sglang.srt.runtime_context import get_memory

    from sglang_ext.tail_replay import BACKEND_NAME, server_config

    return get_memory().radix_cache_backend == BACKEND_NAME and not server_config().knobs.keep_checkpoints


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def _calculate_mamba_ratio(self) -> int:
        if not tree_holds_no_states():
            return original(self)
        from sglang.srt.runtime_context import get_exec, get_schedule

        return state_slots_per_request(extra_buffer=bool(get_exec().mamba.enable_mamba_extra_buffer),
                                       overlap=not get_schedule().disable_overlap_schedule)

    return _calculate_mamba_ratio


def apply() -> None:
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    KVCacheConfigurator._calculate_mamba_ratio = _wrap(KVCacheConfigurator._calculate_mamba_ratio)
