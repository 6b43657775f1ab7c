"""Tail-Replay state bound, GDN: each request's replayed-tail log-decay, from the layer's own gates.

Target (SGLang 0.5.23): `srt/layers/radix_linear_attention.py::RadixLinearAttention.forward`, the
model-layer call every GDN model makes (Qwen3-Next, Qwen3.5) with the gate inputs `a` of the whole
packed batch, before any backend (CPU, Triton, FlashInfer) computes the gating. For an extend batch
holding approximate replays' tails (`patches/tail_replay/batch.py::bound_segments_of`) it computes
g = -exp(A_log) softplus(a + dt_bias) on those rows only and adds each request's sum per head into
its record (`BoundSegments.accumulate`: one gather and one segment sum per layer, no host sync);
then, for the rows requests compute after an approximate start (`carry_segments_of`), the per-row
provenance bound (`CarrySegments.accumulate`: one gather, one cumsum per request and layer).

Not covered: layers of other kinds through the same class (KDA: `lower_bound` set, per-channel `a`),
which are left alone, and extends inside a prefill CUDA graph (the forward is only captured there;
a capture-time index would be stale): such a request's bound is reported as None, since its sums
then miss tokens (`state_bound.summarize`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.patches.tail_replay.batch import bound_segments_of, carry_segments_of
from sglang_ext.tail_replay import gdn_log_decay

TARGET = "srt/layers/radix_linear_attention.py: RadixLinearAttention.forward"

#: set on the installed wrapper, so `apply()` is idempotent
MARK = "_sglang_ext_tail_bound"


def accumulate_gdn_bound(layer: Any, forward_batch: Any, a: torch.Tensor) -> bool:
    """Add this batch's replayed-tail log-decay at `layer` into the requests' records.
    Returns whether anything was added."""
    mode = forward_batch.forward_mode
    if not mode.is_extend() or mode.is_target_verify():
        return False
    if getattr(layer, "lower_bound", None) is not None or layer.A_log is None or layer.dt_bias is None:
        return False
    segments, carries = bound_segments_of(forward_batch), carry_segments_of(forward_batch)
    if segments is None and carries is None:
        return False
    gates = a.reshape(-1, a.shape[-1])
    if gates.shape[-1] != layer.A_log.numel():
        return False
    added = False
    if segments is not None and gates.shape[0] >= segments.end:
        segments.accumulate(layer.layer_id, gdn_log_decay(gates.index_select(0, segments.rows),
                                                          layer.A_log, layer.dt_bias))
        added = True
    if carries is not None and gates.shape[0] >= carries.end:
        carries.accumulate(layer.layer_id, gdn_log_decay(gates.index_select(0, carries.rows),
                                                         layer.A_log, layer.dt_bias))
        added = True
    return added


def _wrap_forward(original: Callable) -> Callable:
    from sglang.srt.model_executor.runner_utils.prefill_graph import is_in_prefill_graph_scope

    @functools.wraps(original)
    def forward(self, forward_batch, mixed_qkv, a, b, *args, **kwargs):
        if not is_in_prefill_graph_scope():
            accumulate_gdn_bound(self, forward_batch, a)
        return original(self, forward_batch, mixed_qkv, a, b, *args, **kwargs)

    setattr(forward, MARK, True)
    return forward


def apply() -> None:
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    if not getattr(RadixLinearAttention.forward, MARK, False):
        RadixLinearAttention.forward = _wrap_forward(RadixLinearAttention.forward)
