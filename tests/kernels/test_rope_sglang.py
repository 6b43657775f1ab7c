"""SGLang 0.5.23's own RotaryEmbedding can do the re-rotation (rotating by delta as a position),
and agrees with hybrid_kernels' twin. Needs SGLang; `kernels/run_gpu_checks.sh` leaves this module out."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")   # as every module of the suite that loads SGLang

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")   # before any SGLang import

from sglang.srt.layers.rotary_embedding import base as sglang_rope  # noqa: E402

from hybrid_kernels.rope import rerotate_keys_ref  # noqa: E402

HEAD, ROT, HEADS, THETA = 32, 8, 3, 10000.0


@pytest.mark.parametrize("neox", [True, False])
def test_sglang_rotary_by_delta_equals_twin(monkeypatch, neox):
    monkeypatch.setattr(sglang_rope, "_is_cpu", True)  # its CPU branch, as under SGLANG_USE_CPU_ENGINE=1
    rope = sglang_rope.RotaryEmbedding(HEAD, ROT, 4096, THETA, neox, torch.float32)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(7, HEADS, HEAD, generator=gen)
    deltas = torch.tensor([0, 1, 5, 64, 300, 2047, 9])
    _, moved = rope.forward_native(deltas, torch.zeros(7, HEAD), keys.reshape(7, -1).clone())
    torch.testing.assert_close(moved.reshape(7, HEADS, HEAD), rerotate_keys_ref(keys, deltas, ROT, THETA, neox=neox),
                               atol=2e-5, rtol=1e-5)
