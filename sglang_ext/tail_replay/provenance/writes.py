"""The one place that decides the provenance of what enters the tree (pure: no SGLang import;
torch only where tensors are built). Every insert, state store and host write-back of the Tail-
Replay cache (and of every wing built on it) asks the running insert's `InsertContext`, whose
`bounds` / `state_bound` are `insert_bounds` / `state_bound` below; the storage
write reads the result off the tree (`TailReplayRadixCache.write_backup_storage`).

Fail closed: the provenance of what a request inserts is known only while its record holds the
plan it was served by (`tracks`). Anything else is UNTRACKED (`provenance.UNTRACKED`, an infinite
bound: never exact under any threshold, never resumed from, never written to storage, never
replacing a label on overlap):

- no record: a request the planner never matched (a request whose KV was computed elsewhere and
  transferred; a streaming session's later turn whose session's provenance is not known:
  `sessions.py` plans the others);
- a dropped plan: another wing served the request some other way after the match (e.g. position-independent
  assembled chunks, `TailReplayRequest.drop_plan`);
- transferred KV: the decode side of PD disaggregation inserts KV a prefill server computed;
- a withheld state that reaches the tree anyway (its request said it is not to be kept).

An insert that runs outside any request's caching (SGLang's storage prefetch grafting pages the
storage tier holds, which takes strictly exact KV only) is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_ext.tail_replay.provenance.bounds import UNTRACKED, counts_exact
from sglang_ext.tail_replay.request import TailReplayRequest, bounds_of, max_bound_of

if TYPE_CHECKING:
    import torch


def tracks(record: TailReplayRequest | None) -> bool:
    """Whether the record knows how the request computed what it inserts: it holds its plan."""
    return record is not None and record.plan is not None


def insert_bounds(record: TailReplayRequest | None, start: int, end: int, *, caching: bool,
                  transferred: bool = False, history: torch.Tensor | None = None) -> torch.Tensor:
    """The bound of each position in [start, end) an insert brings into the tree (float32, CPU).

    caching: the insert is a request's caching (`checkpoint_into_tree`; `record` is that request's
    record, or None); False: an insert without a request (exact, see the module docstring).
    transferred: the request's KV past its own match was computed elsewhere (PD decode).
    history: a streaming session's turn: the bounds of the positions its session's earlier turns
    computed (`sessions.SessionProvenance`); they hold below the turn's own prefix."""
    import torch

    if not caching:
        return torch.zeros(max(end - start, 0), dtype=torch.float32)
    if transferred or not tracks(record):
        return torch.full((max(end - start, 0),), UNTRACKED, dtype=torch.float32)
    assert record is not None and record.plan is not None
    bounds = bounds_of(record, start, end)
    if history is not None:
        upto = min(len(history), record.plan.prefix_len, end)
        if upto > start:
            bounds[:upto - start] = history[start:upto]
    return bounds


def insert_max_bound(record: TailReplayRequest | None, start: int, end: int, *, caching: bool,
                     transferred: bool = False, history: torch.Tensor | None = None) -> float:
    """The largest of `insert_bounds(...)` over [start, end) (0 for an empty span), read without
    building the tensor where no session history and no carried row fall in the span."""
    if end <= start or not caching:
        return 0.0
    if transferred or not tracks(record):
        return UNTRACKED
    if history is None:
        return max_bound_of(record, start, end)
    return float(insert_bounds(record, start, end, caching=caching, transferred=transferred, history=history).max())


def state_bound(record: TailReplayRequest | None, depth: int, *, caching: bool, transferred: bool = False,
                history: torch.Tensor | None = None) -> float:
    """The bound of a state an insert stores at `depth` (the bound of its last position; 0 at
    the root). A state its request withheld is UNTRACKED."""
    if depth <= 0:
        return 0.0
    if caching and record is not None and record.state_withheld:
        return UNTRACKED
    return insert_max_bound(record, depth - 1, depth, caching=caching, transferred=transferred, history=history)


class InsertContext:
    """What one request's caching (`checkpoint_into_tree`) brings into the tree, for the time it
    runs: its record (None: untracked), its prompt length (where its generated answer begins), its
    streaming session's history and whether its KV was transferred (PD decode). Every bound the
    insert stores is asked of it (`bounds`, `state_bound`): the one write path of provenance. No
    context (an insert outside any request's caching: SGLang's storage prefetch) is exact
    (`NO_REQUEST`). Holds no tree reference; set once, never changed."""

    __slots__ = ("record", "prompt_len", "history", "transferred", "caching")

    def __init__(self, record: TailReplayRequest | None, prompt_len: int | None, *,
                 history: torch.Tensor | None = None, transferred: bool = False, caching: bool = True) -> None:
        self.record, self.prompt_len, self.history = record, prompt_len, history
        self.transferred, self.caching = transferred, caching

    def bounds(self, start: int, end: int) -> torch.Tensor:
        """The bound of each position in [start, end) (`insert_bounds`). Reads only."""
        return insert_bounds(self.record, start, end, caching=self.caching, transferred=self.transferred,
                             history=self.history)

    def max_bound(self, start: int, end: int) -> float:
        """The largest bound in [start, end) (`insert_max_bound`; 0 when all of it is strictly
        exact). Reads only."""
        return insert_max_bound(self.record, start, end, caching=self.caching, transferred=self.transferred,
                                history=self.history)

    def state_bound(self, depth: int) -> float:
        """The bound of a state stored at `depth` (`state_bound`). Reads only."""
        return state_bound(self.record, depth, caching=self.caching, transferred=self.transferred,
                           history=self.history)

    def awaits_repair_at(self, depth: int, bound: float) -> bool:
        """Whether a state of `bound` at `depth` is one the tree should not take from this request:
        it asked a repair for the exact state at that depth, and its own does not count as exact
        (stored, it would hold the node against the repair's: the request locks the node it
        inserts while it runs, and a locked state is not replaced). Reads only."""
        record = self.record
        return (record is not None and record.repair_asked_at == depth
                and not counts_exact(bound, record.config.server.exact_threshold))


#: the context of an insert that runs outside any request's caching: exact
NO_REQUEST = InsertContext(None, None, caching=False)
