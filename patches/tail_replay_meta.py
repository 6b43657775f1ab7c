"""Tail-Replay's per-request summary in `meta_info["cached_tokens_details"]["tail_replay"]`.

Target (SGLang 0.5.23): `srt/managers/scheduler_components/output_streamer.py::
SchedulerOutputStreamer.get_cached_tokens_details`.
"""

from __future__ import annotations

import functools

TARGET = "srt/managers/scheduler_components/output_streamer.py: get_cached_tokens_details"


def _wrap_cached_tokens_details(original):
    @functools.wraps(original)
    def get_cached_tokens_details(self, req):
        details = original(self, req)
        plan = getattr(req, "tail_replay", None)
        if plan is None:
            return details
        from sglang_ext.tail_replay.metrics import plan_summary

        return {**(details or {"device": req.cached_tokens, "host": 0}), "tail_replay": plan_summary(plan)}

    return get_cached_tokens_details


def apply() -> None:
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    SchedulerOutputStreamer.get_cached_tokens_details = _wrap_cached_tokens_details(
        SchedulerOutputStreamer.get_cached_tokens_details)
