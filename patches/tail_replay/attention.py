"""Exact-KV Tail-Replay, part 2: every attention layer sees the tree's exact cached K/V for the
replayed tail.

Target (SGLang 0.5.23): `srt/layers/radix_attention.py`, both places where an extend's attention
runs:

- `RadixAttention._eager_attention`, the `@eager_on_graph` function that SGLang's breakable prefill
  CUDA graph (the CUDA default) leaves out of the captured segments. Its body is recorded at capture
  and called again at every replay, reading the batch through `get_forward_batch()` ("request state
  must be read inside the eager function at execution time"). The substitution runs inside that
  body, so it executes on every replay with the replayed batch's tail. The decorator keeps the
  undecorated body (`__wrapped__`) and the replay closure calls that body, not the attribute on the
  class, so wrapping the decorated attribute would run only at capture: `apply()` wraps the body and
  decorates the wrapper again with SGLang's own `eager_on_graph`.
- `RadixAttention.forward`, for extends that run outside any prefill graph (no graph, CPU): the
  tail rows are substituted before the backend is called. Inside a prefill graph scope `forward` is
  being captured, so it substitutes nothing there (a capture-time index would replay stale rows).

Under SGLang's "full" prefill graph nothing runs eagerly at replay; batches with a tail are sent
to the eager path instead (`patches/tail_replay/prefill_graph.py`).

Before the attention backend stores and reads K/V, the tail rows of k / v (found by
`patches/tail_replay/batch.py`) are replaced by the cached values. Because the substitution
happens ahead of the backend, it holds for every backend (ragged or paged), and the tail's freshly
allocated KV slots receive exact copies (freed as duplicates on insert).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.patches.tail_replay.batch import tail_of

TARGET = ("srt/layers/radix_attention.py: RadixAttention._eager_attention (@eager_on_graph body) "
          "and RadixAttention.forward")

#: set on the eager body this module installs, so `apply()` is idempotent and tests can find it
MARK = "_sglang_ext_exact_kv"


def substitute_cached_kv(layer: Any, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                         slots: torch.Tensor, pool: Any) -> None:
    """k, v: [tokens, heads, dim] (post-RoPE); overwrite the tail rows with the pool's values."""
    k_cached = pool.get_key_buffer(layer.layer_id)[slots]
    v_cached = pool.get_value_buffer(layer.layer_id)[slots]
    if k_cached.dtype != k.dtype and k_cached.element_size() < 2:
        raise NotImplementedError("exact-KV Tail-Replay needs an unquantized KV cache; "
                                  "use kv_mode 'recompute' with an fp8 KV cache")
    k[rows] = k_cached.view(-1, *k.shape[1:]).to(k.dtype)
    v[rows] = v_cached.view(-1, *v.shape[1:]).to(v.dtype)


def substitute_for_batch(layer: Any, k: torch.Tensor | None, v: torch.Tensor | None, forward_batch: Any,
                         kwargs: dict) -> bool:
    """Substitute the tail rows of this extend batch (or a copy of it) into k / v in place.
    Returns whether anything was substituted. MLA-style calls (`k_rope`) are left alone."""
    if k is None or v is None or "k_rope" in kwargs or not forward_batch.forward_mode.is_extend():
        return False
    tail = tail_of(forward_batch)
    if tail is None:
        return False
    k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
    substitute_cached_kv(layer, k, v, *tail)
    return True


def _wrap_attention_forward(original: Callable) -> Callable:
    from sglang.srt.model_executor.runner_utils.prefill_graph import is_in_prefill_graph_scope

    @functools.wraps(original)
    def forward(self, q, k, v, forward_batch, *args, **kwargs):
        if not is_in_prefill_graph_scope():
            substitute_for_batch(self, k, v, forward_batch, kwargs)
        return original(self, q, k, v, forward_batch, *args, **kwargs)

    return forward


def substituting_eager_body(body: Callable) -> Callable:
    """The `_eager_attention` body with the substitution first; to be decorated `@eager_on_graph`."""
    from sglang.srt.model_executor.runner_utils.forward_batch import get_forward_batch

    @functools.wraps(body)
    def _eager_attention(self, q, k, v, output, *args, **kwargs):
        substitute_for_batch(self, k, v, get_forward_batch(), kwargs)
        return body(self, q, k, v, output, *args, **kwargs)

    setattr(_eager_attention, MARK, True)
    return _eager_attention


def eager_body(attr: Any) -> Callable:
    """The undecorated body of an `@eager_on_graph` attribute (what replay calls)."""
    return attr.__wrapped__


def apply() -> None:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph

    eager = RadixAttention.__dict__["_eager_attention"]
    if getattr(eager_body(eager), MARK, False):
        return
    RadixAttention._eager_attention = eager_on_graph(substituting_eager_body(eager_body(eager)))
    RadixAttention.forward = _wrap_attention_forward(RadixAttention.forward)
