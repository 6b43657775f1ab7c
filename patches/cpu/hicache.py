"""SGLang's hierarchical cache (HiCache, the host tier L2) on CPU, with a driverless CUDA torch.

On the CPU engine the "device" pools already live in host RAM; HiCache's host tier is a second
set of host buffers, written through from the device pools and loaded back on a host hit. Three
things stop SGLang 0.5.23 from building or using that tier without a CUDA driver; each is
patched at its own seam, and only where `torch.cuda.is_available()` is False:

TARGET 1, pinned host buffers: `srt/mem_cache/pool_host/base.py::HostKVCache.__init__` (every
  token-indexed host pool: MHA, MLA, DSA, ... reach it through `super().__init__`) and
  `srt/mem_cache/pool_host/mamba.py::MambaPoolHost.__init__` (which does not) take `pin_memory`,
  default True and never passed by the pool assembler. True sends the allocation through
  `pool_host/common.py::alloc_with_host_register` -> `_cuda_host_register`
  (`torch.cuda.cudart().cudaHostRegister`: "Found no NVIDIA driver"), and the pools' dummy pages
  through `torch.zeros(..., pin_memory=True)` (same error). Pinning only serves asynchronous
  host-to-GPU DMA; without a GPU the pools are built with `pin_memory=False` (plain mmap'd host
  buffers from SGLang's own allocator), so their flag stays truthful for every later reader
  (`destroy`, `make_kernel_ptr_table`, dummy pages).

TARGET 2, the transfer copies: `srt/mem_cache/pool_host/mha.py` and `pool_host/mamba.py` import
  `transfer_kv_direct`, `transfer_kv_per_layer_direct_pf_lf` and
  `transfer_kv_all_layer_direct_lf_pf` from `sgl_kernel.kvcacheio` only on CUDA/ROCm (XPU from
  its own wheel), so on CPU the names do not exist and the first write-through raises NameError.
  Those are the `direct` io backend's copies, which in sgl-kernel are plain slice copies
  (`csrc/kvcacheio/transfer.cu::transfer_page_direct`), so the torch versions below are exact:
  index gathers and `index_copy_`s with the kernels' layout and index conventions
  (`_kernel_*` in tests/patches/test_cpu_hicache.py transcribe the C++ loops as references).
  The `kernel` io backend's CUDA kernels get no stand-in: the CPU launcher selects `direct`
  (`--hicache-io-backend direct --hicache-mem-layout page_first_direct`, the layout the Mamba
  host pool requires) and refuses the others.

TARGET 3, the host-RAM reserve: `srt/mem_cache/pool_host/base.py::HICACHE_HOST_MEMORY_RESERVE_BYTES`
  (10 GiB), which `host_memory_budget_bytes` subtracts from available host memory before any
  host pool is booked (and which HiCache's auto-sizing, `hicache_auto_size.py`, starts from). A
  fixed 10 GiB fits a GPU server's host; on a small CPU box it is most of the machine (on this
  24 GiB one, a neighbour using 12 GiB makes the server refuse even a few-KB host pool). On CPU
  the reserve becomes min(10 GiB, total RAM / 4) (6 GiB here): still checked, still subtracted,
  scaled to the machine. The checks themselves are untouched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

TARGET = ("srt/mem_cache/pool_host/base.py: HostKVCache.__init__ (pin_memory), "
          "HICACHE_HOST_MEMORY_RESERVE_BYTES; "
          "srt/mem_cache/pool_host/mamba.py: MambaPoolHost.__init__ (pin_memory); "
          "srt/mem_cache/pool_host/{mha,mamba}.py: transfer_kv_direct, "
          "transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf")

#: SGLang's reserve, and the share of total RAM it may take on CPU
GPU_HOST_RESERVE_BYTES = 10 * (1 << 30)
CPU_RESERVE_SHARE = 4


# --- TARGET 2: the `direct` io backend's copies, in torch ---------------------------------------

def _check(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("Source and destination indices must have the same length")
    if page_size <= 0:
        raise ValueError("Page size must be positive")
    if src_indices.numel() % page_size:
        raise ValueError("Source indices size must be divisible by page size")


def _long(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return indices.reshape(-1).to(device=device, dtype=torch.long)


def _token_rows(first: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each page's token rows from its first token's row, as the kernel addresses them."""
    if page_size == 1:
        return first
    return (first[:, None] + torch.arange(page_size, device=first.device)).reshape(-1)


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """`sgl_kernel.kvcacheio.transfer_kv_direct`: for every layer, row dst_indices[i] of
    dst_layers[j] <- row src_indices[i] of src_layers[j] (both token-major, layer-first)."""
    if len(src_layers) != len(dst_layers):
        raise ValueError("Source and destination layers must have the same number of layers")
    _check(src_indices, dst_indices, page_size)
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, _long(src_indices, src.device))
        dst.index_copy_(0, _long(dst_indices, dst.device), rows.to(device=dst.device, dtype=dst.dtype))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       layer_id: int, page_size: int) -> None:
    """`sgl_kernel.kvcacheio.transfer_kv_per_layer_direct_pf_lf`: host page-first -> device
    layer-first. `src_ptrs` is [host] (one component, "MLA"; also Mamba states) or [host K, host V],
    each host buffer [page, layer, page_size, ...]; `dst_ptrs` holds that many device layers per
    component (K layers then V layers), each [token, ...]. Page p = src_indices[p * page_size] //
    page_size of host layer layer_id + j goes to device rows dst_indices[p * page_size] + 0..page_size-1
    of dst layer j."""
    _check(src_indices, dst_indices, page_size)
    if src_indices.numel() == 0:
        return
    components = len(src_ptrs)
    if components not in (1, 2) or len(dst_ptrs) % components:
        raise ValueError(f"expected 1 or 2 host buffers and a whole number of device layers each, "
                         f"got {components} and {len(dst_ptrs)}")
    num_layers = len(dst_ptrs) // components
    host = src_ptrs[0]
    host_pages = _long(src_indices, host.device)[::page_size] // page_size
    first_rows = _long(dst_indices, dst_ptrs[0].device)[::page_size]
    device_rows = _token_rows(first_rows, page_size)
    for c, host in enumerate(src_ptrs):
        for j in range(num_layers):
            dst = dst_ptrs[c * num_layers + j]
            pages = host.select(1, layer_id + j).index_select(0, host_pages)   # [pages, page_size, ...]
            values = pages.reshape(device_rows.numel(), *pages.shape[2:])
            dst.index_copy_(0, device_rows.to(dst.device), values.to(device=dst.device, dtype=dst.dtype))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       page_size: int) -> None:
    """`sgl_kernel.kvcacheio.transfer_kv_all_layer_direct_lf_pf`: device layer-first -> host
    page-first, every layer. `dst_ptrs` is [host] or [host K, host V] ([page, layer, page_size, ...]);
    `src_ptrs` holds the device layers per component (K layers then V layers). Device rows
    src_indices[p * page_size] + 0..page_size-1 of layer j go to host page
    dst_indices[p * page_size] // page_size, layer j."""
    _check(src_indices, dst_indices, page_size)
    if src_indices.numel() == 0:
        return
    components = len(dst_ptrs)
    if components not in (1, 2) or len(src_ptrs) % components:
        raise ValueError(f"expected 1 or 2 host buffers and a whole number of device layers each, "
                         f"got {components} and {len(src_ptrs)}")
    num_layers = len(src_ptrs) // components
    host_pages = _long(dst_indices, dst_ptrs[0].device)[::page_size] // page_size
    device_rows = _token_rows(_long(src_indices, src_ptrs[0].device)[::page_size], page_size)
    for c, host in enumerate(dst_ptrs):
        for j in range(num_layers):
            src = src_ptrs[c * num_layers + j]
            rows = src.index_select(0, device_rows.to(src.device))
            pages = rows.reshape(host_pages.numel(), page_size, *rows.shape[1:])
            host.select(1, j).index_copy_(0, host_pages.to(host.device),
                                          pages.to(device=host.device, dtype=host.dtype))


