"""Nemotron-H MoE router logits on CPU.

Targets `srt/models/nemotron_h.py::NemotronHMoE._forward_core_normal` (SGLang 0.5.23, ~line
389), the path taken off CUDA, which computes the router logits with
`torch.mm(..., out_dtype=torch.float32)`: that overload (`aten::mm.dtype`) exists only for
CUDA, so on CPU every MoE layer raises NotImplementedError. The replacement computes the
same fp32 logits by upcasting, and is otherwise the original method.
"""

from __future__ import annotations

import torch

TARGET = "srt/models/nemotron_h.py: NemotronHMoE._forward_core_normal (torch.mm out_dtype)"


def router_logits_fp32(hidden_states: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, hidden] x gate_weight [E, hidden] -> fp32 logits [T, E]."""
    return torch.mm(hidden_states.float(), gate_weight.float().t())


def forward_core_normal(self, hidden_states: torch.Tensor):
    """NemotronHMoE._forward_core_normal with CPU router logits -> (routed out, shared out)."""
    router_logits = router_logits_fp32(hidden_states, self.gate.weight)
    shared_output = self.shared_experts(hidden_states) if self.shared_experts is not None else None
    topk_output = self.topk(hidden_states, router_logits)
    if self.use_latent_moe:
        hidden_states = self._apply_fc1_latent_proj(hidden_states)
    return self.experts(hidden_states, topk_output), shared_output


def apply() -> None:
    from sglang.srt.models import nemotron_h

    nemotron_h.NemotronHMoE._forward_core_normal = forward_core_normal
