"""Extend attention in O(new tokens x context) for the `torch_native` backend.

Targets `srt/layers/attention/torch_native_backend.py::TorchNativeAttnBackend.
_run_sdpa_forward_extend` (SGLang 0.5.23). The original builds, per sequence, a query of the
sequence's FULL length (prefix rows left uninitialised), runs causal SDPA over the whole
sequence and keeps the last rows: an extend of a few tokens over a long cached prefix costs
as much as attention over the full sequence, so prefix reuse barely shows in TTFT on CPU.

The replacement runs SDPA for the new tokens' queries only. New token j of a sequence sits at
position prefix + j (where the original places it); a causal layer gives it keys 0..prefix+j,
i.e. a lower-right-aligned causal mask, written out explicitly so that a sliding window (the
original's `_make_sliding_window_mask`, `k >= q - window`) fits in the same mask. Queries go
in blocks sized so a block's mask stays small, and each block reads only the keys it can see.
Everything else is kept as in the original: GQA (`enable_gqa`), `scaling`, non-causal
(encoder-only / cross) layers, `encoder_lens` offsets, req_to_token gathering, KV dtype cast,
output layout. With no prefix and no window it is the original call (`is_causal=True`).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

TARGET = "srt/layers/attention/torch_native_backend.py: TorchNativeAttnBackend._run_sdpa_forward_extend"

#: Most mask entries per SDPA call (CPU SDPA turns a bool mask into a float one of this size).
MASK_ELEMENTS = 1 << 24

#: SGLang's own method, recorded by `apply()` (tests compare against it).
original_run_sdpa_forward_extend = None


def _visible_mask(q_start: int, q_end: int, kv_end: int, window: int | None, device) -> torch.Tensor:
    """[q, k] bool: query at absolute position q sees key k iff k <= q (and k >= q - window)."""
    q_pos = torch.arange(q_start, q_end, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_end, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos >= q_pos - window
    return mask


def run_sdpa_forward_extend(
    self,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None,
    scaling=None,
    enable_gqa=False,
    causal=False,
    is_cross_attn=False,
    sliding_window_size: int | None = None,
):
    """Same arguments and result as SGLang's; query/output are [num_tokens, num_heads, head_size]."""
    assert seq_lens.shape[0] == extend_prefix_lens.shape[0] == extend_seq_lens.shape[0]
    window = sliding_window_size if sliding_window_size is not None and sliding_window_size > -1 else None
    masked = causal or window is not None  # the original applies a window mask even if not causal

    query = query.movedim(0, query.dim() - 2)  # -> [num_heads, num_tokens, head_size]
    seq_lens_l, prefix_l, extend_l = seq_lens.tolist(), extend_prefix_lens.tolist(), extend_seq_lens.tolist()
    encoder_l = encoder_lens.tolist() if encoder_lens is not None else None

    start_q = 0
    for i, (seq_len_kv, prefix, ext) in enumerate(zip(seq_lens_l, prefix_l, extend_l)):
        end_q = start_q + ext
        if ext == 0:
            continue
        if encoder_l is None:
            start_kv, end_kv = 0, seq_len_kv
        elif is_cross_attn:
            start_kv, end_kv = 0, encoder_l[i]
        else:
            start_kv, end_kv = encoder_l[i], encoder_l[i] + seq_len_kv
        tokens = req_to_token[req_pool_indices[i], start_kv:end_kv]
        key = k_cache[tokens].movedim(0, query.dim() - 2)
        value = v_cache[tokens].movedim(0, query.dim() - 2)
        if not (query.dtype == key.dtype == value.dtype):
            key, value = key.to(query.dtype), value.to(query.dtype)

        if not masked or (prefix == 0 and ext == seq_len_kv and window is None):
            # Non-causal: every new query sees every key. No prefix: the original's own call.
            blocks = [(start_q, end_q, key.shape[-2], None)]
            is_causal = masked
        else:
            step = max(1, MASK_ELEMENTS // max(1, seq_len_kv))
            blocks = []
            for b in range(0, ext, step):
                q0, q1 = prefix + b, prefix + min(ext, b + step)  # absolute query positions
                kv_end = min(q1, key.shape[-2])  # keys after the block's last query are masked
                blocks.append((start_q + b, start_q + b + (q1 - q0), kv_end,
                               _visible_mask(q0, q1, kv_end, window, query.device)))
            is_causal = False

        for o0, o1, kv_end, mask in blocks:
            out = scaled_dot_product_attention(
                query[:, o0:o1, :].unsqueeze(0),
                key[..., :kv_end, :].unsqueeze(0),
                value[..., :kv_end, :].unsqueeze(0),
                attn_mask=mask,
                enable_gqa=enable_gqa,
                scale=scaling,
                is_causal=is_causal,
            )
            output[o0:o1, :, :] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start_q = end_q
    return output


def apply() -> None:
    global original_run_sdpa_forward_extend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    current = TorchNativeAttnBackend.__dict__["_run_sdpa_forward_extend"]
    if current is run_sdpa_forward_extend:
        return
    original_run_sdpa_forward_extend = current
    TorchNativeAttnBackend._run_sdpa_forward_extend = run_sdpa_forward_extend
