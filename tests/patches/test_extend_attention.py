"""`sglang_ext.patches.cpu.extend_attention` equals SGLang's own torch_native extend attention.

Both functions get the same random inputs (a shuffled KV pool read through req_to_token,
several sequences with different prefix and extend lengths) and must give the same output.
No server: SGLang's backend class is only imported, which needs the CPU patch set first.
"""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import (stand-in sgl_kernel)

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from sglang_ext.patches.cpu import extend_attention  # noqa: E402

extend_attention.apply()  # no-op if the CPU patch set already did it
ORIGINAL = extend_attention.original_run_sdpa_forward_extend
PATCHED = extend_attention.run_sdpa_forward_extend
BACKEND = object.__new__(TorchNativeAttnBackend)  # the method only uses self for a staticmethod

# (prefix, extend) per sequence: awkward lengths, the no-prefix case, single-token extends.
SEQS = [(0, 129), (1, 5), (37, 1), (300, 129), (300, 1), (37, 5), (0, 1)]


def _inputs(seqs, q_heads, kv_heads, qk_dim=64, v_dim=64, kv_dtype=torch.float32,
            encoder_lens=None, cross=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([p + e for p, e in seqs])
    enc = [0] * len(seqs) if encoder_lens is None else encoder_lens
    # Per request: encoder tokens, then the sequence (as the original lays them out).
    ctx = [e + (0 if cross else s) for e, s in zip(enc, seq_lens.tolist())]
    pool = sum(ctx) + 11
    k_cache = torch.randn(pool, kv_heads, qk_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pool, kv_heads, v_dim, generator=gen).to(kv_dtype)
    slots = torch.randperm(pool, generator=gen)
    req_to_token = torch.zeros(len(seqs) + 3, max(ctx) + 7, dtype=torch.int32)
    req_pool_indices = torch.randperm(len(seqs) + 3, generator=gen)[: len(seqs)]
    used = 0
    for i, n in enumerate(ctx):
        req_to_token[req_pool_indices[i], :n] = slots[used:used + n].to(torch.int32)
        used += n
    num_tokens = sum(e for _, e in seqs)
    return dict(
        query=torch.randn(num_tokens, q_heads, qk_dim, generator=gen),
        k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
        req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        extend_prefix_lens=torch.tensor([p for p, _ in seqs]),
        extend_seq_lens=torch.tensor([e for _, e in seqs]),
        encoder_lens=None if encoder_lens is None else torch.tensor(encoder_lens),
    ), v_dim


def _compare(seqs=SEQS, q_heads=4, kv_heads=2, atol=2e-5, input_kw=None, **call_kw):
    args, v_dim = _inputs(seqs, q_heads, kv_heads, **(input_kw or {}))
    call_kw.setdefault("enable_gqa", q_heads != kv_heads)
    outs = []
    for fn in (ORIGINAL, PATCHED):
        out = torch.full((args["query"].shape[0], q_heads, v_dim), float("nan"))
        ret = fn(BACKEND, output=out, **{k: v.clone() if torch.is_tensor(v) else v
                                         for k, v in args.items()}, **call_kw)
        assert ret is out
        outs.append(out)
    expected, got = outs
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)


def test_method_is_replaced():
    assert ORIGINAL is not None and ORIGINAL is not PATCHED
    assert TorchNativeAttnBackend._run_sdpa_forward_extend is PATCHED
    assert "cpu.extend_attention" in patches.CPU_PATCHES


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (4, 4)])
def test_equals_original(causal, q_heads, kv_heads):
    _compare(q_heads=q_heads, kv_heads=kv_heads, causal=causal, scaling=0.11)


def test_default_scaling_and_single_sequence():
    _compare(seqs=[(300, 129)], causal=True)
    _compare(seqs=[(0, 129)], causal=True)


def test_query_blocks(monkeypatch):
    """Small mask budget: each sequence's queries go in several blocks (and ragged last ones)."""
    monkeypatch.setattr(extend_attention, "MASK_ELEMENTS", 7 * 331)
    _compare(causal=True, scaling=0.2)
    _compare(causal=True, sliding_window_size=16)


@pytest.mark.parametrize("window", [0, 16, 400, -1])
def test_sliding_window(window):
    _compare(causal=True, sliding_window_size=window)


def test_different_head_dims_and_cache_dtype():
    _compare(causal=True, input_kw=dict(qk_dim=64, v_dim=32))
    _compare(causal=True, input_kw=dict(kv_dtype=torch.bfloat16))


def test_encoder_offsets_and_cross_attention():
    """Self-attention after encoder tokens (a request without any among them), and cross-attention
    over them. In cross-attention every request has encoder tokens: one without has no key to
    attend to, and SGLang's own output for it is whatever memory its SDPA call got (non-finite
    when the allocator hands back dirty memory), so no reference exists for it."""
    enc = [3, 0, 17, 40, 1, 2, 9]
    _compare(causal=True, input_kw=dict(encoder_lens=enc))
    _compare(causal=False, is_cross_attn=True, input_kw=dict(encoder_lens=[3, 1, 17, 40, 1, 2, 9], cross=True))