TRANSFER_OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}


# --- TARGET 1: host pools without pinning --------------------------------------------------------

def _unpinned(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if not torch.cuda.is_available():
            kwargs["pin_memory"] = False
        return original(self, *args, **kwargs)

    __init__._sglang_ext_patched = True
    return __init__


# --- TARGET 3: the reserve -----------------------------------------------------------------------

def cpu_host_reserve_bytes(total_bytes: int) -> int:
    """SGLang's 10 GiB reserve, capped at a quarter of the machine's RAM."""
    return min(GPU_HOST_RESERVE_BYTES, total_bytes // CPU_RESERVE_SHARE)


def apply() -> None:
    if torch.cuda.is_available():
        return
    import psutil
    from sglang.srt.mem_cache.pool_host import base, mamba, mha

    for cls in (base.HostKVCache, mamba.MambaPoolHost):
        if not getattr(cls.__init__, "_sglang_ext_patched", False):
            cls.__init__ = _unpinned(cls.__init__)
    for module in (mha, mamba):
        for name, op in TRANSFER_OPS.items():
            if getattr(module, name, None) is None:   # never shadow a real kernel
                setattr(module, name, op)
    reserve = cpu_host_reserve_bytes(psutil.virtual_memory().total)
    if reserve < base.HICACHE_HOST_MEMORY_RESERVE_BYTES:
        base.HICACHE_HOST_MEMORY_RESERVE_BYTES = reserve
