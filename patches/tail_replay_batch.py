"""Exact-KV Tail-Replay, part 1: find a forward batch's replayed-tail rows and their tree slots.

Target (SGLang 0.5.23): `srt/model_executor/forward_batch_info.py::ForwardBatch.init_new`. Per
extend forward, the rows of the packed batch that belong to a request's replayed tail
[prefix_len, L), and the tree's KV slots for them (`req.tail_replay_kv_slots`, set by the
tail_replay cache at match), are kept in a small registry keyed by objects that the runners'
copies of the batch share; `patches/tail_replay_attention.py` reads them. Also records each
request's Tail-Replay plan in the metrics at its first forward.
Requests without a Tail-Replay decision are untouched.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

#: tail rows/slots of recent extend batches, keyed by id() of the batch's `extend_seq_lens_cpu`
#: list and `extend_seq_lens` tensor. SGLang's model runners run the model on copies of the
#: ForwardBatch (dataclass replace / copy.copy), which drop attributes set on the original but
#: share those objects; the registry keeps them alive, so their ids are not reused meanwhile.
_TAIL_BY_BATCH: "OrderedDict[int, tuple]" = OrderedDict()
_MAX_BATCHES_IN_FLIGHT = 8

TARGET = "srt/model_executor/forward_batch_info.py: ForwardBatch.init_new"


def _tail_rows_and_slots(reqs, prefix_lens, extend_lens):
    """Rows of the packed extend batch inside a replayed tail, and the tree slots for them."""
    rows, slots, offset = [], [], 0
    for req, prefix, extend in zip(reqs, prefix_lens, extend_lens):
        plan, tail_slots = getattr(req, "tail_replay", None), getattr(req, "tail_replay_kv_slots", None)
        if tail_slots is not None and plan is not None:
            lo, hi = max(prefix, plan.replay_start), min(prefix + extend, plan.matched_tokens)
            if hi > lo:
                rows.append(torch.arange(offset + lo - prefix, offset + hi - prefix))
                slots.append(tail_slots[lo - plan.replay_start:hi - plan.replay_start])
        offset += extend
    if not rows:
        return None, None
    return torch.cat(rows), torch.cat(slots)


def _record_first_forward(reqs) -> None:
    from sglang_ext.tail_replay.metrics import record_plan

    for req in reqs:
        plan = getattr(req, "tail_replay", None)
        if plan is not None and not getattr(req, "tail_replay_recorded", False):
            req.tail_replay_recorded = True
            record_plan(plan)


def _wrap_init_new(original):
    @functools.wraps(original)
    def init_new(cls, batch, model_runner, **kwargs):
        fb = original.__func__(cls, batch, model_runner, **kwargs)
        if fb.forward_mode.is_extend() and not fb.forward_mode.is_target_verify():
            _record_first_forward(batch.reqs)
            prefix = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
            extend = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
            rows, slots = _tail_rows_and_slots(batch.reqs, prefix, extend)
            if rows is not None:
                _remember(_batch_keys(fb), rows.to(fb.input_ids.device), slots, model_runner.token_to_kv_pool)
        return fb

    return classmethod(init_new)


def _batch_keys(forward_batch) -> list:
    keys = (getattr(forward_batch, "extend_seq_lens_cpu", None), getattr(forward_batch, "extend_seq_lens", None))
    return [key for key in keys if key is not None]


def _remember(keys, rows, slots, kv_pool) -> None:
    for key in keys:
        _TAIL_BY_BATCH[id(key)] = (key, rows, slots, kv_pool)
    while len(_TAIL_BY_BATCH) > 2 * _MAX_BATCHES_IN_FLIGHT:
        _TAIL_BY_BATCH.popitem(last=False)


def tail_of(forward_batch):
    """(rows, slots, kv pool) of the replayed tails in this forward batch (or a copy of it), or None."""
    for key in _batch_keys(forward_batch):
        entry = _TAIL_BY_BATCH.get(id(key))
        if entry is not None and entry[0] is key:
            return entry[1:]
    return None


def apply() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    ForwardBatch.init_new = _wrap_init_new(ForwardBatch.__dict__["init_new"])
