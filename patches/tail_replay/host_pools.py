"""Tail-Replay without checkpoints: its host tier holds attention KV only, so its whole HiCache
budget goes to KV.

Targets `srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py` (SGLang 0.5.23):
`_split_hicache_size` (with `--hicache-size S`, S GB are split between the host KV pool and the
host state pool in proportion to their device pools; a hybrid model's state pool is often the
larger one) and `build_mamba_host_pool` (the host state pool: the split's share, or, with
`--hicache-ratio r`, r times the device state slots).

Under `--radix-cache-backend tail_replay` with the config `keep_checkpoints: false` the tree
holds no state, so none goes to the host (a replay rebuilds the linear state from KV:
`TailReplayMambaComponent` in sglang_ext/tail_replay/cache.py backs none up and loads none back),
and that pool would be host memory never used. (With checkpoints, states go to the host as on
stock SGLang, and SGLang's sizing stays.) Here the KV host pool gets all of S (with `--hicache-ratio`, its size is
SGLang's: r times the device KV), and the state pool one slot (SGLang's pool group wants the
pool to exist). Every other backend is untouched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TARGET = ("srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py: _split_hicache_size, build_mamba_host_pool")

#: a host size (GB) below one state slot: SGLang's MambaPoolHost then holds a single slot
ONE_SLOT_GB = 1e-12


def kv_only_split(hicache_size: float, pools: tuple[Any, ...], is_state_pool: Callable[[Any], bool],
                  split: Callable[[float, tuple[Any, ...]], tuple[float, ...]]) -> tuple[float, ...]:
    """`split`'s sizes with the state pools' shares given to the others (pure but for `split`)."""
    kv_pools = tuple(pool for pool in pools if not is_state_pool(pool))
    if not kv_pools or len(kv_pools) == len(pools):
        return split(hicache_size, pools)
    kv_sizes = iter(split(hicache_size, kv_pools))
    return tuple(ONE_SLOT_GB if is_state_pool(pool) else next(kv_sizes) for pool in pools)


def _is_state_pool(pool: Any) -> bool:
    return hasattr(pool, "mamba_cache")


def _tail_replay() -> bool:
    """Tail-Replay, with a tree that holds no states."""
    from sglang.srt.runtime_context import get_memory

    from sglang_ext.tail_replay import BACKEND_NAME, server_config

    return get_memory().radix_cache_backend == BACKEND_NAME and not server_config().knobs.keep_checkpoints


def _wrap_split(original: Callable) -> Callable:
    @functools.wraps(original)
    def _split_hicache_size(hicache_size, kv_pools):
        if not _tail_replay():
            return original(hicache_size, kv_pools)
        return kv_only_split(hicache_size, tuple(kv_pools), _is_state_pool, original)

    _split_hicache_size._sglang_ext_patched = True
    return _split_hicache_size


def _wrap_state_pool(original: Callable) -> Callable:
    @functools.wraps(original)
    def build_mamba_host_pool(mamba_pool, pool_info, *, host_size, **kwargs):
        if _tail_replay():
            logger.info("Tail-Replay without checkpoints: the host tier holds attention KV only; "
                        "the host state pool gets one slot")
            host_size = ONE_SLOT_GB
        return original(mamba_pool, pool_info, host_size=host_size, **kwargs)

    build_mamba_host_pool._sglang_ext_patched = True
    return build_mamba_host_pool


def apply() -> None:
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    if not getattr(assembler._split_hicache_size, "_sglang_ext_patched", False):
        assembler._split_hicache_size = _wrap_split(assembler._split_hicache_size)
    if not getattr(assembler.build_mamba_host_pool, "_sglang_ext_patched", False):
        assembler.build_mamba_host_pool = _wrap_state_pool(assembler.build_mamba_host_pool)
