"""Tail-Replay's exact repair runs (`sglang_ext.tail_replay.repair`: an answer's, off unless
`repair: true`; a shared state's, on unless `repair_shared: false`), and the background run both
they and the audit's reference runs are (`background_request`, `run_background`).

Target (SGLang 0.5.23): `srt/managers/tokenizer_manager.py::TokenizerManager._handle_batch_output`
(tokenizer process). An output that carries a repair sequence (`REPAIR_KEY` in a finished one, or
`SHARED_REPAIR_KEY` in a request's first output; put there by `patches/tail_replay/meta.py`) has the
key removed before SGLang's handler builds the response, and unless the request was aborted the
sequence is sent again as token ids through `generate_request` in an asyncio task (drained, output
dropped; `repair_overrides`: exact, `repair_of` = the rid, `repair_kind`, one greedy token, the
request's LoRA, `extra_key`, `cache_salt` and DP routing, at the least-favoured priority when the
server runs `--enable-priority-scheduling`), at most `MAX_REPAIRS_IN_FLIGHT` at a time. A
background run carries its values as the server's mark, out of band
(`patches/tail_replay/request.py`: `mark_background_run`), never as request fields a client could
also send. Applied before `shared/ipc_json` (whose decoding then runs first).

Never raises into SGLang: a failure is logged and the served request goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import uuid
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "srt/managers/tokenizer_manager.py: TokenizerManager._handle_batch_output (repair runs)"

_repairs: set[asyncio.Task[None]] = set()      # the tokenizer process's repair runs in flight


# ------------------------------------------------------------------ the background run


def background_request(tokenizer_manager: Any, obj: Any, *, text: Any, input_ids: Any, overrides: dict,
                        kind: str) -> Any:
    """A one-token greedy run the server sends itself, in the request `obj`'s cache namespace (LoRA,
    `extra_key`, `cache_salt`) and DP routing, at the least-favoured priority where priorities are
    scheduled."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.runtime_context import get_schedule

    priority = None
    if getattr(tokenizer_manager, "enable_priority_scheduling", False):
        priority = sys.maxsize if get_schedule().schedule_low_priority_values_first else -sys.maxsize - 1
    from sglang_ext.patches.tail_replay.request import mark_background_run
    from sglang_ext.tail_replay import background_mark

    run = GenerateReqInput(
        text=text, input_ids=input_ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
        rid=f"tail-replay-{kind}-{uuid.uuid4().hex}", priority=priority,
        lora_path=getattr(obj, "lora_path", None), routed_dp_rank=getattr(obj, "routed_dp_rank", None),
        extra_key=getattr(obj, "extra_key", None), cache_salt=getattr(obj, "cache_salt", None))
    return mark_background_run(run, background_mark(overrides))


#: request fields whose input the prompt's token ids do not carry: multimodal data (the ids hold
#: placeholder tokens), embeddings (the ids are placeholders)
NOT_IN_THE_IDS = ("image_data", "video_data", "audio_data", "input_embeds")


async def run_background(tokenizer_manager: Any, rid: str, reference: Any, what: str = "audit") -> None:
    try:
        async for _ in tokenizer_manager.generate_request(reference, None):
            pass
    except Exception as exc:   # logged, never raised: the served request is long answered
        logger.warning("Tail-Replay %s of rid=%s: the background run %s failed: %s: %s",
                       what, rid, reference.rid, type(exc).__name__, exc)


# ------------------------------------------------------------------ repair runs


def _repairs_due(recv_obj: Any, rid_to_state: dict) -> list[tuple[str, list[int], Any, str]]:
    """(rid, sequence, request object, repair kind) of each repair a request in this output asks
    for: a finished request's answer (`REPAIR_KEY`), a shared state on a request's path
    (`SHARED_REPAIR_KEY`, sent with its first output: the request may still be running); none for
    an aborted request. Both keys are removed from every entry (a client never sees them)."""
    from sglang_ext.tail_replay import REPAIR_KEY, SHARED_REPAIR_KEY

    details = getattr(recv_obj, "cached_tokens_details", None)
    due = []
    for i, entry in enumerate(details or ()):
        if not isinstance(entry, dict):
            continue
        asked = [(kind, entry.pop(key)) for key, kind in ((SHARED_REPAIR_KEY, "shared_state"), (REPAIR_KEY, "answer"))
                 if key in entry]
        if not asked:
            continue
        reason = recv_obj.finished_reasons[i] if i < len(recv_obj.finished_reasons) else None
        if isinstance(reason, dict) and reason.get("type") == "abort":
            continue
        state = rid_to_state.get(recv_obj.rids[i])
        for kind, sequence in asked:
            if reason is None and kind != "shared_state":
                continue   # an answer is repaired once it has finished; a shared prefix at once
            if state is not None and isinstance(sequence, list) and sequence:
                due.append((recv_obj.rids[i], sequence, state.obj, kind))
    return due


def repair_request(tokenizer_manager: Any, rid: str, sequence: list[int], obj: Any, kind: str = "answer") -> Any:
    """A repair run of `kind` for request `rid` (its `GenerateReqInput` `obj`) over `sequence` (the
    scheduler's token ids), or None when those ids do not carry the request's input
    (`NOT_IN_THE_IDS`): a run of the ids alone would compute other KV and store it as exact under
    the same key. A session turn's ids are its whole history, so it is repaired as any request."""
    from sglang_ext.tail_replay import repair_overrides

    if any(getattr(obj, name, None) for name in NOT_IN_THE_IDS):
        return None
    return background_request(tokenizer_manager, obj, text=None, input_ids=list(sequence),
                               overrides=repair_overrides(rid, kind), kind="repair")


def _submit_repair(tokenizer_manager: Any, rid: str, sequence: list[int], obj: Any, kind: str = "answer") -> None:
    from sglang_ext.tail_replay import MAX_REPAIRS_IN_FLIGHT

    if len(_repairs) >= MAX_REPAIRS_IN_FLIGHT:
        logger.warning("Tail-Replay repair of rid=%s (%s) skipped: %d repairs in flight (what it would have "
                       "made exact stays approximate until a later request asks again)", rid, kind, len(_repairs))
        return
    run = repair_request(tokenizer_manager, rid, sequence, obj, kind)
    if run is None:
        logger.warning("Tail-Replay repair of rid=%s (%s) skipped: its input is not in its token ids "
                       "(multimodal data or embeddings)", rid, kind)
        return
    task = asyncio.get_running_loop().create_task(run_background(tokenizer_manager, rid, run, "repair"))
    _repairs.add(task)
    task.add_done_callback(_repairs.discard)


def _wrap_handle_batch_output(original: Callable) -> Callable:
    @functools.wraps(original)
    async def _handle_batch_output(self, recv_obj):
        try:
            repairs = _repairs_due(recv_obj, self.rid_to_state)
        except Exception:
            logger.exception("Tail-Replay repair: reading the finished requests failed; no repair sent")
            repairs = []
        await original(self, recv_obj)
        for rid, sequence, obj, kind in repairs:
            try:
                _submit_repair(self, rid, sequence, obj, kind)
            except Exception:
                logger.exception("Tail-Replay repair of rid=%s: the repair run could not be sent", rid)

    return _handle_batch_output


def apply() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    TokenizerManager._handle_batch_output = _wrap_handle_batch_output(TokenizerManager._handle_batch_output)
