"""HiCache's host tier on CPU (`patches/cpu/hicache.py`).

The torch `direct` copies are checked against transcriptions of sgl-kernel's C++ loops
(`csrc/kvcacheio/transfer.cu`: `transfer_kv_direct`, `transfer_kv_page_first_direct_impl`) on
awkward sizes, page sizes, index orders and layer offsets; then SGLang's own host pools
(`MHATokenToKVPoolHost`, `MambaPoolHost`), built unpinned by the patch, take device rows to the
host and back through them. The launcher's HiCache defaults are in tests/test_launcher.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import (stand-in sgl_kernel)

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_ext.patches.cpu import hicache as cpu_hicache  # noqa: E402
from sglang_ext.patches.cpu.hicache import (  # noqa: E402
    GPU_HOST_RESERVE_BYTES,
    cpu_host_reserve_bytes,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_direct,
    transfer_kv_per_layer_direct_pf_lf,
)

GiB = 1 << 30


# --- the C++ loops, transcribed (one slice copy per run / page / layer) ---------------------------

def _kernel_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    src, dst = src_indices.tolist(), dst_indices.tolist()
    start = 0
    for i in range(len(src)):
        if i < len(src) - 1 and src[i + 1] - src[i] == 1 and dst[i + 1] - dst[i] == 1:
            continue
        n = i + 1 - start
        for s, d in zip(src_layers, dst_layers):
            d[dst[start]:dst[start] + n].copy_(s[src[start]:src[start] + n])
        start = i + 1


def _kernel_page_first(src_ptrs, dst_ptrs, src_indices, dst_indices, start_layer_id, page_size, lf_to_pf):
    src, dst = src_indices.tolist(), dst_indices.tolist()
    for i in range(len(src) // page_size):
        if lf_to_pf:
            is_mla = len(dst_ptrs) == 1
            layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
            s, d = src[i * page_size], dst[i * page_size] // page_size
            for j in range(layers):
                for c in range(1 if is_mla else 2):
                    dst_ptrs[c][d][start_layer_id + j][0:page_size].copy_(src_ptrs[j + c * layers][s:s + page_size])
        else:
            is_mla = len(src_ptrs) == 1
            layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
            s, d = src[i * page_size] // page_size, dst[i * page_size]
            for j in range(layers):
                for c in range(1 if is_mla else 2):
                    dst_ptrs[j + c * layers][d:d + page_size].copy_(src_ptrs[c][s][start_layer_id + j][0:page_size])


def _pages(count: int, page_size: int, capacity_pages: int, gen) -> torch.Tensor:
    """Token indices of `count` distinct pages in random order (as SGLang's allocators hand out)."""
    pages = torch.randperm(capacity_pages, generator=gen)[:count]
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def _clone(tensors):
    return [t.clone() for t in tensors]


SIZES = [  # (page_size, layers, heads, head_dim, pages moved, dtype)
    (1, 1, 1, 1, 1, torch.float32),
    (1, 3, 2, 7, 9, torch.float16),
    (3, 2, 3, 5, 4, torch.bfloat16),
    (16, 4, 2, 16, 5, torch.float32),
]


@pytest.mark.parametrize("page_size, layers, heads, dim, moved, dtype", SIZES)
@pytest.mark.parametrize("ordered", [False, True])       # scattered pages, or runs the kernel merges
def test_transfer_kv_direct_equals_the_kernel(page_size, layers, heads, dim, moved, dtype, ordered):
    gen = torch.Generator().manual_seed(page_size * 31 + dim)
    src = [torch.randn(13 * page_size, heads, dim, generator=gen).to(dtype) for _ in range(2 * layers)]
    dst = [torch.randn(11 * page_size, heads, dim, generator=gen).to(dtype) for _ in range(2 * layers)]
    src_idx, dst_idx = _pages(moved, page_size, 13, gen), _pages(moved, page_size, 11, gen)
    if ordered:
        src_idx, dst_idx = src_idx.sort().values, dst_idx.sort().values
    expected = _clone(dst)
    _kernel_direct(src, expected, src_idx, dst_idx, page_size)
    transfer_kv_direct(src, dst, src_idx, dst_idx, page_size)
    for got, want in zip(dst, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("page_size, layers, heads, dim, moved, dtype", SIZES)
@pytest.mark.parametrize("components", [1, 2])          # one buffer (MLA, Mamba states) or K and V
def test_all_layer_lf_pf_equals_the_kernel(page_size, layers, heads, dim, moved, dtype, components):
    gen = torch.Generator().manual_seed(7 * page_size + layers)
    device = [torch.randn(12 * page_size, heads, dim, generator=gen).to(dtype) for _ in range(components * layers)]
    host = [torch.randn(9, layers, page_size, heads, dim, generator=gen).to(dtype) for _ in range(components)]
    device_idx, host_idx = _pages(moved, page_size, 12, gen), _pages(moved, page_size, 9, gen)
    expected = _clone(host)
    _kernel_page_first(device, expected, device_idx, host_idx, 0, page_size, lf_to_pf=True)
    transfer_kv_all_layer_direct_lf_pf(device, host, device_idx, host_idx, page_size)
    for got, want in zip(host, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("page_size, layers, heads, dim, moved, dtype", SIZES)
@pytest.mark.parametrize("components", [1, 2])
def test_per_layer_pf_lf_equals_the_kernel(page_size, layers, heads, dim, moved, dtype, components):
    gen = torch.Generator().manual_seed(5 * page_size + dim)
    host = [torch.randn(9, layers, page_size, heads, dim, generator=gen).to(dtype) for _ in range(components)]
    for layer_id in range(layers):                        # one device layer per component, as SGLang calls it
        device = [torch.randn(12 * page_size, heads, dim, generator=gen).to(dtype) for _ in range(components)]
        host_idx, device_idx = _pages(moved, page_size, 9, gen), _pages(moved, page_size, 12, gen)
        expected = _clone(device)
        _kernel_page_first(host, expected, host_idx, device_idx, layer_id, page_size, lf_to_pf=False)
        transfer_kv_per_layer_direct_pf_lf(host, device, host_idx, device_idx, layer_id, page_size)
        for got, want in zip(device, expected):
            assert torch.equal(got, want)


def test_mamba_shaped_states_round_trip():
    """SGLang's Mamba host pool: [slot, layer, 1, *state] on the host, page size 1, and
    device layers [slot, *state] (a conv window and an SSM state of odd sizes)."""
    gen = torch.Generator().manual_seed(3)
    layers, shape = 3, (5, 3, 7)
    device = [torch.randn(10, *shape, generator=gen) for _ in range(layers)]
    host = torch.zeros(17, layers, 1, *shape)
    device_idx, host_idx = torch.tensor([7, 2, 9]), torch.tensor([16, 0, 5])
    transfer_kv_all_layer_direct_lf_pf(device, [host], device_idx, host_idx, 1)
    for layer in range(layers):
        torch.testing.assert_close(host[host_idx, layer, 0], device[layer][device_idx], rtol=0, atol=0)
        back = torch.zeros(10, *shape)
        transfer_kv_per_layer_direct_pf_lf([host], [back], host_idx, torch.tensor([0, 1, 2]), layer, 1)
        torch.testing.assert_close(back[:3], device[layer][device_idx], rtol=0, atol=0)
        assert not back[3:].any()


def test_empty_transfers_and_bad_arguments():
    layer = torch.zeros(4, 2)
    host = torch.zeros(2, 1, 2, 2)
    empty = torch.empty(0, dtype=torch.long)
    transfer_kv_direct([layer], [layer], empty, empty, 2)
    transfer_kv_all_layer_direct_lf_pf([layer], [host], empty, empty, 2)
    transfer_kv_per_layer_direct_pf_lf([host], [layer], empty, empty, 0, 2)
    with pytest.raises(ValueError, match="same length"):
        transfer_kv_direct([layer], [layer], torch.arange(2), torch.arange(1), 1)
    with pytest.raises(ValueError, match="divisible by page size"):
        transfer_kv_all_layer_direct_lf_pf([layer], [host], torch.arange(3), torch.arange(3), 2)
    with pytest.raises(ValueError, match="same number of layers"):
        transfer_kv_direct([layer, layer], [layer], torch.arange(2), torch.arange(2), 1)


def test_reserve_fits_small_machines_and_keeps_sglangs_on_large_ones():
    assert cpu_host_reserve_bytes(24 * GiB) == 6 * GiB
    assert cpu_host_reserve_bytes(8 * GiB) == 2 * GiB
    assert cpu_host_reserve_bytes(512 * GiB) == GPU_HOST_RESERVE_BYTES


# --- SGLang's own host pools, through the patch ----------------------------------------------------

def test_patch_binds_the_copies_and_the_reserve():
    from sglang.srt.mem_cache.pool_host import base, mamba, mha

    for module in (mha, mamba):
        for name, op in cpu_hicache.TRANSFER_OPS.items():
            assert getattr(module, name) is op
    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES <= GPU_HOST_RESERVE_BYTES
    cpu_hicache.apply()                                    # idempotent
    assert base.HostKVCache.__init__._sglang_ext_patched
    assert base.HostKVCache.__init__.__wrapped__.__name__ == "__init__"
    assert not getattr(base.HostKVCache.__init__.__wrapped__, "_sglang_ext_patched", False)


def _mha_host_pool(page_size: int, layers: int, device_tokens: int, layout: str):
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    gen = torch.Generator().manual_seed(11)
    k = tuple(torch.randn(device_tokens + page_size, 2, 8, generator=gen) for _ in range(layers))
    v = tuple(torch.randn(device_tokens + page_size, 2, 8, generator=gen) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1],
                                           layout=next(iter(KVBufferLayout))),
                         page_size=page_size, head_num=2, head_dim=8, v_head_dim=8,
                         dtype=torch.float32, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout,
                                device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers - 1)
    return pool, k, v


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])   # the launcher's CPU choices
def test_mha_host_pool_is_unpinned_and_round_trips(layout):
    page_size, layers = 4, 2
    pool, k, v = _mha_host_pool(page_size, layers, device_tokens=32, layout=layout)
    assert pool.pin_memory is False
    device_idx = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])
    host_idx = pool.alloc(8)
    pool.backup_from_device_all_layer(None, host_idx, device_idx, "direct")
    want_k, want_v = [t[device_idx].clone() for t in k], [t[device_idx].clone() for t in v]
    for t in (*k, *v):
        t.zero_()
    target = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    for layer in range(layers):
        pool.load_to_device_per_layer(None, host_idx, target, layer, "direct")
        assert torch.equal(k[layer][target], want_k[layer]) and torch.equal(v[layer][target], want_v[layer])
    pool.get_dummy_flat_data_page()                         # pinned on GPUs; a plain tensor here


def test_mamba_host_pool_is_unpinned_and_round_trips():
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    gen = torch.Generator().manual_seed(12)
    layers, slots = 3, 6
    temporal = torch.randn(layers, slots, 4, 5, 3, generator=gen)
    conv = (torch.randn(layers, slots, 11, 3, generator=gen),)
    pool = MambaPoolHost(MambaStateBufferInfo(temporal=temporal, conv=conv), 2.0, 0,
                         device_capacity=slots, layout="page_first_direct")
    assert pool.pin_memory is False
    device_idx, host_idx = torch.tensor([4, 1]), pool.alloc(2)
    pool.backup_from_device_all_layer(None, host_idx, device_idx, "direct")
    want = temporal[:, device_idx].clone(), conv[0][:, device_idx].clone()
    temporal.zero_()
    conv[0].zero_()
    target = torch.tensor([0, 5])
    for layer in range(layers):
        pool.load_to_device_per_layer(None, host_idx, target, layer, "direct")
    assert torch.equal(temporal[:, target], want[0]) and torch.equal(conv[0][:, target], want[1])
    pool.get_dummy_flat_data_page()
