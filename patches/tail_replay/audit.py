"""Tail-Replay's live quality audit (`sglang_ext.tail_replay` `audit`: off unless the server sets
`audit_rate` > 0 or a request asks for `audit: true`). Its reference runs are background runs
(`patches/tail_replay/repair.py`: `background_request`, `run_background`), as the exact repair's are.

Two seams (SGLang 0.5.23):

- scheduler: `srt/managers/tp_worker.py::capture_pre_sample_logits`, SGLang's own hook for the raw
  next-token logits of a forward before the sampler rewrites them in place (temperature, softmax;
  imported by name into `tp_worker`, which is where it is replaced). At the forward that gives a
  request its first output (an extend that reaches the end of its prompt, no output yet), the
  request's audit is decided once (`audit_trigger`: forced, or a not-exact answer sampled at
  `audit_rate`); an audited request's log-probabilities (float32, CPU) are kept in a bounded store
  (`PendingAudits`) under its rid, and its record's `audit` goes into meta_info
  (`patches/tail_replay/meta.py`). A request carrying `audit_of` is an audit's reference run: its
  distribution is compared with the served one's (`divergence`), recorded (`record_audit`) and
  logged, one line per audit. Only the replica's recording rank keeps and compares.
- tokenizer process: `srt/managers/tokenizer_manager.py::TokenizerManager._handle_batch_output`.
  When an audited request finishes (meta_info `cached_tokens_details.tail_replay.audit`), its prompt
  (text or token ids, LoRA and DP routing of the request's state) is sent again as a
  `GenerateReqInput` through `generate_request` in an asyncio task (drained, output dropped):
  `exactness: "exact"`, no state stored, `audit_of` = the rid, one greedy token, at the
  least-favoured priority when the server runs `--enable-priority-scheduling`. A background run
  carries these values as the server's mark, out of band (`patches/tail_replay/request.py`:
  `mark_background_run`), never as request fields a client could also send.

Never raises into SGLang: a failure of the audit path is logged and the served request goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TARGET = ("srt/managers/tp_worker.py: capture_pre_sample_logits; "
          "srt/managers/tokenizer_manager.py: TokenizerManager._handle_batch_output")

#: reference runs in flight per tokenizer process; an audit due beyond this is skipped (logged)
MAX_REFERENCES_IN_FLIGHT = 4

_pending: Any = None                 # PendingAudits of this scheduler process (created on first use)
_references: set[asyncio.Task[None]] = set()   # the tokenizer process's reference runs in flight


# ------------------------------------------------------------------ scheduler


def _pending_audits() -> Any:
    global _pending
    if _pending is None:
        from sglang_ext.tail_replay import PendingAudits

        _pending = PendingAudits()
    return _pending


def _gives_first_output(req: Any) -> bool:
    """This forward computes the request's first output: it extends to the end of its prompt and
    the request has no output yet (a middle chunk of a chunked prefill stops short)."""
    end = getattr(req, "extend_end", None)
    return not req.output_ids and end is not None and end >= len(req.origin_input_ids)


def observe_forward(reqs: Any, next_token_logits: Any) -> None:
    """The audit's scheduler side for one extend forward (row i of the logits is reqs[i])."""
    from sglang_ext.tail_replay import record_of, records_here

    if next_token_logits.shape[0] != len(reqs):
        return
    for i, req in enumerate(reqs):
        record = record_of(req)
        if record is None or record.plan is None or not _gives_first_output(req) \
                or not record.first_time("audit_decided"):
            continue
        config = record.config
        if config.audit_of is None and not config.audit and config.server.audit_rate <= 0.0:
            continue
        if not records_here():
            continue
        if config.audit_of is not None:
            _compare(req, config.audit_of, next_token_logits[i])
        else:
            _keep(req, record, next_token_logits[i])


def _keep(req: Any, record: Any, logits: Any) -> None:
    from sglang_ext.tail_replay import ServedAnswer, audit_trigger, log_probs, output_provenance, prompt_key

    config = record.config
    bound, exact = output_provenance(record, len(req.origin_input_ids))
    trigger = audit_trigger(forced=config.audit, reference=config.background, exact=exact, rid=req.rid, rate=config.server.audit_rate)
    if trigger is None:
        return
    _pending_audits().add(ServedAnswer(rid=req.rid, trigger=trigger, kind=record.plan.kind.value, bound=bound,
                                       exact=exact, prompt=prompt_key(req.origin_input_ids),
                                       log_probs=log_probs(logits)))
    record.audit = trigger


