"""Tail-Replay's host tier is KV-only: the `--hicache-size` split gives the state pool's share to KV
(patches/tail_replay/host_pools.py), against SGLang's own split function."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")

import pytest  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler  # noqa: E402

from sglang_ext.patches.tail_replay.host_pools import ONE_SLOT_GB, kv_only_split  # noqa: E402

#: SGLang's split, unwrapped
split = assembler._split_hicache_size.__wrapped__


class KV:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def get_kv_size_bytes(self):
        return (self.nbytes // 2, self.nbytes - self.nbytes // 2)


class States(KV):
    mamba_cache = object()

    def get_kv_size_bytes(self):
        return self.nbytes


def is_state(pool) -> bool:
    return hasattr(pool, "mamba_cache")


def test_sglang_splits_by_device_pool_size_and_tail_replay_gives_kv_everything():
    kv, states = KV(1 << 20), States(3 << 20)
    assert split(8, (kv, states)) == pytest.approx((2.0, 6.0))         # stock: 1 : 3
    assert kv_only_split(8, (kv, states), is_state, split) == (8.0, ONE_SLOT_GB)


def test_several_kv_pools_keep_their_proportions():
    full, swa, states = KV(3 << 20), KV(1 << 20), States(4 << 20)
    assert kv_only_split(8, (full, swa, states), is_state, split) == pytest.approx((6.0, 2.0, ONE_SLOT_GB))


def test_without_a_state_pool_the_split_is_sglangs():
    pools = (KV(1 << 20), KV(1 << 20))
    assert kv_only_split(4, pools, is_state, split) == split(4, pools)


def test_the_patch_is_installed_on_sglangs_assembler():
    assert getattr(assembler._split_hicache_size, "_sglang_ext_patched", False)
    assert getattr(assembler.build_mamba_host_pool, "_sglang_ext_patched", False)
