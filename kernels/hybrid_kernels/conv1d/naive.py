"""Causal depthwise conv1d with a rolling window of past inputs, in pure torch.

Convention (SGLang's, and the Mamba/GDN mixers'): x [D, T] (channels first), weight [D, W], bias [D]
or None; the window ("conv state") [D, W-1] holds the last W-1 *inputs* (pre-activation), oldest
first, so a sequence split anywhere and run piece by piece with the window carried over gives the
same outputs as one run. transformers stores W inputs instead of W-1 (drop the oldest to convert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """x [D, T], window [D, W-1] (inputs before x) -> out [D, T] in x's dtype (fp32 math):
    out[:, t] = act(bias + sum_w weight[:, w] * [window, x][:, t + w])."""
    width = weight.shape[-1]
    full = torch.cat([window.float(), x.float()], dim=-1)  # [D, W-1+T]
    out = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1), bias=None,
                   groups=weight.shape[0]).squeeze(0)
    out = out[:, -x.shape[-1]:] if width > 1 else out
    if bias is not None:
        out = out + bias.float().unsqueeze(-1)
    return (F.silu(out) if silu else out).to(x.dtype)


def roll_window(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The window after x [D, T]: the last W-1 columns of [window, x], in window's dtype."""
    keep = window.shape[-1]
    return torch.cat([window, x.to(window.dtype)], dim=-1)[:, -keep:] if keep else window
