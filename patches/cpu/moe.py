"""CPU MoE fallback: non-gated (relu2) experts and the routed scaling factor.

Targets `srt/layers/moe/fused_moe_native.py` (SGLang 0.5.23): `moe_forward_native` (~line
60, called by `UnquantizedFusedMoEMethod.forward_cpu` in `srt/layers/quantization/unquant.py`
~line 1383 on CPUs without AMX) and `fused_moe_forward_native` (~line 21, its torch.compile
variant at batch size 1). Both assume gated experts and silently drop
`routed_scaling_factor`, so every token of a Nemotron-3 style MoE (relu2 non-gated experts,
factor != 1) comes out wrong. Both are replaced by `patches/cpu/ops/moe.moe_forward_cpu`,
which keeps SGLang's own gated path (Qwen3-Next: silu, no factor -> unchanged results).
`forward_cpu` imports the name at call time, so rebinding the module attribute suffices.
"""

from __future__ import annotations

import functools

from sglang_ext.patches.cpu.ops.moe import moe_forward_cpu

TARGET = "srt/layers/moe/fused_moe_native.py: moe_forward_native, fused_moe_forward_native"


def _patched_moe_forward_native(original):
    @functools.wraps(original)
    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        return moe_forward_cpu(layer, x, topk_output, moe_runner_config, gated_forward=original)

    moe_forward_native._sglang_ext_patched = True
    return moe_forward_native


def _patched_fused_moe_forward_native(moe_forward_native):
    def fused_moe_forward_native(layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        out = moe_forward_native(layer, dispatch_output.hidden_states, dispatch_output.topk_output,
                                 layer.moe_runner_config)
        return StandardCombineInput(hidden_states=out)

    return fused_moe_forward_native


def apply() -> None:
    from sglang.srt.layers.moe import fused_moe_native

    if getattr(fused_moe_native.moe_forward_native, "_sglang_ext_patched", False):
        return
    fused_moe_native.moe_forward_native = _patched_moe_forward_native(fused_moe_native.moe_forward_native)
    fused_moe_native.fused_moe_forward_native = _patched_fused_moe_forward_native(
        fused_moe_native.moe_forward_native)
