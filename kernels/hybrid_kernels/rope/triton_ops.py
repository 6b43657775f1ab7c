"""Triton kernel for re-rotating RoPE'd keys; twin `naive.rerotate_keys_ref` (same conventions).

`rerotate_keys(k, delta, rotary_dim, base, neox=True, out=None)`: one program per (token, block of
heads) rotates the first `rotary_dim` dims of each head by delta_t * theta_i (fp32 angles from the
same `rope_inv_freq` tensor as the twin, fp32 math) and copies the rest unless writing in place.
k may be a strided view (last dim contiguous), e.g. rows gathered from a KV pool; `out=k` rotates
in place. Tensors must be CUDA tensors, or CPU tensors when this module was imported under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_kernels._triton_utils import block, check_device, interpreting
from hybrid_kernels.rope.naive import _deltas, rope_inv_freq

_INTERPRETED = interpreting()


@triton.jit
def _rerotate_kernel(k_ptr, out_ptr, delta_ptr, freq_ptr, H, D, ROT,
                     sk_t, sk_h, so_t, so_h,
                     NEOX: tl.constexpr, COPY_PASS: tl.constexpr,
                     BH: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = rh < H
    half = ROT // 2
    ri = tl.arange(0, BR)
    mi = ri < half
    angle = tl.load(delta_ptr + t) * tl.load(freq_ptr + ri, mask=mi, other=0.0)   # fp32 [BR]
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    if NEOX:
        i1 = ri
        i2 = ri + half
    else:
        i1 = 2 * ri
        i2 = 2 * ri + 1
    m = mh[:, None] & mi[None, :]
    src = k_ptr + t * sk_t + rh.to(tl.int64)[:, None] * sk_h
    dst = out_ptr + t * so_t + rh.to(tl.int64)[:, None] * so_h
    x1 = tl.load(src + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2[None, :], mask=m, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(dst + i1[None, :], o1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + i2[None, :], o2.to(out_ptr.dtype.element_ty), mask=m)
    if COPY_PASS:
        rp = ROT + tl.arange(0, BP)
        mp = mh[:, None] & (rp < D)[None, :]
        tl.store(dst + rp[None, :], tl.load(src + rp[None, :], mask=mp), mask=mp)


def rerotate_keys(k: torch.Tensor, delta: int | torch.Tensor, rotary_dim: int, base: float, neox: bool = True,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """k [T, H, D] rotated at positions p -> keys rotated at p + delta, in `out` (new tensor of k's
    dtype if None; `out=k` works in place). delta: int or [T] integer tensor (`rerotate_keys_ref`)."""
    T, H, D = k.shape
    if rotary_dim > D:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds head dim {D}")
    if k.stride(-1) != 1:
        raise ValueError("rerotate_keys: k's last dim must be contiguous")
    out = torch.empty_like(k) if out is None else out
    if out.shape != k.shape or out.stride(-1) != 1:
        raise ValueError(f"rerotate_keys: out {tuple(out.shape)} must match k {tuple(k.shape)} "
                         "with a contiguous last dim")
    deltas = _deltas(delta, T, k.device).contiguous()
    freq = rope_inv_freq(rotary_dim, base, device=k.device)
    check_device("rerotate_keys", _INTERPRETED, k, out, deltas, freq)
    if T == 0:
        return out
    copy_pass = rotary_dim < D and out.data_ptr() != k.data_ptr()
    BH = min(block(H), 16)
    _rerotate_kernel[(T, triton.cdiv(H, BH))](
        k, out, deltas, freq, H, D, rotary_dim, k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        NEOX=neox, COPY_PASS=copy_pass, BH=BH, BR=block(rotary_dim // 2), BP=block(D - rotary_dim))
    return out
