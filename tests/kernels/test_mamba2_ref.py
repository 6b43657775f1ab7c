"""hybrid_kernels.mamba2 twins: SSD scan vs a token recurrence, chunk decay, exact composition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hybrid_kernels.mamba2 import (
    ScanInputs,
    discretize_dt,
    expand_groups,
    mamba2_chunk_decay_ref,
    mamba2_compose_ref,
    scan_sequence,
    ssd_step_ref,
)

H, P, N, G = 4, 6, 5, 2
ATOL = 1e-4


def _inputs(T: int, seed: int = 0) -> ScanInputs:
    gen = torch.Generator().manual_seed(seed)
    dt = discretize_dt(torch.randn(T, H, generator=gen) - 1.0, torch.randn(H, generator=gen) * 0.5, softplus=True)
    return ScanInputs(
        x=torch.randn(T, H, P, generator=gen), dt=dt, A=-torch.rand(H, generator=gen) * 2 - 0.1,
        B=expand_groups(torch.randn(T, G, N, generator=gen), H),
        C=expand_groups(torch.randn(T, G, N, generator=gen), H),
        D=torch.randn(H, P, generator=gen), z=None,
    )


def _recurrence(seq: ScanInputs, h0: torch.Tensor):
    """Token by token, written out here: (y [T, H, P], final h)."""
    h, ys = h0.clone(), []
    for t in range(seq.x.shape[0]):
        decay = torch.exp(seq.dt[t] * seq.A)[:, None, None]
        h = h * decay + (seq.dt[t][:, None] * seq.x[t])[..., None] * seq.B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, seq.C[t]) + seq.D * seq.x[t])
    return torch.stack(ys), h


@pytest.mark.parametrize("T", [1, 15, 16, 37])
def test_scan_and_step_match_the_recurrence(T):
    seq = _inputs(T, seed=T)
    h0 = torch.randn(H, P, N)
    ref_y, ref_h = _recurrence(seq, h0)
    y, states = scan_sequence(seq, h0, [c for c in (T // 3, T) if c > 0] if T > 2 else [T])
    torch.testing.assert_close(y, ref_y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(states[T], ref_h, atol=ATOL, rtol=ATOL)
    h = h0
    for t in range(T):
        dt = seq.dt[t][:, None].expand(H, P)
        y_t, h = ssd_step_ref(h, seq.x[t], dt, seq.A[:, None, None], seq.B[t], seq.C[t], seq.D)
        torch.testing.assert_close(y_t, ref_y[t], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(h, ref_h, atol=ATOL, rtol=ATOL)


def test_gate_multiplies_by_silu_z():
    seq = _inputs(9, seed=4)
    z = torch.randn(9, H, P)
    y_plain, _ = scan_sequence(seq, torch.zeros(H, P, N), [9])
    y_gated, _ = scan_sequence(ScanInputs(seq.x, seq.dt, seq.A, seq.B, seq.C, seq.D, z), torch.zeros(H, P, N), [9])
    torch.testing.assert_close(y_gated, y_plain * F.silu(z), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("T", [0, 1, 29])
def test_chunk_decay_is_the_factor_on_the_start_state(T):
    seq = _inputs(max(T, 1), seed=3).slice(0, T)
    a = mamba2_chunk_decay_ref(seq.dt, seq.A)
    assert a.shape == (H,)
    torch.testing.assert_close(a, torch.exp(seq.A * seq.dt.sum(0)))
    if T:
        start = torch.randn(H, P, N)
        _, from_zero = scan_sequence(seq, torch.zeros(H, P, N), [T])
        _, from_start = scan_sequence(seq, start, [T])
        torch.testing.assert_close(from_start[T], a[:, None, None] * start + from_zero[T], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("bounds", [[0, 90], [0, 1, 90], [0, 13, 14, 50, 90]])
@pytest.mark.parametrize("with_initial", [False, True])
def test_composition_in_order_equals_sequential_scan(bounds, with_initial):
    seq = _inputs(90, seed=len(bounds))
    initial = torch.randn(H, P, N) if with_initial else None
    states, decays = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        _, st = scan_sequence(seq.slice(a, b), torch.zeros(H, P, N), [b - a])
        states.append(st[b - a])
        decays.append(mamba2_chunk_decay_ref(seq.dt[a:b], seq.A))
    composed = mamba2_compose_ref(torch.stack(states), torch.stack(decays), initial)
    _, ref_h = _recurrence(seq, torch.zeros(H, P, N) if initial is None else initial)
    torch.testing.assert_close(composed, ref_h, atol=ATOL, rtol=ATOL)


def test_composing_one_chunk_is_the_identity_on_its_state():
    states, decays = torch.randn(1, H, P, N), torch.rand(1, H)
    torch.testing.assert_close(mamba2_compose_ref(states, decays), states[0], atol=0, rtol=0)


def test_compose_refuses_mismatched_counts():
    with pytest.raises(ValueError, match="2 states but 1 decays"):
        mamba2_compose_ref(torch.zeros(2, H, P, N), torch.zeros(1, H))