def _compare(req: Any, served_rid: str, logits: Any) -> None:
    from sglang_ext.tail_replay import AuditResult, divergence, log_probs, prompt_key, record_audit

    served = _pending_audits().take(served_rid)
    if served is None:
        logger.warning("Tail-Replay audit: reference rid=%s found no served distribution for rid=%s (dropped "
                       "for room, %d so far, or served by another replica); not recorded",
                       req.rid, served_rid, _pending_audits().dropped)
        return
    if served.prompt != prompt_key(req.origin_input_ids):
        logger.warning("Tail-Replay audit: reference rid=%s ran another prompt than rid=%s; not recorded",
                       req.rid, served_rid)
        return
    result = AuditResult(served=served, reference_rid=req.rid,
                         divergence=divergence(log_probs(logits), served.log_probs))
    record_audit(served.trigger, result.divergence)
    logger.info(result.log_line())


def _wrap_capture(original: Callable) -> Callable:
    @functools.wraps(original)
    def capture_pre_sample_logits(batch, forward_batch, logits_output):
        original(batch, forward_batch, logits_output)
        if batch is None or logits_output is None or logits_output.next_token_logits is None:
            return
        try:
            if forward_batch.forward_mode.is_extend_without_speculative():
                observe_forward(batch.reqs, logits_output.next_token_logits)
        except Exception:   # the audit must never hurt the served requests
            logger.exception("Tail-Replay audit failed in the scheduler; the served requests are unaffected")

    return capture_pre_sample_logits


# ------------------------------------------------------------------ tokenizer process


def _audits_due(recv_obj: Any, rid_to_state: dict) -> list[tuple[str, str, Any]]:
    """(rid, trigger, request object) of each audited request this output finishes. Read before
    SGLang's handler drops the finished requests' states."""
    details = getattr(recv_obj, "cached_tokens_details", None)
    if not details:
        return []
    due = []
    for i, rid in enumerate(recv_obj.rids[:len(details)]):
        summary = details[i].get("tail_replay") if isinstance(details[i], dict) else None
        trigger = summary.get("audit") if isinstance(summary, dict) else None
        reason = recv_obj.finished_reasons[i]
        if trigger is None or reason is None or (isinstance(reason, dict) and reason.get("type") == "abort"):
            continue
        state = rid_to_state.get(rid)
        if state is not None:
            due.append((rid, trigger, state.obj))
    return due


def reference_request(tokenizer_manager: Any, rid: str, obj: Any) -> Any:
    """The reference run of the audited request `rid` (its `GenerateReqInput` `obj`), or None when
    its prompt cannot be sent again as is (multimodal data, embeddings, a session)."""
    from sglang_ext.patches.tail_replay.repair import NOT_IN_THE_IDS, background_request
    from sglang_ext.tail_replay import reference_overrides

    if any(getattr(obj, name, None) for name in (*NOT_IN_THE_IDS, "session_params")):
        return None
    text, input_ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    if input_ids is None and not isinstance(text, str):
        return None
    return background_request(tokenizer_manager, obj, text=None if input_ids is not None else text,
                               input_ids=None if input_ids is None else list(input_ids),
                               overrides=reference_overrides(rid), kind="audit")


def _submit(tokenizer_manager: Any, rid: str, trigger: str, obj: Any) -> None:
    from sglang_ext.patches.tail_replay.repair import run_background

    if len(_references) >= MAX_REFERENCES_IN_FLIGHT:
        logger.warning("Tail-Replay audit of rid=%s (%s) skipped: %d reference runs in flight", rid, trigger,
                       len(_references))
        return
    reference = reference_request(tokenizer_manager, rid, obj)
    if reference is None:
        logger.warning("Tail-Replay audit of rid=%s (%s) skipped: its prompt is not plain text or token ids",
                       rid, trigger)
        return
    task = asyncio.get_running_loop().create_task(run_background(tokenizer_manager, rid, reference))
    _references.add(task)
    task.add_done_callback(_references.discard)


def _wrap_handle_batch_output(original: Callable) -> Callable:
    @functools.wraps(original)
    async def _handle_batch_output(self, recv_obj):
        try:
            due = _audits_due(recv_obj, self.rid_to_state)
        except Exception:
            logger.exception("Tail-Replay audit: reading the finished requests failed; no audit sent")
            due = []
        await original(self, recv_obj)
        for rid, trigger, obj in due:
            try:
                _submit(self, rid, trigger, obj)
            except Exception:
                logger.exception("Tail-Replay audit of rid=%s: the reference run could not be sent", rid)

    return _handle_batch_output


def apply() -> None:
    from sglang.srt.managers import tp_worker
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tp_worker.capture_pre_sample_logits = _wrap_capture(tp_worker.capture_pre_sample_logits)
    TokenizerManager._handle_batch_output = _wrap_handle_batch_output(TokenizerManager._handle_batch_output)
