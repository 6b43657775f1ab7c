"""Triton kernels for LinearKV's GDN ops; twins in `naive.py` (same shapes, conventions, results).

- `gdn_chunk_transition(k, g, beta) -> M [H, dk, dk]` fp32: one program per (head, block of M's
  columns) runs M <- exp(g_t)(M - beta_t k_t (k_t^T M)) from M = I over the chunk's tokens (M's
  columns evolve independently, so column blocks split the work). O(T dk^2) per head, sequential
  in T.
- `gdn_compose(states, transitions, initial=None) -> S [H, dk, dv]` fp32: one program per (head,
  block of dv) folds S <- M_i S + s_i with an fp32 (IEEE, no TF32) matrix product.

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
def _transition_kernel(k_ptr, g_ptr, b_ptr, m_ptr, T, H, DK,
                       BK: tl.constexpr, BN: tl.constexpr):
    h = tl.program_id(0)
    rk = tl.arange(0, BK)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mk = rk < DK
    mn = rn < DK
    M = tl.where((rk[:, None] == rn[None, :]) & mk[:, None] & mn[None, :], 1.0, 0.0).to(tl.float32)
    for t in range(T):
        row = tl.cast(t, tl.int64) * H + h
        kt = tl.load(k_ptr + row * DK + rk, mask=mk, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + row).to(tl.float32)
        bt = tl.load(b_ptr + row).to(tl.float32)
        kM = tl.sum(kt[:, None] * M, axis=0)                          # k_t^T M, [BN]
        M = tl.exp(gt) * (M - bt * kt[:, None] * kM[None, :])
    out = m_ptr + h.to(tl.int64) * DK * DK + rk[:, None] * DK + rn[None, :]
    tl.store(out, M, mask=mk[:, None] & mn[None, :])


def gdn_chunk_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """k [T, H, dk] (L2-normalised, value heads), g, beta [T, H] -> M [H, dk, dk] fp32
    = prod_t exp(g_t)(I - beta_t k_t k_t^T), latest token on the left (`gdn_chunk_transition_ref`)."""
    T, H, dk = k.shape
    if g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(f"gdn_chunk_transition: g {tuple(g.shape)} and beta {tuple(beta.shape)} "
                         f"must be [T, H] = [{T}, {H}]")
    check_device("gdn_chunk_transition", _INTERPRETED, k, g, beta)
    k, g, beta = k.contiguous(), g.contiguous(), beta.contiguous()
    M = torch.empty((H, dk, dk), dtype=torch.float32, device=k.device)
    BK = block(dk, 16)
    BN = min(BK, 32)
    _transition_kernel[(H, triton.cdiv(dk, BN))](k, g, beta, M, T, H, dk, BK=BK, BN=BN,
                                                  num_warps=4 if BK <= 64 else 8)
    return M


@triton.jit
def _compose_kernel(s_ptr, m_ptr, init_ptr, out_ptr, K, H, DK, DV,
                    HAS_INIT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    mask_s = mk[:, None] & mv[None, :]
    mask_m = mk[:, None] & mk[None, :]
    offs_s = rk[:, None] * DV + rv[None, :]
    offs_m = rk[:, None] * DK + rk[None, :]
    h64 = h.to(tl.int64)
    if HAS_INIT:
        S = tl.load(init_ptr + h64 * DK * DV + offs_s, mask=mask_s, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    for i in range(K):
        row = tl.cast(i, tl.int64) * H + h64
        M = tl.load(m_ptr + row * DK * DK + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        s_i = tl.load(s_ptr + row * DK * DV + offs_s, mask=mask_s, other=0.0).to(tl.float32)
        S = tl.dot(M, S, input_precision="ieee") + s_i
    tl.store(out_ptr + h64 * DK * DV + offs_s, S, mask=mask_s)


def gdn_compose(states: torch.Tensor, transitions: torch.Tensor, initial: torch.Tensor | None = None
                ) -> torch.Tensor:
    """states [K, H, dk, dv], transitions [K, H, dk, dk], initial [H, dk, dv] or None ->
    S [H, dk, dv] fp32 from S = initial (or 0); for i in order: S <- M_i S + s_i (`gdn_compose_ref`)."""
    K, H, dk, dv = states.shape
    if transitions.shape != (K, H, dk, dk):
        raise ValueError(f"gdn_compose: transitions {tuple(transitions.shape)} "
                         f"must be [K, H, dk, dk] = {[K, H, dk, dk]}")
    if initial is not None and initial.shape != (H, dk, dv):
        raise ValueError(f"gdn_compose: initial {tuple(initial.shape)} must be [H, dk, dv] = {[H, dk, dv]}")
    tensors = (states, transitions) if initial is None else (states, transitions, initial)
    check_device("gdn_compose", _INTERPRETED, *tensors)
    states, transitions = states.contiguous(), transitions.contiguous()
    init = initial.contiguous() if initial is not None else states  # dummy pointer when absent
    out = torch.empty((H, dk, dv), dtype=torch.float32, device=states.device)
    BK = block(dk, 16)
    BV = min(block(dv, 16), 32 if BK <= 64 else 16)
    _compose_kernel[(H, triton.cdiv(dv, BV))](states, transitions, init, out, K, H, dk, dv,
                                              HAS_INIT=initial is not None, BK=BK, BV=BV,
                                              num_warps=4 if BK <= 64 else 8)
    return out
