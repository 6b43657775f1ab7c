"""Mamba-2 mixers (Nemotron-H, Falcon-H1, Granite-4, Bamba, ...) on CPU, in torch.

Targets `srt/layers/attention/mamba/mamba.py` (SGLang 0.5.23), whose `MambaMixer2.forward`
calls names that have no CPU binding:
- `causal_conv1d_fn` / `causal_conv1d_update` and their `*_triton` twins are defined only
  for CUDA/NPU/XPU (~lines 43-76), and `srt/models/nemotron_h.py:665` passes
  `use_triton_causal_conv=True`, so the first forward dies with a NameError (~line 590);
- `mamba_chunk_scan_combined` (~line 616, prefill SSD scan, which must also return the
  chunk-grid and tracked states `--mamba-radix-cache-strategy extra_buffer` reads) and
  `selective_state_update` (~lines 721/756, decode) are Triton kernels.
All six names are rebound in the `mamba.py` module to the torch ops in
`patches/cpu/ops/mamba2.py` (the conv ones reuse `patches/cpu/ops/conv1d.py`).
"""

from __future__ import annotations

from sglang_ext.patches.cpu.ops import mamba2

TARGET = "srt/layers/attention/mamba/mamba.py: causal_conv1d_*, mamba_chunk_scan_combined, selective_state_update"

#: mamba.py global -> CPU implementation
BINDINGS = {
    "causal_conv1d_fn": mamba2.causal_conv1d_fn,
    "causal_conv1d_fn_triton": mamba2.causal_conv1d_fn,
    "causal_conv1d_update": mamba2.causal_conv1d_update,
    "causal_conv1d_update_triton": mamba2.causal_conv1d_update,
    "mamba_chunk_scan_combined": mamba2.mamba_chunk_scan_combined,
    "selective_state_update": mamba2.selective_state_update,
}


def apply() -> None:
    from sglang.srt.layers.attention.mamba import mamba

    for name, fn in BINDINGS.items():
        setattr(mamba, name, fn)
