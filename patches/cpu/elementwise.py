"""Shared-expert sigmoid gate in torch instead of Triton.

Targets `srt/models/qwen2_moe.py` (SGLang 0.5.23, ~line 821, used by Qwen3-Next's sparse MoE
block), which sends the shared-expert gate to the Triton kernels in
`kernels/ops/elementwise/elementwise.py` (~line 242) unless Intel AMX is present.
"""

from __future__ import annotations

import torch

TARGET = "srt/models/qwen2_moe.py: fused_gate_sigmoid_mul / fused_gate_sigmoid_mul_add"


def _gated(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())
    return gate.unsqueeze(-1) * shared.float()


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    return _gated(hidden_states, gate_weight, shared_output).to(shared_output.dtype)


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    final_hidden_states += _gated(hidden_states, gate_weight, shared_output).to(final_hidden_states.dtype)


def apply() -> None:
    from sglang.srt.models import qwen2_moe

    qwen2_moe.fused_gate_sigmoid_mul = fused_gate_sigmoid_mul
    qwen2_moe.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add
