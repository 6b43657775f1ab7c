"""Gated DeltaNet: pure-torch twins (`naive.py`) and Triton kernels (`triton_ops.py`, imported on
first use). Conventions in `naive.py`'s docstring: state S [H, dk, dv]; SGLang's pool is [H, dv, dk]."""

from hybrid_kernels.gdn.naive import (
    CHUNK,
    expand_heads,
    gdn_chunk_ref,
    gdn_chunk_transition_ref,
    gdn_chunk_transition_via_chunked,
    gdn_compose_ref,
    gdn_gating_ref,
    gdn_recurrent_ref,
    gdn_recurrent_step_ref,
    l2norm,
    state_from_sglang,
    state_to_sglang,
)

_TRITON = ("gdn_chunk_transition", "gdn_compose")

__all__ = [
    "CHUNK", "expand_heads", "gdn_chunk_ref", "gdn_chunk_transition_ref", "gdn_chunk_transition_via_chunked",
    "gdn_compose_ref", "gdn_gating_ref", "gdn_recurrent_ref", "gdn_recurrent_step_ref", "l2norm",
    "state_from_sglang", "state_to_sglang", *_TRITON,
]


def __getattr__(name: str) -> object:
    if name in _TRITON:
        from hybrid_kernels.gdn import triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module 'hybrid_kernels.gdn' has no attribute {name!r}")
