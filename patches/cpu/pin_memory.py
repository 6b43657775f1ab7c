"""`Tensor.pin_memory()` without a CUDA driver: a no-op instead of an error.

Targets `srt/managers/schedule_batch.py::ScheduleBatch.prepare_for_decode` (SGLang 0.5.23,
~line 3830), which under the `extra_buffer` Mamba strategy copies the decode track mask to
the device with `track_mask_cpu.pin_memory().to(device, non_blocking=True)`, unguarded (every
other pinned copy in SGLang asks `is_pin_memory_available` first). On a CUDA build of torch
without a driver `pin_memory()` raises "Found no NVIDIA driver"; pinning only matters for
asynchronous host-to-GPU copies, so without a usable GPU the tensor is returned as is.
Applied only where `torch.cuda.is_available()` is False.
"""

from __future__ import annotations

import functools

import torch

TARGET = "srt/managers/schedule_batch.py: ScheduleBatch.prepare_for_decode (track_mask_cpu.pin_memory())"


def _wrap(original):
    @functools.wraps(original)
    def pin_memory(self, *args, **kwargs):
        if not torch.cuda.is_available():
            return self
        return original(self, *args, **kwargs)

    pin_memory._sglang_ext_patched = True
    return pin_memory


def apply() -> None:
    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "_sglang_ext_patched", False):
        return
    torch.Tensor.pin_memory = _wrap(torch.Tensor.pin_memory)
