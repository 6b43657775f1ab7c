"""The seeded sampler's hash (targets `sgl_kernel`'s `murmur_hash32_cpu`, called by
`kernels/ops/sampling/murmur_hash.py::murmur_hash32` on CPU tensors; SGLang 0.5.23).

`murmur_hash32_cpu(seed, positions, col_indices)[i, j]` is MurmurHash3 (x86, 32-bit, hash seed 0)
of the 16 bytes (seed[i] low word, seed[i] high word, positions[i], col_indices[j]), as SGLang's
Triton kernel `murmur_hash32_kernel` computes it: the per-token uniform draws of
`--enable-deterministic-inference`'s `multinomial_with_seed`. Unsigned 32-bit arithmetic is done in
int64 and masked (a product that wraps modulo 2**64 keeps its low 32 bits).
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * _C1) & _MASK
    k = (_rotl(k, 15) * _C2) & _MASK
    h = _rotl(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _MASK


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """(n,) seeds (uint64 or int64), (n,) positions, (m,) column indices -> (n, m) uint32."""
    s = seed.to(torch.int64).view(-1, 1)
    pos = positions.to(torch.int64).view(-1, 1) & _MASK
    col = col_indices.to(torch.int64).view(1, -1) & _MASK
    h = torch.zeros_like(s)
    h = _mix(h, s & _MASK)
    h = _mix(h, (s >> 32) & _MASK)
    h = _mix(h, pos)
    h = _mix(h.expand(-1, col.shape[1]), col.expand(s.shape[0], -1))
    return _fmix(h ^ 16).to(torch.uint32)


class _Op:
    """Callable like a `torch.ops` overload packet: `op(...)` and `op.default(...)`."""

    def __init__(self, fn):
        self.default = fn

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)


murmur_hash32_op = _Op(murmur_hash32_cpu)
