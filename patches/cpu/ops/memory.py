"""KV-pool bookkeeping ops (targets `sgl_kernel/{speculative,kvcacheio}.py` CPU ops)."""

from __future__ import annotations

import ctypes


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[r_b, start_b:end_b] = the b-th run of out_cache_loc (runs packed in order)."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[pos:pos + e - s].to(req_to_token.dtype)
        pos += e - s


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer (base pointer, row stride in bytes): row[tgt_i] = row[src_i]."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)
