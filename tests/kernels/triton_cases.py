"""Triton kernels vs their pure-torch twins on awkward sizes (odd lengths, one token, many heads,
dk != dv), plus exact composition through the kernels vs the sequential recurrence.

Collected through `test_triton_kernels.py`, which runs these cases in-process on a CUDA GPU (or when
TRITON_INTERPRET=1 was set before Python started), else in a fresh Python with TRITON_INTERPRET=1.
Needs only torch, triton, pytest and `hybrid_kernels` (no SGLang, no transformers).
"""

from __future__ import annotations

import pytest
import torch
from hybrid_kernels._triton_utils import check_device
from hybrid_kernels.gdn import (
    gdn_chunk_ref,
    gdn_chunk_transition_ref,
    gdn_chunk_transition_via_chunked,
    gdn_compose_ref,
    gdn_recurrent_ref,
    l2norm,
)
from hybrid_kernels.gdn import triton_ops as gdn_tk
from hybrid_kernels.mamba2 import (
    ScanInputs,
    mamba2_chunk_decay_ref,
    mamba2_compose_ref,
    scan_sequence,
)
from hybrid_kernels.mamba2 import triton_ops as mamba2_tk
from hybrid_kernels.rope import rerotate_keys_ref
from hybrid_kernels.rope import triton_ops as rope_tk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL, RTOL = 1e-5, 1e-4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gdn_tokens(T, H, dk, seed, dv=None):
    """Model-like inputs on DEVICE: k L2-normalised, mild decays (so M stays O(1)), beta in (0, 1)."""
    gen = _gen(seed)
    k = l2norm(torch.randn(T, H, dk, generator=gen))
    g = -0.15 * torch.rand(T, H, generator=gen)
    beta = torch.rand(T, H, generator=gen)
    v = torch.randn(T, H, dv or dk, generator=gen)
    q = l2norm(torch.randn(T, H, dk, generator=gen))
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta))


def test_kernel_modules_were_built_for_this_device():
    for module in (gdn_tk, mamba2_tk, rope_tk):
        assert module._INTERPRETED == (DEVICE == "cpu")


@pytest.mark.parametrize("T,H,dk", [(0, 2, 16), (1, 1, 16), (1, 4, 7), (37, 3, 20), (65, 2, 64), (20, 9, 8),
                                    (5, 2, 128)])
def test_gdn_chunk_transition_matches_twin(T, H, dk):
    _, k, _, g, beta = _gdn_tokens(T, H, dk, seed=T + H + dk)
    got = gdn_tk.gdn_chunk_transition(k, g, beta)
    assert got.shape == (H, dk, dk) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), gdn_chunk_transition_ref(k.cpu(), g.cpu(), beta.cpu()), atol=ATOL, rtol=RTOL)


def test_gdn_chunk_transition_accepts_bf16_inputs():
    _, k, _, g, beta = _gdn_tokens(21, 3, 16, seed=4)
    k, g, beta = k.bfloat16(), g.bfloat16(), beta.bfloat16()
    torch.testing.assert_close(gdn_tk.gdn_chunk_transition(k, g, beta).cpu(),
                               gdn_chunk_transition_ref(k.cpu(), g.cpu(), beta.cpu()), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("K,H,dk,dv", [(1, 1, 16, 16), (1, 2, 7, 3), (5, 3, 20, 33), (3, 12, 16, 64), (2, 2, 128, 24)])
@pytest.mark.parametrize("with_initial", [False, True])
def test_gdn_compose_matches_twin(K, H, dk, dv, with_initial):
    gen = _gen(K * 100 + dk)
    states = torch.randn(K, H, dk, dv, generator=gen)
    transitions = torch.randn(K, H, dk, dk, generator=gen) / dk ** 0.5
    initial = torch.randn(H, dk, dv, generator=gen) if with_initial else None
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = gdn_tk.gdn_compose(dev(states), dev(transitions), dev(initial))
    assert got.shape == (H, dk, dv) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), gdn_compose_ref(states, transitions, initial), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("bounds", [[0, 1], [0, 40, 41, 99], [0, 33, 64, 97]])
def test_gdn_exact_composition_through_kernels_equals_sequential_state(bounds):
    """Chunk end states from zero (twin), transitions and composition by the kernels == one pass."""
    H, dk, dv = 3, 16, 24
    q, k, v, g, beta = (x.cpu() for x in _gdn_tokens(bounds[-1], H, dk, seed=len(bounds), dv=dv))
    initial = torch.randn(H, dk, dv, generator=_gen(1))
    states, transitions = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        _, s, _ = gdn_chunk_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], torch.zeros(H, dk, dv))
        states.append(s)
        M = gdn_tk.gdn_chunk_transition(k[a:b].to(DEVICE), g[a:b].to(DEVICE), beta[a:b].to(DEVICE))
        transitions.append(M.cpu())
    composed = gdn_tk.gdn_compose(torch.stack(states).to(DEVICE), torch.stack(transitions).to(DEVICE),
                                  initial.to(DEVICE))
    _, sequential = gdn_recurrent_ref(q, k, v, g, beta, initial)
    torch.testing.assert_close(composed.cpu(), sequential, atol=1e-4, rtol=1e-4)
    by_trick = gdn_chunk_transition_via_chunked(k[a:b], g[a:b], beta[a:b])
    torch.testing.assert_close(transitions[-1], by_trick, atol=ATOL, rtol=RTOL)
    one = gdn_tk.gdn_compose(torch.stack(states[:1]).to(DEVICE), torch.stack(transitions[:1]).to(DEVICE))
    torch.testing.assert_close(one.cpu(), states[0], atol=0, rtol=0)


