"""Gated RMSNorm on CPUs without Intel AMX, in torch instead of Triton.

Targets (SGLang 0.5.23): `kernels/ops/attention/fla/fused_norm_gate.py::FusedRMSNormGated`
(~line 20: `_use_cpu` needs AMX, else Triton) used by Qwen3-Next's GDN output norm, and
`kernels/ops/attention/fla/layernorm_gated.py::RMSNorm` (~line 35) used by Mamba-2 mixers
(grouped, gate before norm). Both forwards are replaced by SGLang's own torch reference
`layernorm_gated.rms_norm_ref`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TARGET = "kernels/ops/attention/fla/{fused_norm_gate.py,layernorm_gated.py}"

_GATES = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}


def fused_rmsnorm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """norm(x) * weight * act(g), fp32 math. (Residual / prenorm are unused by SGLang's models.)"""
    if residual is not None or prenorm:
        raise NotImplementedError("FusedRMSNormGated residual/prenorm has no CPU fallback")
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
    if self.weight is not None:
        out = out * self.weight.float()
    return (out * _GATES[self.activation](g.float())).to(x.dtype)


def gated_rmsnorm_forward(self, x, z=None):
    from sglang.kernels.ops.attention.fla.layernorm_gated import rms_norm_ref

    return rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                        norm_before_gate=self.norm_before_gate, upcast=True)


def apply() -> None:
    from sglang.kernels.ops.attention.fla import fused_norm_gate, layernorm_gated

    fused_norm_gate.FusedRMSNormGated.forward = fused_rmsnorm_gated_forward
    layernorm_gated.RMSNorm.forward = gated_rmsnorm_forward
