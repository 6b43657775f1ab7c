"""hybrid_kernels.conv1d twin: causal depthwise conv vs a plain loop; windows carry a split sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hybrid_kernels.conv1d import causal_conv1d_ref, roll_window


def _loop(x, weight, bias, window, silu):
    seq = torch.cat([window, x], dim=-1)
    width = weight.shape[1]
    out = torch.stack([(seq[:, t:t + width] * weight).sum(-1) + bias for t in range(x.shape[1])], dim=-1)
    return F.silu(out) if silu else out


@pytest.mark.parametrize("T", [1, 2, 17])
@pytest.mark.parametrize("silu", [False, True])
def test_conv_matches_loop(T, silu):
    gen = torch.Generator().manual_seed(T)
    D, W = 6, 4
    x, window = torch.randn(D, T, generator=gen), torch.randn(D, W - 1, generator=gen)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    torch.testing.assert_close(causal_conv1d_ref(x, window, weight, bias, silu), _loop(x, weight, bias, window, silu))
    torch.testing.assert_close(roll_window(x, window), torch.cat([window, x], -1)[:, -(W - 1):])


def test_split_sequence_with_rolled_window_equals_one_run():
    gen = torch.Generator().manual_seed(0)
    D, W, T = 5, 4, 23
    x, weight, bias = torch.randn(D, T, generator=gen), torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    whole = causal_conv1d_ref(x, torch.zeros(D, W - 1), weight, bias, True)
    window, pieces = torch.zeros(D, W - 1), []
    for a, b in [(0, 1), (1, 3), (3, 10), (10, 23)]:
        pieces.append(causal_conv1d_ref(x[:, a:b], window, weight, bias, True))
        window = roll_window(x[:, a:b], window)
    torch.testing.assert_close(torch.cat(pieces, -1), whole)
