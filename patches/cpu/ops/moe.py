"""Routed-expert MoE on CPU without Intel AMX, with non-gated experts and routed scaling.

Targets `srt/layers/moe/fused_moe_native.py` (SGLang 0.5.23), the CPU fallback that
`UnquantizedFusedMoEMethod.forward_cpu` (`srt/layers/quantization/unquant.py` ~line 1383)
calls when AMX is absent. SGLang's version assumes gated experts (w13 = [gate; up]) and
never applies `moe_runner_config.routed_scaling_factor` (the GPU runners do, unless the
TopK already folded it in). `moe_forward_cpu` keeps SGLang's gated path, adds non-gated
experts (Nemotron-H: down(relu2(up(x)))) and applies the routed scaling factor.
Shapes: x [T, hidden]; topk_weights / topk_ids [T, k]; gated w13 [E, 2I, hidden],
non-gated w13 [E, I, hidden]; w2 [E, hidden, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


#: activations of non-gated experts: act(up(x))
NON_GATED_ACTIVATIONS = {"relu2": _relu2, "silu": F.silu, "gelu": F.gelu}


def _expert_bias(layer: torch.nn.Module, name: str, expert: int) -> torch.Tensor | None:
    bias = getattr(layer, name, None)
    return None if bias is None else bias[expert]


def non_gated_experts(layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """sum_k w_k * down_e(act(up_e(x))) over each token's experts -> [T, hidden] (x's dtype)."""
    if activation not in NON_GATED_ACTIVATIONS:
        raise NotImplementedError(f"non-gated MoE activation {activation!r} has no CPU fallback in sglang_ext")
    act = NON_GATED_ACTIVATIONS[activation]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.where(topk_ids == expert)
        hidden = F.linear(x[tokens], layer.w13_weight[expert], _expert_bias(layer, "w13_weight_bias", expert))
        y = F.linear(act(hidden), layer.w2_weight[expert], _expert_bias(layer, "w2_weight_bias", expert))
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(x.dtype)


def routed_scale(layer: torch.nn.Module, moe_runner_config) -> float:
    """The factor the runner still owes: 1 when absent or already folded into the TopK weights."""
    factor = moe_runner_config.routed_scaling_factor
    if factor is None or getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
        return 1.0
    return float(factor)


def moe_forward_cpu(layer, x, topk_output, moe_runner_config, gated_forward) -> torch.Tensor:
    """`moe_forward_native(layer, x, topk_output, moe_runner_config)` -> [T, hidden], fixed:
    non-gated experts run here, gated ones through SGLang's `gated_forward`; then the
    routed scaling factor is applied."""
    if moe_runner_config.apply_router_weight_on_input:
        raise NotImplementedError("MoE apply_router_weight_on_input has no CPU fallback")
    if moe_runner_config.is_gated:
        out = gated_forward(layer, x, topk_output, moe_runner_config)
    else:
        topk_weights, topk_ids, _ = topk_output
        out = non_gated_experts(layer, x, topk_weights, topk_ids, moe_runner_config.activation)
    factor = routed_scale(layer, moe_runner_config)
    return out if factor == 1.0 else out * factor
