"""Decode-time state tracking (`extra_buffer` Mamba strategy) on CPU.

Targets `srt/layers/attention/hybrid_linear_attn_backend.py` (SGLang 0.5.23, imports at
~line 16), which binds `track_mamba_states_if_needed` / `track_mamba_states_all_layers` to
Triton kernels (`kernels/ops/mamba/mamba_state_scatter_triton.py`) and calls them after every
decode step of a GDN or Mamba-2 layer when a request's length reaches the track interval.
Without a GPU the launch fails; the names are rebound to the torch ops in
`patches/cpu/ops/mamba_track.py`.
"""

from __future__ import annotations

from sglang_ext.patches.cpu.ops import mamba_track

TARGET = ("srt/layers/attention/hybrid_linear_attn_backend.py: "
          "track_mamba_states_if_needed, track_mamba_states_all_layers")

BINDINGS = {
    "track_mamba_states_if_needed": mamba_track.track_mamba_states_if_needed,
    "track_mamba_states_all_layers": mamba_track.track_mamba_states_all_layers,
}


def apply() -> None:
    from sglang.srt.layers.attention import hybrid_linear_attn_backend

    for name, fn in BINDINGS.items():
        setattr(hybrid_linear_attn_backend, name, fn)
