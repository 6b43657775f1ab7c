"""GDN prefill returns per-chunk states on CPU.

Targets `srt/layers/attention/linear/kernels/gdn_triton.py` (SGLang 0.5.23, ~line 28): on CPU
it binds `chunk_gated_delta_rule` to sgl_kernel's wrapper, which returns `h = None`, so the
`extra_buffer` strategy cannot take a state checkpoint inside a prefill. The replacement
returns the chunk-start states like the Triton kernel does.
"""

from __future__ import annotations

from sglang_ext.patches.cpu.ops.gdn import chunk_gated_delta_rule_with_h

TARGET = "srt/layers/attention/linear/kernels/gdn_triton.py: chunk_gated_delta_rule"


def apply() -> None:
    from sglang.srt.layers.attention.linear.kernels import gdn_triton

    gdn_triton.chunk_gated_delta_rule = chunk_gated_delta_rule_with_h
