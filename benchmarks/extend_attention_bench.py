"""Time SGLang's torch_native extend attention against `sglang_ext.patches.cpu.extend_attention`.

One sequence: a cached prefix of P tokens plus N new tokens (fp32, causal), the case prefix
reuse hits on CPU. Prints, per prefix length, the median seconds per call of the original and
the patched method, their ratio, and the max output difference.

    nice -n 10 .venv/bin/python benchmarks/extend_attention_bench.py [--prefixes 8192 16384 32768]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

import torch  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from sglang_ext.patches.cpu import extend_attention  # noqa: E402


def _case(prefix: int, new: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = prefix + new
    req_to_token = torch.randperm(total, generator=gen).to(torch.int32).unsqueeze(0)
    return dict(
        query=torch.randn(new, heads, head_dim, generator=gen),
        k_cache=torch.randn(total, kv_heads, head_dim, generator=gen),
        v_cache=torch.randn(total, kv_heads, head_dim, generator=gen),
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([total]),
        extend_prefix_lens=torch.tensor([prefix]),
        extend_seq_lens=torch.tensor([new]),
        scaling=head_dim ** -0.5,
        enable_gqa=heads != kv_heads,
        causal=True,
    )


def _time(fn, backend, args, repeats: int):
    out = torch.empty_like(args["query"])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(backend, output=out, **args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls of the original")
    ap.add_argument("--patched-repeats", type=int, default=7)
    a = ap.parse_args()

    extend_attention.apply()
    original = extend_attention.original_run_sdpa_forward_extend
    patched = extend_attention.run_sdpa_forward_extend
    backend = object.__new__(TorchNativeAttnBackend)
    warm = _case(256, 16, a.heads, a.kv_heads, a.head_dim)
    _time(original, backend, warm, 1), _time(patched, backend, warm, 1)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, causal, "
          f"heads {a.heads}/{a.kv_heads} (q/kv), head_dim {a.head_dim}, new tokens {a.new}, "
          f"median of {a.repeats} (original) / {a.patched_repeats} (patched) calls")
    print(f"{'prefix':>8} {'original s':>11} {'patched s':>10} {'ratio':>8} {'max |diff|':>11}")
    for prefix in a.prefixes:
        args = _case(prefix, a.new, a.heads, a.kv_heads, a.head_dim)
        t_orig, out_orig = _time(original, backend, args, a.repeats)
        t_new, out_new = _time(patched, backend, args, a.patched_repeats)
        diff = (out_orig - out_new).abs().max().item()
        print(f"{prefix:>8} {t_orig:>11.4f} {t_new:>10.4f} {t_orig / t_new:>7.1f}x {diff:>11.2e}",
              flush=True)


if __name__ == "__main__":
    main()
