"""RoPE key re-rotation: pure-torch twin (`naive.py`) and Triton kernel (`triton_ops.py`, imported on
first use). Conventions in `naive.py`'s docstring."""

from hybrid_kernels.rope.naive import rerotate_keys_ref, rope_inv_freq

_TRITON = ("rerotate_keys",)

__all__ = ["rerotate_keys_ref", "rope_inv_freq", *_TRITON]


def __getattr__(name: str) -> object:
    if name in _TRITON:
        from hybrid_kernels.rope import triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module 'hybrid_kernels.rope' has no attribute {name!r}")
