"""Exact-KV Tail-Replay, part 2: every attention layer sees the tree's exact cached K/V for the
replayed tail.

Target (SGLang 0.5.23): `srt/layers/radix_attention.py::RadixAttention.forward`. Before the
attention backend stores and reads K/V, the tail rows of k / v (found by
`patches/tail_replay_batch.py`) are replaced by the cached values. Because the substitution
happens ahead of the backend, it holds for every backend (ragged or paged), and the tail's freshly
allocated KV slots receive exact copies (freed as duplicates on insert).
"""

from __future__ import annotations

import functools

from patches.tail_replay_batch import tail_of

TARGET = "srt/layers/radix_attention.py: RadixAttention.forward"


def substitute_cached_kv(layer, k, v, rows, slots, pool) -> None:
    """k, v: [tokens, heads, dim] (post-RoPE); overwrite the tail rows with the pool's values."""
    k_cached = pool.get_key_buffer(layer.layer_id)[slots]
    v_cached = pool.get_value_buffer(layer.layer_id)[slots]
    if k_cached.dtype != k.dtype and k_cached.element_size() < 2:
        raise NotImplementedError("exact-KV Tail-Replay needs an unquantized KV cache; "
                                  "use kv_mode 'recompute' with an fp8 KV cache")
    k[rows] = k_cached.view(-1, *k.shape[1:]).to(k.dtype)
    v[rows] = v_cached.view(-1, *v.shape[1:]).to(v.dtype)


def _wrap_attention_forward(original):
    @functools.wraps(original)
    def forward(self, q, k, v, forward_batch, *args, **kwargs):
        tail = tail_of(forward_batch) if k is not None and "k_rope" not in kwargs else None
        if tail is not None and forward_batch.forward_mode.is_extend():
            k = k.view(-1, self.tp_k_head_num, self.qk_head_dim)
            v = v.view(-1, self.tp_v_head_num, self.v_head_dim)
            substitute_cached_kv(self, k, v, *tail)
        return original(self, q, k, v, forward_batch, *args, **kwargs)

    return forward


def apply() -> None:
    from sglang.srt.layers.radix_attention import RadixAttention

    RadixAttention.forward = _wrap_attention_forward(RadixAttention.forward)
