"""Causal depthwise conv1d over packed variable-length sequences, with a rolling state.

Targets `torch.ops.sgl_kernel.causal_conv1d_fwd_cpu` / `causal_conv1d_update_cpu`
(called from `sgl_kernel/mamba.py`, SGLang 0.5.23). Conv state per slot: [D, W-1], the
last W-1 *inputs* (pre-activation), oldest first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _conv_with_history(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """x [D, T], history [D, W-1] -> out [D, T] (fp32 math, x's dtype)."""
    width = weight.shape[-1]
    full = torch.cat([history.float(), x.float()], dim=-1)  # [D, W-1+T]
    out = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1), bias=None,
                   groups=weight.shape[0]).squeeze(0)
    out = out[:, -x.shape[-1]:] if width > 1 else out
    if bias is not None:
        out = out + bias.float().unsqueeze(-1)
    return (F.silu(out) if silu else out).to(x.dtype)


def _new_history(x: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    keep = history.shape[-1]
    return torch.cat([history, x.to(history.dtype)], dim=-1)[:, -keep:] if keep else history


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
        out[:, starts[i]:starts[i + 1]] = _conv_with_history(seg, history, weight, bias, silu_activation)
        conv_states[slot] = _new_history(seg, history)
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
        out[b] = _conv_with_history(xs[b], conv_states[slot], weight, bias, silu_activation)
        conv_states[slot] = _new_history(xs[b], conv_states[slot])
    return out.squeeze(-1) if squeeze else out
