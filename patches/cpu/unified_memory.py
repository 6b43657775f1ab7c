"""`--enable-unified-memory` on the CPU server: `torch_native` attention on the unified pool.

Targets (SGLang 0.5.23):

- `srt/arg_groups/kv_cache_hook.py::handle_page_major_kv_layout` (~line 787): the unified pool
  implies `--enable-page-major-kv-layout`, whose allow-list of full-attention backends (~line 822,
  a local set: fa3/fa4/flashinfer/triton/trtllm_mha) refuses `torch_native`, the CPU server's
  backend. The allow-list admits "every backend that reads through the translator"; `torch_native`
  does with the seam below, so it is checked as `triton` (the same per-layer strided views, the
  same linear-attention and Mamba backend checks). The step is wrapped through SGLang's own
  `register_resolution_hook`.
- `srt/layers/attention/torch_native_backend.py::TorchNativeAttnBackend.forward_extend` and
  `forward_decode`: on the unified pool `req_to_token` holds VIRTUAL token ids and the pool's
  write door takes physical ids only (`KVCache._check_physical_write_loc`). The iteration's plan
  (`KVLocPlan.bind`) has already made `forward_batch.out_cache_loc` physical, so the write goes
  through `KVWriteLoc.for_batch` (which carries that mark); the reads gather through a copy of the
  batch's `req_to_token` rows, cut to the batch's longest sequence, translated by the allocator
  (`translate_kv_loc`: physical = v2p[t // page] * page + t % page; an unmapped id reads the
  page-0 sink). On a plain pool both
  methods are SGLang's (or the CPU patch set's) unchanged.

- `srt/mem_cache/allocator/unified_sub_pool.py` (module globals `alloc_extend_kernel`,
  `alloc_decode_kernel`): the unified pool's paged allocator (`MultiEndedAllocator.alloc_extend` /
  `alloc_decode`, page size > 1) launches SGLang's Triton page-allocation kernels unconditionally;
  on CPU they run as SGLang's own torch twins (`allocator.paged.alloc_extend_naive` /
  `alloc_decode_naive`, what the static paged allocator runs without Triton), through a launcher
  that takes the kernels' `[grid](...)` call.
- `MultiEndedAllocator.__init__` and `._settle_inflight_forward` (same module): the allocator waits
  for the forward through CUDA streams (`torch.cuda.current_stream().wait_stream(forward_stream)`
  on a free, `.wait_event(forward_done)` before a compaction pass). On CPU a forward has run to
  its end when the scheduler goes on (the overlap scheduler included), so the allocator keeps no
  forward stream and settles the last forward on its own event (`torch.cpu.Event.synchronize`).

Applied only where `torch.cuda.is_available()` is False; a no-op when applied twice.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

TARGET = ("srt/arg_groups/kv_cache_hook.py: handle_page_major_kv_layout; "
          "srt/layers/attention/torch_native_backend.py: TorchNativeAttnBackend.forward_extend, "
          "TorchNativeAttnBackend.forward_decode; "
          "srt/mem_cache/allocator/unified_sub_pool.py: alloc_extend_kernel, alloc_decode_kernel, "
          "MultiEndedAllocator.__init__, MultiEndedAllocator._settle_inflight_forward")

CPU_BACKEND = "torch_native"
#: the audited backend `torch_native` is checked as (same strided per-layer views)
CHECKED_AS = "triton"
_registered: list[bool] = []


def _page_major_hook(server_args, previous) -> None:
    """Run SGLang's step with `torch_native` read as `triton` in its backend allow-list."""
    from sglang.srt.arg_groups import kv_cache_hook

    original = kv_cache_hook.attention_backends_of

    def attention_backends_of(view):
        return tuple(CHECKED_AS if b == CPU_BACKEND else b for b in original(view))

    kv_cache_hook.attention_backends_of = attention_backends_of
    try:
        previous(server_args)
    finally:
        kv_cache_hook.attention_backends_of = original


def _translator(backend):
    """The allocator's `translate_kv_loc` when the runner's KV ids are virtual (a unified pool:
    `KVIndexTranslator.is_translating`), else None."""
    translator = getattr(backend, "_sglang_ext_kv_index_translator", None)
    if translator is None or not translator.is_translating:
        return None
    return backend._sglang_ext_allocator.translate_kv_loc


