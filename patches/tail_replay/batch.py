"""Exact-KV Tail-Replay, part 1: find a forward batch's replayed-tail rows and their tree slots
(and, for the state bound, the rows of every approximate replay's tail; for provenance, the rows
each request computes after an approximate start: `carry_segments_of`).

Target (SGLang 0.5.23): `srt/model_executor/forward_batch_info.py::ForwardBatch.init_new`. Per
extend forward, the rows of the packed batch that belong to a request's replayed tail
[prefix_len, L), and the tree's KV slots for them (the record's `kv_slots`, set by the
tail_replay cache at match; `sglang_ext.tail_replay.record_of`), are kept in a small registry;
`patches/tail_replay/attention.py` and `tail_replay/prefill_graph.py` read them (`tail_of`).
The rows of approximate replays' tails (either KV mode), with each request's `TailDecay`, are kept
beside them for the gate hooks (`bound_segments_of`: `patches/tail_replay/linear_bound.py`).
Also records each request's Tail-Replay plan in the metrics at its first forward.
Under tensor parallelism the segments carry the attention-TP group (`head_shards`): each rank's
hooks see only its heads, and the segments gather over the group so every rank holds the same
bounds and so makes the same plans, frees and evictions.
Requests without a Tail-Replay record are untouched.

Why a registry and not the request record or the batch: the rows are positions in one packed
batch of several requests (not a property of any one request), and the model runs on copies of
the ForwardBatch: `dataclasses.replace` in SGLang's eager runner drops every attribute set on the
original, and the prefill graph runner's padded view (`copy.copy`) swaps `extend_seq_lens` for a
static buffer. The copies share the batch's `extend_seq_lens_cpu` list or its `extend_seq_lens`
tensor (a list takes no attribute), so the registry is keyed by the id() of both and holds them,
so their ids are not reused while an entry lives; it keeps the entries of the last few batches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sglang_ext.hooks import decay_capture
from sglang_ext.tail_replay import (
    BoundSegments,
    CarrySegments,
    DistributedHeadShards,
    HeadShards,
    HitKind,
    bound_segments,
    carry_segments,
    record_first_forward,
    record_of,
)

#: (rows, slots, kv pool) of a batch's replayed tails
Tail = tuple[torch.Tensor, torch.Tensor, Any]

#: tail rows/slots (and bound segments) of recent extend batches, keyed by id() of the batch's `extend_seq_lens_cpu`
#: list and `extend_seq_lens` tensor (see the module docstring); each entry holds its key object.
_TAIL_BY_BATCH: OrderedDict[int, tuple] = OrderedDict()
#: how many entries of `_TAIL_BY_BATCH` hold bound segments or carries (`any_bound_rows`)
_bounded_entries = 0
_MAX_BATCHES_IN_FLIGHT = 8

TARGET = "srt/model_executor/forward_batch_info.py: ForwardBatch.init_new"


def _tail_rows_and_slots(reqs: Sequence[Any], prefix_lens: Sequence[int], extend_lens: Sequence[int]
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rows of the packed extend batch inside a replayed tail, and the tree slots for them."""
    rows, slots, offset = [], [], 0
    for req, prefix, extend in zip(reqs, prefix_lens, extend_lens):
        record = record_of(req)
        plan, tail_slots = (None, None) if record is None else (record.plan, record.kv_slots)
        if tail_slots is not None and plan is not None:
            lo, hi = max(prefix, plan.replay_start), min(prefix + extend, plan.matched_tokens)
            if hi > lo:
                rows.append(torch.arange(offset + lo - prefix, offset + hi - prefix))
                slots.append(tail_slots[lo - plan.replay_start:hi - plan.replay_start])
        offset += extend
    if not rows:
        return None, None
    return torch.cat(rows), torch.cat(slots)


def head_shards() -> HeadShards | None:
    """The attention-TP group whose ranks each hold a shard of the linear layers' heads (GDN and,
    under DP attention, Mamba-2 shard over it; without DP attention it is the TP group, which
    Mamba-2 shards over), or None on a single rank. Every rank of it runs the same batch, so the
    gate hooks gather there (`provenance.forward.HeadShards`)."""
    from sglang.srt.runtime_context import get_parallel

    size = get_parallel().attn_tp_size
    if size <= 1:
        return None
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    return DistributedHeadShards(get_attn_tp_group().device_group, size)


def _bound_segments(reqs: Sequence[Any], prefix_lens: Sequence[int], extend_lens: Sequence[int]
                    ) -> BoundSegments | None:
    """Rows of the packed extend batch inside approximate replays' tails, per request, and the
    rows other wings capture (`sglang_ext.hooks.decay_capture`)."""
    tails = []
    for req in reqs:
        record = record_of(req)
        plan = None if record is None else record.plan
        approximate = record is not None and plan is not None and plan.kind is HitKind.APPROXIMATE
        tails.append((record.tail_decay, plan.replay_start, plan.matched_tokens) if approximate else decay_capture(req))
    if not any(tail is not None for tail in tails):
        return None   # the common batch: no replayed tail, no capture
    return bound_segments(tails, prefix_lens, extend_lens)


