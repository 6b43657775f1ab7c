"""Mamba-2 (SSD): pure-torch twins (`naive.py`) and Triton kernels (`triton_ops.py`, imported on first
use). Conventions in `naive.py`'s docstring: state h [H, head_dim, d_state], as SGLang's pool."""

from hybrid_kernels.mamba2.naive import (
    ScanInputs,
    discretize_dt,
    expand_groups,
    mamba2_chunk_decay_ref,
    mamba2_compose_ref,
    scan_segment,
    scan_sequence,
    ssd_step_ref,
)

_TRITON = ("mamba2_chunk_decay", "mamba2_compose")

__all__ = ["ScanInputs", "discretize_dt", "expand_groups", "mamba2_chunk_decay_ref", "mamba2_compose_ref",
           "scan_segment", "scan_sequence", "ssd_step_ref", *_TRITON]


def __getattr__(name: str) -> object:
    if name in _TRITON:
        from hybrid_kernels.mamba2 import triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module 'hybrid_kernels.mamba2' has no attribute {name!r}")
