"""`--enable-deterministic-inference` on CPU (`patches/cpu/deterministic.py`) and the seeded
sampler's hash (`patches/cpu/ops/sampling.py`, the torch twin of SGLang's Triton
`murmur_hash32_kernel`)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import (stand-in sgl_kernel)

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_ext.patches.cpu.deterministic import cpu_batch_invariant_addmm, cpu_batch_invariant_mm  # noqa: E402
from sglang_ext.patches.cpu.ops.sampling import murmur_hash32_cpu  # noqa: E402


def _murmur3_x86_32(data: bytes) -> int:
    """The textbook MurmurHash3 x86 32-bit, hash seed 0, for 16-byte keys."""
    h, mask = 0, 0xFFFFFFFF
    for i in range(0, len(data), 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * 0xCC9E2D51) & mask
        k = ((k << 15) | (k >> 17)) & mask
        k = (k * 0x1B873593) & mask
        h ^= k
        h = ((h << 13) | (h >> 19)) & mask
        h = (h * 5 + 0xE6546B64) & mask
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


SEEDS = [0, 1, 42, 2**40 + 7, 2**63 - 1, 2**64 - 1]
POSITIONS = [0, 5, 99, 1 << 20, 3, 2047]


def test_the_hash_is_murmur3_of_seed_position_and_column():
    seeds = torch.tensor([s - 2**64 if s >= 2**63 else s for s in SEEDS], dtype=torch.int64).to(torch.uint64)
    out = murmur_hash32_cpu(seeds, torch.tensor(POSITIONS), torch.arange(13))
    assert out.dtype == torch.uint32 and out.shape == (6, 13)
    for i, (seed, pos) in enumerate(zip(SEEDS, POSITIONS, strict=True)):
        for j in range(13):
            key = struct.pack("<IIII", seed & 0xFFFFFFFF, seed >> 32, pos, j)
            assert int(out[i, j]) == _murmur3_x86_32(key), (i, j)


def test_the_hash_equals_sglangs_triton_kernel_interpreted():
    """SGLang's Triton kernel, run by Triton's interpreter on CPU tensors, on an awkward size."""
    script = textwrap.dedent("""
        import torch, triton
        from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel
        from sglang_ext.patches.cpu.ops.sampling import murmur_hash32_cpu
        seed = torch.tensor([0, 3, 2**40 + 7, 2**62 + 5, 99], dtype=torch.int64).to(torch.uint64)
        pos = torch.tensor([0, 7, 2047, 1 << 20, 64])
        cols = torch.arange(1037)
        out = torch.empty((5, 1037), dtype=torch.uint32)
        murmur_hash32_kernel[(5, triton.cdiv(1037, 256))](seed, pos, cols, out, 5, 1037, BLOCK_SIZE=256)
        assert torch.equal(out.to(torch.int64), murmur_hash32_cpu(seed, pos, cols).to(torch.int64))
        print("same")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("rows", [1, 2, 37, 64])
def test_each_row_of_the_product_is_computed_alone(rows):
    gen = torch.Generator().manual_seed(rows)
    a, b = torch.randn(rows, 48, generator=gen), torch.randn(48, 29, generator=gen)
    out = cpu_batch_invariant_mm(a, b)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)
    for i in range(rows):
        assert torch.equal(out[i], cpu_batch_invariant_mm(a[i:i + 1], b)[0])
    bias = torch.randn(29, generator=gen)
    torch.testing.assert_close(cpu_batch_invariant_addmm(bias, a, b, beta=0.5, alpha=2.0),
                               torch.addmm(bias, a, b, beta=0.5, alpha=2.0), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_batch_invariant_mm(a, b.t())


def test_the_mode_makes_linear_layers_batch_invariant_and_admits_the_cpu_backend():
    """In a fresh process: `apply()` admits torch_native to SGLang's deterministic allow-lists (else
    the flag is refused, or the prefix cache turned off); the registered mode gives a token the
    same projection alone as beside 63 others, bit for bit (without it, torch's own kernels need not)."""
    script = textwrap.dedent("""
        import os
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        from sglang_ext import patches
        patches.apply_patches("cpu")
        import torch
        import torch.nn.functional as F
        from sglang.srt.arg_groups import choices
        from sglang_ext.patches.cpu.deterministic import enable_cpu_batch_invariant_mode
        assert "torch_native" in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES
        assert "torch_native" in choices.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND
        gen = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(64, 96, generator=gen), torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
        enable_cpu_batch_invariant_mode()
        enable_cpu_batch_invariant_mode()   # once per process
        full, alone = F.linear(x, w, b), F.linear(x[5:6], w, b)
        assert torch.equal(full[5], alone[0])
        assert torch.equal((x @ w.t())[9], (x[9:10] @ w.t())[0])
        print("invariant")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "invariant" in done.stdout, done.stderr[-3000:]
