"""Causal depthwise conv1d over packed variable-length sequences, with a rolling state.

Targets `torch.ops.sgl_kernel.causal_conv1d_fwd_cpu` / `causal_conv1d_update_cpu`
(called from `sgl_kernel/mamba.py`, SGLang 0.5.23). Conv state per slot: [D, W-1], the
last W-1 *inputs* (pre-activation), oldest first. The math is `hybrid_kernels.conv1d`.
"""

from __future__ import annotations

import torch

from hybrid_kernels.conv1d import causal_conv1d_ref, roll_window


def causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices,
                          has_initial_state, silu_activation, pad_slot_id, is_var_len=True):
    """x [D, total_T] packed by query_start_loc; updates conv_states[cache_indices] in place."""
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist()
    has_init = has_initial_state.tolist() if has_initial_state is not None else [False] * len(slots)
    for i, slot in enumerate(slots):
        if slot == pad_slot_id:
            continue
        seg = x[:, starts[i]:starts[i + 1]]
        history = conv_states[slot] if has_init[i] else torch.zeros_like(conv_states[slot])
        out[:, starts[i]:starts[i + 1]] = causal_conv1d_ref(seg, history, weight, bias, silu_activation)
        conv_states[slot] = roll_window(seg, history)
    return out


def causal_conv1d_update_cpu(x, conv_states, weight, bias, silu_activation, cache_seqlens,
                             conv_state_indices, pad_slot_id, is_var_len=True):
    """Decode step(s): x [B, D] or [B, D, T]; updates conv_states[conv_state_indices]."""
    if cache_seqlens is not None:
        raise NotImplementedError("circular conv state (cache_seqlens) has no CPU fallback")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    out = torch.empty_like(xs)
    slots = conv_state_indices.tolist() if conv_state_indices is not None else list(range(xs.shape[0]))
    for b, slot in enumerate(slots):
        if slot == pad_slot_id:
            continue
        out[b] = causal_conv1d_ref(xs[b], conv_states[slot], weight, bias, silu_activation)
        conv_states[slot] = roll_window(xs[b], conv_states[slot])
    return out.squeeze(-1) if squeeze else out
