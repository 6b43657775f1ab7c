"""Gated RMSNorm and the shared-expert gate (torch replacements of Triton paths) vs references."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import (stand-in sgl_kernel)

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated  # noqa: E402
from sglang.kernels.ops.attention.fla.layernorm_gated import RMSNorm as GatedRMSNorm  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated  # noqa: E402

from sglang_ext.patches.cpu.elementwise import fused_gate_sigmoid_mul, fused_gate_sigmoid_mul_add  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_fused_gated_rmsnorm_equals_transformers_qwen3_next_norm(tokens):
    gen = torch.Generator().manual_seed(tokens)
    dim = 24
    x, gate = torch.randn(tokens, dim, generator=gen), torch.randn(tokens, dim, generator=gen)
    ours = FusedRMSNormGated(dim, eps=1e-6, activation="silu")
    reference = Qwen3NextRMSNormGated(dim, eps=1e-6)
    with torch.no_grad():
        weight = torch.randn(dim, generator=gen)
        ours.weight.copy_(weight)
        reference.weight.copy_(weight)
        torch.testing.assert_close(ours(x, gate), reference(x, gate))


def test_grouped_gate_before_norm_matches_a_hand_computation():
    gen = torch.Generator().manual_seed(0)
    x, z = torch.randn(5, 12, generator=gen), torch.randn(5, 12, generator=gen)
    norm = GatedRMSNorm(12, eps=1e-5, group_size=4, norm_before_gate=False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=gen))
        gated = (x * torch.nn.functional.silu(z)).view(5, 3, 4)
        expected = (gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + 1e-5)).view(5, 12) * norm.weight
        torch.testing.assert_close(norm(x, z), expected)


def test_shared_expert_gate_is_sigmoid_of_a_dot_product():
    gen = torch.Generator().manual_seed(1)
    hidden, weight, shared = (torch.randn(9, 16, generator=gen), torch.randn(16, generator=gen),
                              torch.randn(9, 16, generator=gen))
    expected = torch.sigmoid(hidden @ weight).unsqueeze(-1) * shared
    torch.testing.assert_close(fused_gate_sigmoid_mul(hidden, weight, shared), expected)
    out = torch.ones(9, 16)
    fused_gate_sigmoid_mul_add(hidden, weight, shared, out)
    torch.testing.assert_close(out, expected + 1)