@pytest.mark.parametrize("T,H", [(0, 3), (1, 1), (1, 80), (200, 7), (65, 130)])
def test_mamba2_chunk_decay_matches_twin(T, H):
    gen = _gen(T + H)
    dt, A = torch.rand(T, H, generator=gen) * 0.1, -torch.rand(H, generator=gen) * 2
    got = mamba2_tk.mamba2_chunk_decay(dt.to(DEVICE), A.to(DEVICE))
    assert got.shape == (H,) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), mamba2_chunk_decay_ref(dt, A), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("K,H,P,N", [(1, 1, 1, 1), (1, 3, 4, 5), (6, 5, 7, 33), (3, 80, 64, 16)])
@pytest.mark.parametrize("with_initial", [False, True])
def test_mamba2_compose_matches_twin(K, H, P, N, with_initial):
    gen = _gen(K + H + P + N)
    states, decays = torch.randn(K, H, P, N, generator=gen), torch.rand(K, H, generator=gen)
    initial = torch.randn(H, P, N, generator=gen) if with_initial else None
    dev_initial = None if initial is None else initial.to(DEVICE)
    got = mamba2_tk.mamba2_compose(states.to(DEVICE), decays.to(DEVICE), dev_initial)
    assert got.shape == (H, P, N) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), mamba2_compose_ref(states, decays, initial), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("bounds", [[0, 1], [0, 13, 14, 61]])
def test_mamba2_exact_composition_through_kernels_equals_sequential_state(bounds):
    H, P, N = 3, 4, 6
    gen = _gen(len(bounds))
    T = bounds[-1]
    seq = ScanInputs(x=torch.randn(T, H, P, generator=gen), dt=torch.rand(T, H, generator=gen) * 0.3,
                     A=-torch.rand(H, generator=gen) - 0.1, B=torch.randn(T, H, N, generator=gen),
                     C=torch.randn(T, H, N, generator=gen), D=None, z=None)
    initial = torch.randn(H, P, N, generator=gen)
    states, decays = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        _, st = scan_sequence(seq.slice(a, b), torch.zeros(H, P, N), [b - a])
        states.append(st[b - a])
        decays.append(mamba2_tk.mamba2_chunk_decay(seq.dt[a:b].to(DEVICE), seq.A.to(DEVICE)).cpu())
    composed = mamba2_tk.mamba2_compose(torch.stack(states).to(DEVICE), torch.stack(decays).to(DEVICE),
                                        initial.to(DEVICE))
    _, whole = scan_sequence(seq, initial, [T])
    torch.testing.assert_close(composed.cpu(), whole[T], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T,H,D,rd,neox", [(1, 1, 16, 16, True), (13, 5, 40, 10, True), (3, 33, 256, 64, True),
                                           (9, 3, 32, 8, False), (2, 2, 6, 2, False)])
@pytest.mark.parametrize("per_token", [False, True])
def test_rerotate_keys_matches_twin(T, H, D, rd, neox, per_token):
    gen = _gen(T * H + D)
    k = torch.randn(T, H, D, generator=gen)
    delta = torch.randint(-40, 5000, (T,), generator=gen) if per_token else 123
    got = rope_tk.rerotate_keys(k.to(DEVICE), delta.to(DEVICE) if per_token else delta, rd, 1e6, neox)
    torch.testing.assert_close(got.cpu(), rerotate_keys_ref(k, delta, rd, 1e6, neox), atol=2e-5, rtol=1e-5)


def test_rerotate_keys_bf16_strided_view_and_in_place():
    gen = _gen(7)
    pool = torch.randn(6, 4, 2 * 32, generator=gen).bfloat16().to(DEVICE)
    view = pool[:, :, :32]                              # strided rows, as gathered from a KV pool
    expected = rerotate_keys_ref(view.cpu(), 77, 8, 10000.0)
    bf16 = dict(atol=1e-5, rtol=2.0 ** -7)              # one bf16 rounding step (cos/sin may differ by an ulp)
    torch.testing.assert_close(rope_tk.rerotate_keys(view, 77, 8, 10000.0).cpu(), expected, **bf16)
    rest = pool[:, :, 32:].clone()
    rope_tk.rerotate_keys(view, 77, 8, 10000.0, out=view)
    torch.testing.assert_close(pool[:, :, :32].cpu(), expected, **bf16)
    assert torch.equal(pool[:, :, 32:], rest)
    empty = torch.empty(0, 4, 32, device=DEVICE)
    assert rope_tk.rerotate_keys(empty, 3, 8, 10000.0).shape == (0, 4, 32)


def test_wrappers_refuse_bad_shapes_and_cpu_without_interpreter():
    with pytest.raises(ValueError, match=r"transitions \(2, 1, 4, 4\) must be"):
        gdn_tk.gdn_compose(torch.zeros(3, 1, 4, 4, device=DEVICE), torch.zeros(2, 1, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"decays \(1, 2\) must be"):
        mamba2_tk.mamba2_compose(torch.zeros(2, 2, 1, 1, device=DEVICE), torch.zeros(1, 2, device=DEVICE))
    with pytest.raises(ValueError, match="must be \\[T, H\\]"):
        gdn_tk.gdn_chunk_transition(torch.zeros(3, 2, 4, device=DEVICE), torch.zeros(3, 1, device=DEVICE),
                                    torch.zeros(3, 2, device=DEVICE))
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        check_device("op", False, torch.zeros(1))
