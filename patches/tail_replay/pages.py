"""Allow Tail-Replay with page size > 1 under SGLang's `no_buffer` state strategy.

Targets `srt/arg_groups/mamba_hook.py::validate_mamba_no_buffer` (SGLang 0.5.23), which refuses
page_size > 1 because without the extra buffer only a sequence-end state exists and a page-cut
key would misplace it. The tail_replay backend never places a state off its own depth (it
withholds states whose sequence does not end on a page boundary, see tail_replay/cache.py) and
reuses page-aligned prefixes without any state, so under it the check is relaxed to the others.
(`extra_buffer`, SGLang's other strategy for pages > 1, has its own validator and needs no relaxing.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TARGET = "srt/arg_groups/mamba_hook.py: validate_mamba_no_buffer"


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def validate_mamba_no_buffer(view, model_arch: str):
        from sglang_ext.tail_replay import BACKEND_NAME

        if getattr(view, "radix_cache_backend", None) != BACKEND_NAME or (view.page_size or 1) == 1:
            return original(view, model_arch)
        # SGLang's other no_buffer checks, which do not depend on the page size
        assert view.disable_overlap_schedule, "no_buffer does not support the overlap schedule"
        assert view.attention_backend != "trtllm_mha", "no_buffer does not support trtllm_mha"

    return validate_mamba_no_buffer


def apply() -> None:
    from sglang.srt.arg_groups import mamba_hook

    mamba_hook.validate_mamba_no_buffer = _wrap(mamba_hook.validate_mamba_no_buffer)
