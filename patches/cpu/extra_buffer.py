"""Allow SGLang's `extra_buffer` Mamba radix-cache strategy on CPU.

Targets `srt/arg_groups/mamba_hook.py::_platform_supports_mamba_cache_extra_buffer`
(SGLang 0.5.23), which `validate_mamba_extra_buffer` asserts and which answers False on CPU.
The strategy needs the linear layers to hand out states inside a prefill (GDN: the state at
every 64-token chunk start, `patches/cpu/gdn.py`; Mamba-2: the chunk-grid states and the
states at tracked ends, `patches/cpu/mamba2.py`) and a decode-time copy of the live state into
the request's ping-pong slot, done by SGLang's Triton `track_mamba_states_*` kernels
(`patches/cpu/mamba_track.py` provides them in torch). With those in the CPU patch set, the
check answers True on CPU; other platforms keep SGLang's answer.
"""

from __future__ import annotations

import functools

TARGET = "srt/arg_groups/mamba_hook.py: _platform_supports_mamba_cache_extra_buffer"


def _wrap(original):
    @functools.wraps(original)
    def _platform_supports_mamba_cache_extra_buffer() -> bool:
        from sglang.srt.utils import is_cpu

        return is_cpu() or original()

    return _platform_supports_mamba_cache_extra_buffer


def apply() -> None:
    from sglang.srt.arg_groups import mamba_hook

    mamba_hook._platform_supports_mamba_cache_extra_buffer = _wrap(
        mamba_hook._platform_supports_mamba_cache_extra_buffer)
