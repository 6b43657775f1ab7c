"""Tail-Replay's per-request summary in `meta_info["cached_tokens_details"]["tail_replay"]`, and
LinearKV's in `["linearkv"]` (requests with chunks on `--radix-cache-backend linearkv`).

Reads the request's Tail-Replay record (`sglang_ext.tail_replay.record_of`) and writes
`replay_summary(record)` (the plan, and for an approximate hit the state bound from its tail's
gates); requests without a plan (no Tail-Replay match) keep SGLang's details unchanged.

Each summary is written as `patches.ipc_json.encode(summary)` (a tagged JSON string: SGLang's IPC
types the field `Dict[str, Union[int, str]]`), and turned back into an object in the tokenizer
process by `patches.ipc_json.py`, so clients see nested JSON under both IPC modes.

Target (SGLang 0.5.23): `srt/managers/scheduler_components/output_streamer.py::
SchedulerOutputStreamer.get_cached_tokens_details`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TARGET = "srt/managers/scheduler_components/output_streamer.py: get_cached_tokens_details"


def _wrap_cached_tokens_details(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_cached_tokens_details(self, req):
        details = original(self, req)
        from patches.ipc_json import encode
        from sglang_ext.tail_replay import META_KEY, record_of, replay_summary

        record = record_of(req)
        if record is not None and record.plan is not None:
            details = {**(details or {"device": req.cached_tokens, "host": 0}), META_KEY: encode(replay_summary(record, len(req.origin_input_ids)))}
        linearkv = getattr(req, "_linearkv_record", None)
        if linearkv is not None and not linearkv.register and (linearkv.plan is not None or linearkv.fallback):
            from sglang_ext.linearkv import META_KEY as LINEARKV_KEY
            from sglang_ext.linearkv import summary

            details = {**(details or {"device": req.cached_tokens, "host": 0}), LINEARKV_KEY: encode(summary(linearkv))}
        return details

    return get_cached_tokens_details


def apply() -> None:
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    SchedulerOutputStreamer.get_cached_tokens_details = _wrap_cached_tokens_details(
        SchedulerOutputStreamer.get_cached_tokens_details)
