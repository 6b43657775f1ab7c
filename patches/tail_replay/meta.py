"""Tail-Replay's per-request summary in `meta_info["cached_tokens_details"]["tail_replay"]`, and
the other wings' summaries registered as meta contributors (`sglang_ext.hooks`), each under its
own key.

Reads the request's Tail-Replay record (`sglang_ext.tail_replay.record_of`) and writes
`answer_label(record)` (for a planned request `replay_summary`: the plan; `exact`: the state the
answer was computed from counts as exact; `kv_exact`: everything it read was exact, what
`exactness: "exact"` guarantees; `bound`; and for an approximate hit the state bound from its
tail's gates). On a server that serves with Tail-Replay (its backend, or one registered with
`sglang_ext.hooks.add_request_backend`) every answer carries that label: one without a plan (never
matched by Tail-Replay, assembled by another wing, or of unknown provenance) says `exact: false,
kv_exact: false` with the kind that says why (fail closed). The label covers what the answer
read: the state its next token comes from at the end of its last match (after a retraction, past
the prompt), what it generated under earlier plans, and the positions of the input logprobs it
returns (`logprob_start_len`). Other servers keep SGLang's details unchanged. A
finished answer that was not exact, on a server or request with `repair: true`, also carries its
sequence under `REPAIR_KEY` (`sglang_ext.tail_replay.repair`) for the tokenizer process, which
removes it and sends the repair run (`patches/tail_replay/audit.py`); a request that
asked for a shared state's repair (`repair_shared`, the default) carries that state's prefix under
`SHARED_REPAIR_KEY` the same way, in its first output (a streamed request's first token; otherwise
the output SGLang sends at its finish or forced stream interval), so that the repair runs while the
request decodes.

Each summary is written as `sglang_ext.patches.shared.ipc_json.encode(summary)` (a tagged JSON string: SGLang's IPC
types the field `Dict[str, Union[int, str]]`), and turned back into an object in the tokenizer
process by `sglang_ext.patches.shared.ipc_json.py`, so clients see nested JSON under both IPC modes.

Target (SGLang 0.5.23): `srt/managers/scheduler_components/output_streamer.py::
SchedulerOutputStreamer.get_cached_tokens_details`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TARGET = "srt/managers/scheduler_components/output_streamer.py: get_cached_tokens_details"


@functools.lru_cache(maxsize=4)
def _labels_answers(radix_cache_backend: str | None) -> bool:
    from sglang_ext.hooks import request_backends
    from sglang_ext.tail_replay import BACKEND_NAME

    return radix_cache_backend == BACKEND_NAME or radix_cache_backend in request_backends()


def this_server_labels() -> bool:
    """Whether this server labels every answer (Tail-Replay's backend, or one registered with
    `sglang_ext.hooks.add_request_backend`)."""
    from sglang.srt.runtime_context import get_server_args

    return _labels_answers(getattr(get_server_args(), "radix_cache_backend", None))


def label_of(req, server_labels: Callable[[], bool] = this_server_labels) -> dict | None:
    """The label an answer of `req` carries (`answer_label`, its input logprobs read from
    `logprob_start_len`), or None: a request without a plan on a server that does not label
    (`server_labels()`, asked only for a request without a plan). The one rule for `meta_info` and for what PD
    disaggregation carries (`patches/tail_replay/disagg.py`)."""
    from sglang_ext.tail_replay import answer_label, record_of

    record = record_of(req)
    if not ((record is not None and record.plan is not None) or server_labels()):
        return None
    start = req.logprob_start_len if req.return_logprob else -1   # input logprobs read from there on
    return answer_label(record, len(req.origin_input_ids), start)


def _wrap_cached_tokens_details(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_cached_tokens_details(self, req):
        details = original(self, req)
        from sglang_ext.hooks import meta_contributions
        from sglang_ext.patches.shared.ipc_json import encode
        from sglang_ext.tail_replay import (
            META_KEY,
            REPAIR_KEY,
            SHARED_REPAIR_KEY,
            record_of,
            record_repair_finished,
            repair_due,
            repair_sequence,
        )

        record = record_of(req)
        planned = record is not None and record.plan is not None
        summary = label_of(req)
        if summary is not None:
            details = {**(details or {"device": req.cached_tokens, "host": 0}), META_KEY: encode(summary)}
        if planned:
            exact = summary.get("exact", True)
            if not exact and repair_due(record.config, exact=exact, finished=req.finished()):
                details[REPAIR_KEY] = encode(repair_sequence(req.origin_input_ids, req.output_ids))
            if record.shared_repair is not None:   # with the first output: the repair runs while it decodes
                details[SHARED_REPAIR_KEY] = encode(list(req.origin_input_ids[:record.shared_repair]))
                record.shared_repair = None
            if req.finished():
                record_repair_finished(record)
        for key, value in meta_contributions(req):   # other wings' summaries (sglang_ext.hooks)
            details = {**(details or {"device": req.cached_tokens, "host": 0}), key: encode(value)}
        return details

    return get_cached_tokens_details


def apply() -> None:
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    SchedulerOutputStreamer.get_cached_tokens_details = _wrap_cached_tokens_details(
        SchedulerOutputStreamer.get_cached_tokens_details)
