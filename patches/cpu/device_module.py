"""`torch.get_device_module()` on a CUDA build of torch without a driver.

Targets `srt/models/qwen3_next.py` (SGLang 0.5.23, ~lines 235 and 252), which calls
`torch.get_device_module().current_device()`: on a driverless CUDA build that returns
`torch.cuda` and `current_device()` raises. Without a usable accelerator the default device
module becomes `torch.cpu`. The wrapper keeps `__wrapped__` (torch.compile'd functions in
`srt/layers/moe/topk.py` inspect it).
"""

from __future__ import annotations

import functools

import torch

TARGET = "srt/models/qwen3_next.py: torch.get_device_module().current_device()"


def apply() -> None:
    original = torch.get_device_module
    if getattr(original, "_sglang_ext_patched", False):
        return

    @functools.wraps(original)
    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return original(device)

    get_device_module._sglang_ext_patched = True
    torch.get_device_module = get_device_module
