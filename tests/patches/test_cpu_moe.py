"""CPU MoE fallback (`patches/cpu/ops/moe.py`) vs transformers' Nemotron-H experts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

from sglang_ext.patches.cpu.ops.moe import moe_forward_cpu

E, HIDDEN, INTER, TOPK, T = 6, 16, 8, 2, 11


def _hf_experts(seed=0) -> NemotronHExperts:
    config = NemotronHConfig(hidden_size=HIDDEN, n_routed_experts=E, moe_intermediate_size=INTER,
                             mlp_hidden_act="relu2", num_experts_per_tok=TOPK)
    experts = NemotronHExperts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.up_proj.copy_(torch.randn(E, INTER, HIDDEN, generator=gen) * 0.3)
        experts.down_proj.copy_(torch.randn(E, HIDDEN, INTER, generator=gen) * 0.3)
    return experts


def _routing(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)]).to(torch.int32)
    return torch.rand(T, TOPK, generator=gen), ids


def _config(**overrides):
    fields = dict(apply_router_weight_on_input=False, is_gated=False, activation="relu2",
                  routed_scaling_factor=2.5)
    return SimpleNamespace(**{**fields, **overrides})


def _fail_gated(*args):
    raise AssertionError("non-gated experts must not go through the gated path")


@pytest.mark.parametrize("fused_in_topk", [False, True])
def test_non_gated_relu2_experts_match_transformers_with_routed_scaling(fused_in_topk):
    experts = _hf_experts()
    layer = SimpleNamespace(w13_weight=experts.up_proj.data, w2_weight=experts.down_proj.data,
                            should_fuse_routed_scaling_factor_in_topk=fused_in_topk)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing()
    out = moe_forward_cpu(layer, x, (weights, ids, None), _config(), gated_forward=_fail_gated)
    with torch.no_grad():
        ref = experts(x, ids.long(), weights)
    scale = 1.0 if fused_in_topk else 2.5   # folded into the TopK weights already: not again
    torch.testing.assert_close(out, ref * scale, atol=1e-5, rtol=1e-5)


def test_gated_experts_use_sglangs_path_and_get_scaled():
    layer = SimpleNamespace(should_fuse_routed_scaling_factor_in_topk=False)
    x = torch.randn(T, HIDDEN)
    calls = []

    def gated(layer_, x_, topk_output, config):
        calls.append(config.activation)
        return torch.ones_like(x_)

    topk = (*_routing(), None)
    out = moe_forward_cpu(layer, x, topk, _config(is_gated=True, activation="silu"), gated_forward=gated)
    assert calls == ["silu"] and torch.equal(out, torch.full_like(x, 2.5))
    # Qwen3-Next style (no factor): SGLang's result unchanged
    out = moe_forward_cpu(layer, x, topk, _config(is_gated=True, activation="silu", routed_scaling_factor=None),
                          gated_forward=gated)
    assert torch.equal(out, torch.ones_like(x))


def test_unsupported_non_gated_activation_is_named():
    layer = SimpleNamespace(w13_weight=torch.zeros(E, INTER, HIDDEN), w2_weight=torch.zeros(E, HIDDEN, INTER))
    with pytest.raises(NotImplementedError, match="swiglu"):
        moe_forward_cpu(layer, torch.zeros(T, HIDDEN), (*_routing(), None), _config(activation="swiglu"),
                        gated_forward=_fail_gated)
