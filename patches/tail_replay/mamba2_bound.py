"""Tail-Replay state bound, Mamba-2: each request's replayed-tail log-decay A x dt, from the mixer's
own time steps.

Targets (SGLang 0.5.23), one seam, the Mamba-2 mixer's SSD scan call:
- `srt/layers/attention/hybrid_linear_attn_backend.py::Mamba2AttnBackend.forward`, through which
  every Mamba-2 model (Nemotron-H, Falcon-H1, Granite-4, ...) runs each mixer: it knows the layer
  id and the forward batch; the wrapper publishes both (a context variable) while the mixer runs;
- `srt/layers/attention/mamba/mamba.py: mamba_chunk_scan_combined`, the module global
  `MambaMixer2.forward` calls with the prefill rows' raw time steps `dt`, `A`, `dt_bias`,
  `dt_softplus` and `dt_limit` (whatever it is bound to: SGLang's Triton kernel on a GPU, the torch
  op of `patches/cpu/mamba2.py` on CPU, so this module is applied after it). The wrapper computes
  A x dt (discretized as the scan does) on the batch's approximate replays' tail rows only and
  adds each request's sum per head into its record (`BoundSegments.accumulate`: one gather and one
  segment sum per layer, no host sync). Prefill rows come first in the packed batch, so the rows
  of `patches/tail_replay/batch.py::bound_segments_of` index `dt` directly.

Not covered: extends inside a prefill CUDA graph (the mixer runs as a captured op there): such a
request's bound is reported as None (`state_bound.summarize`).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

import torch

from sglang_ext.patches.tail_replay.batch import bound_segments_of, carry_segments_of
from sglang_ext.tail_replay import BoundSegments, CarrySegments, mamba2_log_decay

TARGET = ("srt/layers/attention/hybrid_linear_attn_backend.py: Mamba2AttnBackend.forward, and "
          "srt/layers/attention/mamba/mamba.py: mamba_chunk_scan_combined")

#: set on the installed wrappers, so `apply()` is idempotent
MARK = "_sglang_ext_tail_bound"

#: (bound segments, carry segments, layer id) of the mixer running now, or None
_CURRENT: contextvars.ContextVar[tuple[BoundSegments | None, CarrySegments | None, int] | None] = \
    contextvars.ContextVar("sglang_ext_tail_bound_mamba2", default=None)


def accumulate_mamba2_bound(segments: BoundSegments | None, layer_id: int, dt: torch.Tensor, A: torch.Tensor,
                            dt_bias: torch.Tensor | None, dt_softplus: bool,
                            dt_limit: tuple[float, float], carries: CarrySegments | None = None) -> bool:
    """dt [1, prefill tokens, heads] (raw, as the scan receives it): add this batch's replayed-tail
    log-decay at `layer_id` into the requests' records, then the carried rows' provenance bounds.
    Returns whether anything was added."""
    steps = dt.reshape(-1, dt.shape[-1])
    if steps.shape[-1] != A.numel():
        return False
    added = False
    if segments is not None and steps.shape[0] >= segments.end:
        segments.accumulate(layer_id, mamba2_log_decay(steps.index_select(0, segments.rows), A, dt_bias,
                                                       dt_softplus, dt_limit))
        added = True
    if carries is not None and steps.shape[0] >= carries.end:
        carries.accumulate(layer_id, mamba2_log_decay(steps.index_select(0, carries.rows), A, dt_bias,
                                                      dt_softplus, dt_limit))
        added = True
    return added


def _wrap_backend_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, mixer, hidden_states, output, layer_id, forward_batch, *args, **kwargs):
        mode = forward_batch.forward_mode
        extend = mode.is_extend() and not mode.is_target_verify()
        segments = bound_segments_of(forward_batch) if extend else None
        carries = carry_segments_of(forward_batch) if extend else None
        if segments is None and carries is None:
            return original(self, mixer, hidden_states, output, layer_id, forward_batch, *args, **kwargs)
        token = _CURRENT.set((segments, carries, layer_id))
        try:
            return original(self, mixer, hidden_states, output, layer_id, forward_batch, *args, **kwargs)
        finally:
            _CURRENT.reset(token)

    setattr(forward, MARK, True)
    return forward


def _wrap_chunk_scan(original: Callable) -> Callable:
    @functools.wraps(original)
    def mamba_chunk_scan_combined(x, dt, A, *args, **kwargs):
        current = _CURRENT.get()
        if current is not None:
            segments, carries, layer_id = current
            accumulate_mamba2_bound(segments, layer_id, dt, A, kwargs.get("dt_bias"),
                                    bool(kwargs.get("dt_softplus", False)),
                                    kwargs.get("dt_limit", (0.0, float("inf"))), carries)
        return original(x, dt, A, *args, **kwargs)

    setattr(mamba_chunk_scan_combined, MARK, True)
    return mamba_chunk_scan_combined


def apply() -> None:
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend
    from sglang.srt.layers.attention.mamba import mamba

    if not getattr(Mamba2AttnBackend.forward, MARK, False):
        Mamba2AttnBackend.forward = _wrap_backend_forward(Mamba2AttnBackend.forward)
    if not getattr(mamba.mamba_chunk_scan_combined, MARK, False):
        mamba.mamba_chunk_scan_combined = _wrap_chunk_scan(mamba.mamba_chunk_scan_combined)
