"""`kv_mode: "recompute"` in a streaming session: the turn's own recomputed tail ends with the turn.

A `kv_mode: "recompute"` request keeps the slots of its recomputed tail [P, L) as its own, below
its `cache_protected_len`, and frees them when its row is given back (`tail_replay/own_tail.py`:
`release`, from `TailReplayRadixCache.on_release`). A finished turn of a streaming session gives
its row to the session instead (`StreamingSession.try_cache_finished_req`, through
`claim_kv_row`): `on_release` never runs, the slots stay in the session's row below its protected
length, where neither the session's release (`release_session` frees from the protected length
on) nor SGLang's pool accounting (a session holds `allocated - protected`) sees them. The idle
pool check then finds them missing and, strict (SGLang's default), raises in the scheduler.

So when a finished turn's row goes to its session, the turn's own tail slots are freed and the
session's row points at the tree's exact KV of [P, L) instead, which the session's tree lock
holds (the lock sits on the node the turn's last insert ended on, at or below L). The turn was
served from its recomputed tail, as the mode says; the session's later turns attend to the
tree's exact KV there. An aborted turn is not kept by the session: its row is released as any
request's, own tail included. A retracted turn keeps its own tail until it finishes.

Target (SGLang 0.5.23): `srt/session/streaming_session.py::StreamingSession.try_cache_finished_req`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

TARGET = "srt/session/streaming_session.py: StreamingSession.try_cache_finished_req"


def _tree_slots(cache: Any, node_id: Any, end: int) -> Any:
    """The tree's KV slots of [0, end) on the path from the root to the node `node_id`."""
    import torch
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    node, chunks = cache.tree_core.node_by_id(node_id), []
    while node is not None and node is not cache.tree_core.root_node:
        chunks.append(node.component_data[ComponentType.FULL].value)
        node = node.parent
    slots = torch.cat(chunks[::-1]) if chunks else torch.empty(0, dtype=torch.int64)
    if len(slots) < end:
        raise RuntimeError(f"the session's tree lock covers {len(slots)} tokens, not the own tail's end {end}")
    return slots[:end]


def hand_to_session(cache: Any, req: Any, slot: Any) -> None:
    """The finished streaming turn `req` has just left its row to the session `slot`: free the
    turn's own recomputed tail slots and point the row at the tree's KV there."""
    from sglang.srt.mem_cache.common import free_kv_row_segments

    from sglang_ext.tail_replay import record_of

    record = record_of(req)
    own = None if record is None else record.own_kv
    if own is None or slot is None or slot.lock is None or not slot.kv.holds_kv:
        return
    start, slots = own
    record.own_kv = None
    end = start + len(slots)
    row = cache.req_to_token_pool.req_to_token[slot.kv.req_pool_idx]
    row[start:end] = _tree_slots(cache, slot.lock.node, end)[start:end].to(device=row.device, dtype=row.dtype)
    if slots.numel():
        free_kv_row_segments(cache.token_to_kv_pool_allocator, [(slots, start)], swa_evicted_seqlen=0)


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def try_cache_finished_req(self, req):
        # read before SGLang's call: a turn that was retracted (and so registered with its session
        # once already) finishes as its own predecessor, and `finish_req` then detaches
        # `req.session` (`srt/session/session_controller.py::Session.finish_req`)
        session = getattr(req, "session", None)
        session_id = None if session is None else session.session_id
        kept = original(self, req)
        if kept and req.finished() and session_id is not None:
            hand_to_session(self.cache, req, self.slots.get(session_id))
        return kept

    return try_cache_finished_req


def apply() -> None:
    from sglang.srt.session.streaming_session import StreamingSession

    StreamingSession.try_cache_finished_req = _wrap(StreamingSession.try_cache_finished_req)
