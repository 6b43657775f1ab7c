"""Triton kernels for LinearKV's Mamba-2 ops; twins in `naive.py` (same shapes, conventions, results).

- `mamba2_chunk_decay(dt, A) -> a [H]` fp32 = exp(A * sum_t dt_t): one program per block of heads
  sums dt over the tokens in blocks.
- `mamba2_compose(states, decays, initial=None) -> h [H, P, N]` fp32: one program per (head, block
  of the P*N state entries) folds h <- a_i h + s_i.

Inputs may be any float dtype; the math is fp32. Tensors must be CUDA tensors, or CPU tensors when
this module was imported under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels._triton_utils import block, check_device, interpreting

_INTERPRETED = interpreting()


@triton.jit
def _decay_kernel(dt_ptr, a_ptr, out_ptr, T, H, BT: tl.constexpr, BH: tl.constexpr):
    rh = tl.program_id(0) * BH + tl.arange(0, BH)
    mh = rh < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for t0 in range(0, T, BT):
        rt = t0 + tl.arange(0, BT)
        offs = rt.to(tl.int64)[:, None] * H + rh[None, :]
        dt = tl.load(dt_ptr + offs, mask=(rt[:, None] < T) & mh[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(dt, axis=0)
    A = tl.load(a_ptr + rh, mask=mh, other=0.0).to(tl.float32)
    tl.store(out_ptr + rh, tl.exp(A * acc), mask=mh)


def mamba2_chunk_decay(dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """dt [T, H] (discretized: after bias, softplus, clamp), A [H] -> a [H] fp32 = exp(A sum_t dt_t)
    (`mamba2_chunk_decay_ref`)."""
    T, H = dt.shape
    if A.shape != (H,):
        raise ValueError(f"mamba2_chunk_decay: A {tuple(A.shape)} must be [H] = [{H}]")
    check_device("mamba2_chunk_decay", _INTERPRETED, dt, A)
    out = torch.empty(H, dtype=torch.float32, device=dt.device)
    BH = min(block(H), 64)
    _decay_kernel[(triton.cdiv(H, BH),)](dt.contiguous(), A.contiguous(), out, T, H, BT=64, BH=BH)
    return out


@triton.jit
def _compose_kernel(s_ptr, a_ptr, init_ptr, out_ptr, K, H, E,
                    HAS_INIT: tl.constexpr, BE: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    re = tl.program_id(1) * BE + tl.arange(0, BE)
    me = re < E
    if HAS_INIT:
        acc = tl.load(init_ptr + h * E + re, mask=me, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BE,), dtype=tl.float32)
    for i in range(K):
        row = tl.cast(i, tl.int64) * H + h
        a = tl.load(a_ptr + row).to(tl.float32)
        s = tl.load(s_ptr + row * E + re, mask=me, other=0.0).to(tl.float32)
        acc = a * acc + s
    tl.store(out_ptr + h * E + re, acc, mask=me)


def mamba2_compose(states: torch.Tensor, decays: torch.Tensor, initial: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """states [K, H, P, N], decays [K, H], initial [H, P, N] or None -> h [H, P, N] fp32 from
    h = initial (or 0); for i in order: h <- a_i h + s_i (`mamba2_compose_ref`)."""
    K, H, P, N = states.shape
    if decays.shape != (K, H):
        raise ValueError(f"mamba2_compose: decays {tuple(decays.shape)} must be [K, H] = [{K}, {H}]")
    if initial is not None and initial.shape != (H, P, N):
        raise ValueError(f"mamba2_compose: initial {tuple(initial.shape)} must be [H, P, N] = {[H, P, N]}")
    tensors = (states, decays) if initial is None else (states, decays, initial)
    check_device("mamba2_compose", _INTERPRETED, *tensors)
    states, decays = states.contiguous(), decays.contiguous()
    init = initial.contiguous() if initial is not None else states  # dummy pointer when absent
    out = torch.empty((H, P, N), dtype=torch.float32, device=states.device)
    E = P * N
    BE = min(block(E), 1024)
    _compose_kernel[(H, triton.cdiv(E, BE))](states, decays, init, out, K, H, E,
                                             HAS_INIT=initial is not None, BE=BE)
    return out