def translated_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, width: int, translate) -> torch.Tensor:
    """A table with `req_to_token`'s rows cut to its first `width` columns (the batch's longest
    sequence: the reads go no further), whose batch rows hold physical ids (others the sink).
    Translating only those columns keeps the cost with the batch's tokens, not the pool's
    `max_context_len` per row (the whole table per attention layer was over half of the scheduler's
    time on a unified pool)."""
    width = max(0, min(int(width), req_to_token.shape[1]))
    table = req_to_token.new_zeros((req_to_token.shape[0], width))
    rows = req_pool_indices.to(torch.int64)
    table[rows] = translate(req_to_token[rows, :width]).to(req_to_token.dtype)
    return table


def _batch_width(forward_batch) -> int:
    """The longest sequence of the batch (the end of every row's reads)."""
    seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
    if seq_lens is None:
        seq_lens = forward_batch.seq_lens
    return int(seq_lens.max().item()) if seq_lens.numel() else 0


@contextlib.contextmanager
def _physical_reads(backend, forward_batch, translate):
    real = backend.req_to_token_pool
    table = translated_rows(real.req_to_token, forward_batch.req_pool_indices, _batch_width(forward_batch), translate)
    backend.req_to_token_pool = types.SimpleNamespace(req_to_token=table)
    try:
        yield
    finally:
        backend.req_to_token_pool = real


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        translate = _translator(self)
        if translate is None or layer.is_cross_attention:
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc.for_batch(forward_batch, swa_loc=self.swa_out_cache_loc), k, v)
        with _physical_reads(self, forward_batch, translate):
            return original(self, q, k, v, layer, forward_batch, False, **kwargs)

    forward._sglang_ext_patched = True
    return forward


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, model_runner, *args, **kwargs):
        original(self, model_runner, *args, **kwargs)
        self._sglang_ext_allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
        self._sglang_ext_kv_index_translator = getattr(model_runner, "kv_index_translator", None)

    __init__._sglang_ext_patched = True
    return __init__


class _TorchLaunch:
    """A Triton kernel's `kernel[grid](*args)` call, run by its torch twin (`run(*args)`)."""

    _sglang_ext_patched = True

    def __init__(self, run) -> None:
        self.run = run

    def __getitem__(self, grid):
        return self.run


def _extend_twin(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size):
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)


def _decode_twin(seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size):
    from sglang.srt.mem_cache.allocator.paged import alloc_decode_naive

    new_pages = int(((seq_lens - 1) % page_size == 0).sum())   # a request whose new token opens a page
    alloc_decode_naive(seq_lens, last_loc, free_pages, out_indices, page_size, new_pages)


def _settle_inflight_forward(self) -> None:
    """The last forward's own event, not a CUDA stream wait (CPU)."""
    event = self._latest_forward_done_event
    if event is not None:
        event.synchronize()
        self._inflight_forward = None


_settle_inflight_forward._sglang_ext_patched = True


def _wrap_allocator_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.forward_stream = None   # a CPU forward has run to its end when the scheduler goes on

    __init__._sglang_ext_patched = True
    return __init__


def apply() -> None:
    if torch.cuda.is_available():
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not _registered:
        register_resolution_hook("handle_page_major_kv_layout")(_page_major_hook)
        _registered.append(True)
    if not getattr(TorchNativeAttnBackend.__init__, "_sglang_ext_patched", False):
        TorchNativeAttnBackend.__init__ = _wrap_init(TorchNativeAttnBackend.__init__)
    for name in ("forward_extend", "forward_decode"):
        method = getattr(TorchNativeAttnBackend, name)
        if not getattr(method, "_sglang_ext_patched", False):
            setattr(TorchNativeAttnBackend, name, _wrap_forward(method))
    from sglang.srt.mem_cache.allocator import unified_sub_pool

    if not getattr(unified_sub_pool.alloc_extend_kernel, "_sglang_ext_patched", False):
        unified_sub_pool.alloc_extend_kernel = _TorchLaunch(_extend_twin)
        unified_sub_pool.alloc_decode_kernel = _TorchLaunch(_decode_twin)
    allocator = unified_sub_pool.MultiEndedAllocator
    if not getattr(allocator.__init__, "_sglang_ext_patched", False):
        allocator.__init__ = _wrap_allocator_init(allocator.__init__)
        allocator._settle_inflight_forward = _settle_inflight_forward
