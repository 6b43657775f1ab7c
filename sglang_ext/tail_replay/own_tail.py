"""`kv_mode: "recompute"`: a request keeps its recomputed tail KV for its whole life.

Meaning of the mode. On a Tail-Replay hit with a replayed tail [P, L) (P = prefix_len, L = matched
tokens), the tail's attention KV is recomputed by the request's own prefill, and the request attends
to that recomputed KV for the tail in prefill *and* decode. The tree keeps its exact KV for [0, L)
and is never given the recomputed slots. (`kv_mode: "exact"` instead substitutes the tree's K/V into
the tail rows, `patches/tail_replay/attention.py`.)

Why it needs code: after each prefill chunk (and at finish) SGLang publishes the request into the
tree (`UnifiedRadixCache.checkpoint_into_tree`): the insert frees the request's slots for every
position the tree already holds above `req.kv.cache_protected_len` as duplicates and rewrites the
request's KV row there to the tree's slots. Left alone, that turns a recompute into an exact-KV
request from the first chunk boundary on.

How: before that insert, `cache_protected_len` (and the insert's `prev_prefix_len`) is raised over
the part of [P, L) the insert covers, so the insert neither frees those slots nor rewrites the row
there; the slots are recorded as the request's own (its record's `own_kv`) and freed by
`release()` when the request's row is given back (finish, abort, retraction: SGLang's single path
`release_kv_cache` -> `on_release`). Positions past L are published as usual. The tree path [0, L)
stays locked by the request (its match locked the node at depth L), so the insert always finds the
tree's own nodes there and never adopts the recomputed slots.

Accounting: the own slots lie below `cache_protected_len`, so SGLang's per-request "private
tokens" (allocated - protected) does not count them while the request runs; the idle check (no
request running) is exact. SGLang's optional busy-time check (`SGLANG_ENABLE_STRICT_MEM_CHECK_
DURING_BUSY`) would count them as missing.

Hooks: the record sets `own_end` with each plan (`request.own_tail_end`); the cache asks its
`OwnTailClaims` part only for a request that has one (`request.owns_tail`): `claiming` around
`checkpoint_into_tree`, `insert` around `insert` while a claim is armed, `release` in `on_release`
while the request holds own slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sglang_ext.tail_replay.request import own_tail_end, record_of

__all__ = ["OwnTailClaims", "own_slots", "own_tail_end"]


class OwnTailClaims:
    """One cache's claims of recompute tails over its inserts (`claiming` arms the next insert of
    a request's caching, `insert` claims). Needs the cache's request-to-token pool (the request's
    row is read) and its KV allocator (a released request's own slots are freed there).
    May mutate: the armed request, the record's `own_kv`, the request's `cache_protected_len`,
    the insert's `prev_prefix_len`, the allocator (release)."""

    def __init__(self, req_to_token_pool: Any, kv_allocator: Any) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_allocator = kv_allocator
        #: the request whose caching runs and whose own tail is not yet claimed (one-shot)
        self.armed: Any = None

    @contextmanager
    def claiming(self, req: Any) -> Iterator[None]:
        """Around `checkpoint_into_tree(req)` (and its second insert, the KV past the state): arm
        `insert` for this request's tail, if it has one that is not yet claimed."""
        record = record_of(req)
        end = None if record is None else record.own_end
        if end is None or not req.kv.holds_kv or req.kv.cache_protected_len >= end:
            yield
            return
        self.armed = req
        try:
            yield
        finally:
            self.armed = None

    def insert(self, params: Any, insert_fn: Callable[[Any], Any]) -> Any:
        """Around the tree insert of `checkpoint_into_tree`: claim [protected, min(L, inserted key))
        for the request (not freed as duplicates, row not rewritten), then insert."""
        req = self.armed
        if req is None:
            return insert_fn(params)
        self.armed = None   # only the request's own insert, not a follow-up one
        record = record_of(req)
        start = req.kv.cache_protected_len
        claim_to = min(record.own_end, len(params.key))
        if claim_to <= start:
            return insert_fn(params)
        params.prev_prefix_len = max(params.prev_prefix_len, claim_to)
        result = insert_fn(params)
        if getattr(result, "rotation_tail_declined", False):
            return result   # SGLang keeps the whole row the request's own then; nothing to claim
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:claim_to].to(torch.int64).clone()
        own = record.own_kv
        if own is None:
            record.own_kv = (start, row)
        else:
            own_start, slots = own
            assert own_start + len(slots) == start, "own tail claims must be contiguous"
            record.own_kv = (own_start, torch.cat([slots, row]))
        req.kv.cache_protected_len = claim_to
        return result

    def release(self, req: Any) -> None:
        """When the request's row is given back: free its own tail slots, once."""
        record = record_of(req)
        own = None if record is None else record.own_kv
        if own is None:
            return
        record.own_kv = None
        from sglang.srt.mem_cache.common import free_kv_row_segments

        start, slots = own
        if slots.numel():
            free_kv_row_segments(self.kv_allocator, [(slots, start)], swa_evicted_seqlen=0)


def own_slots(req: Any) -> torch.Tensor | None:
    """The KV slots the request holds for its recomputed tail (None if none)."""
    record = record_of(req)
    own = None if record is None else record.own_kv
    return None if own is None else own[1]
