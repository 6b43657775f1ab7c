"""Tail-Replay state bound: whether the forward running now has rows to bound, so the linear-layer
bound seam (`patches/tail_replay/linear_bound.py`) calls straight through for a forward without
any (an exact hit, a miss, a decode) however recently an approximate replay ran.

Target (SGLang 0.5.23): `srt/model_executor/model_runner.py: ModelRunner.forward`. For the time of
one call it records whether its batch (or the copies the model runs on) holds an approximate
replay's tail or rows computed after an approximate start (`patches/tail_replay/batch.py`'s
registry, filled by `ForwardBatch.init_new`): the same lookup the seam's own scope makes, done once
per forward instead of once per layer, before any linear-layer kind parses its call. Outside such
a call (a graph capture, a path that runs the model some other way) nothing is recorded and the
seam keeps its own test (`batch.any_bound_rows`).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

from sglang_ext.patches.tail_replay.batch import bound_segments_of, carry_segments_of

TARGET = "srt/model_executor/model_runner.py: ModelRunner.forward"

#: within a `ModelRunner.forward` call: whether its batch has rows to bound; None outside one
_BOUND_ROWS: contextvars.ContextVar[bool | None] = contextvars.ContextVar("sglang_ext_forward_bound_rows",
                                                                          default=None)


def forward_bound_rows() -> bool | None:
    """Whether the forward running now has rows whose bound the seams sum; None: not known here
    (no `ModelRunner.forward` call is running in this context)."""
    return _BOUND_ROWS.get()


def _has_bound_rows(forward_batch) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_extend() or mode.is_target_verify():
        return False
    return bound_segments_of(forward_batch) is not None or carry_segments_of(forward_batch) is not None


def _wrap_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, forward_batch, *args, **kwargs):
        token = _BOUND_ROWS.set(_has_bound_rows(forward_batch))
        try:
            return original(self, forward_batch, *args, **kwargs)
        finally:
            _BOUND_ROWS.reset(token)

    forward.sglang_ext_tail_replay = True
    return forward


def apply() -> None:
    from sglang.srt.model_executor.model_runner import ModelRunner

    if not getattr(ModelRunner.forward, "sglang_ext_tail_replay", False):
        ModelRunner.forward = _wrap_forward(ModelRunner.forward)