def _carry_segments(reqs: Sequence[Any], prefix_lens: Sequence[int], extend_lens: Sequence[int]
                    ) -> CarrySegments | None:
    """Rows of the packed extend batch that requests compute after an approximate start (their
    provenance bound per position, `sglang_ext.tail_replay.provenance.bounds`)."""
    records = [record_of(req) for req in reqs]
    return carry_segments([None if r is None else r.carry for r in records], prefix_lens, extend_lens)


def _record_first_forward(reqs: Sequence[Any]) -> None:
    for req in reqs:
        record = record_of(req)
        if record is not None:
            record_first_forward(record)


def _wrap_init_new(original: classmethod) -> classmethod:
    @functools.wraps(original)
    def init_new(cls, batch, model_runner, **kwargs):
        fb = original.__func__(cls, batch, model_runner, **kwargs)
        if fb.forward_mode.is_extend() and not fb.forward_mode.is_target_verify():
            _record_first_forward(batch.reqs)
            prefix = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
            extend = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
            rows, slots = _tail_rows_and_slots(batch.reqs, prefix, extend)
            segments = _bound_segments(batch.reqs, prefix, extend)
            carries = _carry_segments(batch.reqs, prefix, extend)
            if rows is not None or segments is not None or carries is not None:
                device = fb.input_ids.device
                if rows is not None:
                    rows = rows.to(device)
                shards = head_shards() if segments is not None or carries is not None else None
                if segments is not None:
                    segments = dataclasses.replace(segments, rows=segments.rows.to(device),
                                                   segment=segments.segment.to(device), shards=shards)
                if carries is not None:
                    carries = dataclasses.replace(carries, rows=carries.rows.to(device), shards=shards)
                _remember(_batch_keys(fb), rows, slots, model_runner.token_to_kv_pool, segments, carries,
                          translation_of(model_runner) if rows is not None else None)
        return fb

    return classmethod(init_new)


def _batch_keys(forward_batch: Any) -> list:
    keys = (getattr(forward_batch, "extend_seq_lens_cpu", None), getattr(forward_batch, "extend_seq_lens", None))
    return [key for key in keys if key is not None]


def _bounds_rows(entry: tuple | None) -> int:
    return int(entry is not None and (entry[4] is not None or entry[5] is not None))


def translation_of(model_runner: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How the tree's KV slot ids become pool indices: None where they are the same; on a unified
    pool (`--enable-unified-memory`: the runner's `kv_index_translator` translates) the allocator's
    `translate_kv_loc` (virtual -> physical, read at each use: compaction moves pages between
    iterations). A translating runner without it cannot read cached K/V: a clear error."""
    translator = getattr(model_runner, "kv_index_translator", None)
    if translator is None or not translator.is_translating:
        return None
    translate = getattr(model_runner.token_to_kv_pool_allocator, "translate_kv_loc", None)
    if translate is None:
        raise NotImplementedError("exact-KV Tail-Replay reads cached K/V by slot id; this KV pool translates ids "
                                  "but its allocator has no translate_kv_loc; use kv_mode 'recompute'")
    return translate


def _remember(keys: list, rows: torch.Tensor | None, slots: torch.Tensor | None, kv_pool: Any,
              segments: BoundSegments | None = None, carries: CarrySegments | None = None,
              translate: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    global _bounded_entries
    for key in keys:
        entry = (key, rows, slots, kv_pool, segments, carries, translate)
        _bounded_entries += _bounds_rows(entry) - _bounds_rows(_TAIL_BY_BATCH.get(id(key)))
        _TAIL_BY_BATCH[id(key)] = entry
    while len(_TAIL_BY_BATCH) > 2 * _MAX_BATCHES_IN_FLIGHT:
        _bounded_entries -= _bounds_rows(_TAIL_BY_BATCH.popitem(last=False)[1])


def any_bound_rows() -> bool:
    """Whether some remembered batch (the memo keeps the last extend batches that had tails) has
    rows whose bound the gate hooks sum (an approximate replay's tail, or rows computed after an
    approximate start). False: no batch can have one, and the linear bound seam
    (`linear_bound.py`) has nothing to do."""
    return _bounded_entries > 0


def _entry_of(forward_batch: Any) -> tuple | None:
    for key in _batch_keys(forward_batch):
        entry = _TAIL_BY_BATCH.get(id(key))
        if entry is not None and entry[0] is key:
            return entry
    return None


def tail_of(forward_batch: Any) -> Tail | None:
    """(rows, slots, kv pool) of the exact-KV replayed tails in this forward batch (or a copy of
    it), or None. The slots are pool indices: translated from the tree's ids where the pool
    translates them (`translation_of`)."""
    entry = _entry_of(forward_batch)
    if entry is None or entry[1] is None:
        return None
    translate = entry[6]
    return entry[1], entry[2] if translate is None else translate(entry[2]), entry[3]


def bound_segments_of(forward_batch: Any) -> BoundSegments | None:
    """The rows of approximate replays' tails in this forward batch (or a copy of it), or None."""
    entry = _entry_of(forward_batch)
    return None if entry is None else entry[4]


def carry_segments_of(forward_batch: Any) -> CarrySegments | None:
    """The rows requests compute after an approximate start in this forward batch, or None."""
    entry = _entry_of(forward_batch)
    return None if entry is None else entry[5]


def apply() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    ForwardBatch.init_new = _wrap_init_new(ForwardBatch.__dict__["init_new"])
