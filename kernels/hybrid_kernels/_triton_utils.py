"""Shared checks for the Triton wrappers (imported only with a Triton kernel)."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 when the kernel
    module was imported: Triton decides at decoration time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(op: str, interpreted: bool, *tensors: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter; all on one device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreted:
        raise RuntimeError(f"{op}: the Triton kernel needs CUDA tensors (on CPU use the *_ref twin, or import "
                           "hybrid_kernels' Triton modules with TRITON_INTERPRET=1)")


def block(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())
