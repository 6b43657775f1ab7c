"""Streaming sessions under Tail-Replay (SGLang adapter: `StreamingTurns`, a part of
`TailReplayRadixCache`).

SGLang answers a streaming session's turn 2+ from the session's slot before the tree match
(`UnifiedRadixCache.match_prefix` -> `StreamingSession.try_match_prefix`): the turn continues the
slot's KV and linear state, so the planner never sees it. Here the provenance of the slot's KV and
state is carried forward from turn to turn (`SessionProvenance`, one per open session, kept while
its slot lives), and each later turn is planned from it like any request (a checkpoint plan at the
slot's end: exact or approximate by the slot's end bound, carrying that bound), so its
meta_info, counters and inserts say what it read. A turn whose `exactness` the session cannot
honour (`exactness: "exact"` on a session whose earlier turns were not strictly exact, or whose
provenance is not known) is refused before the slot lends it its record: SGLang's pre-abort
(`Req.set_finish_with_abort`, HTTP 400 with the reason; the session and its slot stay). An
aborted turn (its slot is released, its KV inserted into the tree) inserts with the real bounds of
every position: its own, and its session's earlier turns'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.session.streaming_session import is_virtual_node

from sglang_ext.tail_replay.config import REQUEST_PARAM_KEY, TailReplayConfig
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan
from sglang_ext.tail_replay.provenance import bounds as provenance
from sglang_ext.tail_replay.provenance.bounds import CarryBound
from sglang_ext.tail_replay.provenance.writes import InsertContext
from sglang_ext.tail_replay.request import record_of


@dataclass(frozen=True)
class SessionProvenance:
    """What a streaming session's slot holds: per position of its KV [0, committed) the bound
    (the state at the end carries the last position's), and whether some turn read tree KV of
    bound > 0 (the positions it read are not in `kv` as they are in the tree)."""

    kv: torch.Tensor
    reads_inexact: bool

    def strictly_exact(self, upto: int) -> bool:
        return not self.reads_inexact and len(self.kv) >= upto and not bool((self.kv[:upto] > 0).any())


def session_plan(prov: SessionProvenance, prefix: int,
                 config: TailReplayConfig) -> tuple[ReplayPlan, CarryBound | None, float]:
    """(plan, carry, read floor) of a turn that continues its session's slot at `prefix` (pure):
    a checkpoint plan whose state is the slot's, exact where its bound counts as exact under the
    turn's exactness (strict: the whole slot strictly exact), carrying that bound on."""
    bound = float(prov.kv[prefix - 1]) if prefix else 0.0
    exact = prov.strictly_exact(prefix) if config.strict else provenance.counts_exact(bound, config.threshold)
    kind = HitKind.EXACT_CHECKPOINT if exact else HitKind.APPROXIMATE_CHECKPOINT
    carry = CarryBound(prefix, provenance.log_of_bound(bound)) if bound > 0.0 else None
    read_inexact = prov.reads_inexact or (prefix > 0 and bool((prov.kv[:prefix] > 0).any()))
    return ReplayPlan(kind, prefix, prefix, prefix), carry, provenance.TAINT if read_inexact else 0.0


def refusal(prov: SessionProvenance | None, prefix: int, config: TailReplayConfig, session_id: str) -> str | None:
    """Why a turn's exactness cannot be honoured by its session (None: it can). Only the exact
    mode asks more than a plan can give: every earlier turn strictly exact."""
    if not config.strict or (prov is not None and prov.strictly_exact(prefix)):
        return None
    why = ("its earlier turns' provenance is not known" if prov is None
           else "its earlier turns read or computed KV that is not strictly exact")
    return (f"custom_params[{REQUEST_PARAM_KEY!r}]: 'exactness': 'exact' cannot be honoured in streaming "
            f"session {session_id!r}: {why}, and a turn continues its session's KV and state; open a new "
            "session, or send the whole prompt without session_params")


def streaming_session_id(req: Any) -> str | None:
    session = None if req is None else getattr(req, "session", None)
    return session.session_id if session is not None and session.streaming else None


class StreamingTurns:
    """The cache's streaming-session rules. Needs the cache (its SGLang `StreamingSession`,
    `cache.session`, read when a turn comes) and the request records (`record_for(req)`). SGLang's
    own hook is handed to each method (`stock`). May mutate: its table of session provenance, the
    turns' records, a refused turn."""

    def __init__(self, cache: Any, record_for: Callable[[Any], Any]) -> None:
        self.cache = cache
        self.record_for = record_for
        #: per open streaming session with a slot: its provenance
        self.table: dict[str, SessionProvenance] = {}
        #: (the aborted turn being released, its session's history) between `claim_kv_row` and the
        #: turn's insert (`history`)
        self.released: tuple[Any, torch.Tensor | None] | None = None

    def reset(self) -> None:
        """The tree was reset (`/flush_cache`: SGLang rebuilds the session slots too): a stale
        entry would label a new slot of the same session id with an old slot's provenance."""
        self.table = {}
        self.released = None

    def match_prefix(self, params: Any, stock: Callable[[Any], Any]) -> Any:
        req = params.req
        session = self.cache.session
        session_id = streaming_session_id(req)
        if session_id is not None and req.to_finish is None and session.will_lend_record(req):
            slot = session.slots[session_id]
            prefix = min(slot.kv.kv_committed_len, len(params.key))
            why = refusal(self.table.get(session_id), prefix, self.record_for(req).config, session_id)
            if why is not None:
                return self._refuse_turn(params, why, stock)
        result = stock(params)
        if session_id is not None and is_virtual_node(result.last_device_node):
            self._plan_session_turn(req, session_id, result.device_prefix_len)
        return result

    def _refuse_turn(self, params: Any, why: str, stock: Callable[[Any], Any]) -> Any:
        """SGLang's pre-abort of a queued request (`Req.set_finish_with_abort`: a one-token prefill,
        then HTTP 400 with `why`): the turn is detached from its session, whose slot stays for the
        next turn (`StreamingSession.find_active_slot`), and matched as the one token it is now.
        May mutate: the request (its abort, input, fill ids, session)."""
        req = params.req
        req.set_finish_with_abort(why)
        req.refresh_fill_ids()
        assert self.cache.session.find_active_slot(req) is None   # detaches it (the session's abort_req)
        return stock(dataclasses.replace(params, key=params.key[:0]))

    def _plan_session_turn(self, req: Any, session_id: str, prefix: int) -> None:
        """A turn the session's slot answered: its plan, carry and floor from the session's
        provenance (none known: no plan, so what it inserts is untracked). May mutate: the
        request's record."""
        record = self.record_for(req)
        prov = self.table.get(session_id)
        if prov is None or len(prov.kv) < prefix:
            record.drop_plan()
            return
        plan, carry, floor = session_plan(prov, prefix, record.config)
        record.set_plan(plan, carry, floor)

    def claim_kv_row(self, req: Any, stock: Callable[[Any], bool]) -> bool:
        """A finished (or retracted) streaming turn leaves its row to its session: the session's
        provenance becomes the turn's whole sequence's. An aborted turn's session is gone: its
        provenance goes with the turn's release (`history`). May mutate: the table."""
        session_id = streaming_session_id(req)
        if session_id is None or self.cache.session.borrowed_slot(req) is None:
            return stock(req)
        before = self.table.get(session_id)
        n = len(req.origin_input_ids) + (req.finished_len if req.finished_len is not None else len(req.output_ids))
        kv = InsertContext(record_of(req), None, history=None if before is None else before.kv).bounds(0, n)
        kept = stock(req)
        if kept:
            record = record_of(req)
            self.table[session_id] = SessionProvenance(
                kv, (before is not None and before.reads_inexact) or (record is not None and record.floor > 0))
        else:
            self.table.pop(session_id, None)
            self.released = (req, None if before is None else before.kv)
        return kept

    def history(self, req: Any) -> torch.Tensor | None:
        """The bounds of what a streaming turn's session computed before it (an aborted turn being
        released; a live turn's session), or None. Reads only."""
        released = self.released
        if released is not None and released[0] is req:
            return released[1]
        session_id = streaming_session_id(req)
        prov = None if session_id is None else self.table.get(session_id)
        return None if prov is None else prov.kv

    def release_session(self, session_id: str) -> None:
        """SGLang closes the session (the caller then runs SGLang's own release). May mutate:
        the table."""
        self.table.pop(session_id, None)
