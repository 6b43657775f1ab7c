"""Provenance of cached tokens: how far each tree node's KV, and each stored state, may be from an
exact computation (pure: no SGLang import; torch only where tensors are computed on).

The number is a *bound* b >= 0, relative to the linear state a replay dropped:

- 0: exact. Computed from an exact state and only exact KV (a full prefill, an exact checkpoint, an
  exact replay).
- b > 0: the request that computed it started from an approximate state. An approximate hit
  replays [L - W, L) from a zero state, so at every later position p, per linear layer l and head h,
  ||S(p) - S_served(p)|| <= exp(sum_{t in [L - W, p)} log_decay[l, h, t]) x ||S(L - W)||, given the
  layer inputs (the recurrence is affine in the state and each token's transition contracts by at
  most its decay; `hybrid_kernels.replay_bound`). The position's bound is the max over l, h. A
  request that resumes from an approximate checkpoint of bound b_C carries b_C x the decays since.
- TAINT (the smallest positive float32 value): the request's own state was exact, but it read
  KV of bound > 0 (an approximate node). Never counts as exact in `exactness: "exact"`.

What it certifies: the linear layers' recurrent state, given the layer inputs. What it does not:
the attention KV downstream. Attention does not forget, so a position after an approximate span
attends to that span's KV; that error is an empirical matter (docs/trace_replay.md measures it).
Hence two notions of exact: `bound == 0` (strict: `exactness: "exact"` reuses only these), and
`bound <= exact_threshold` (the default mode's "counts as exact": float noise of the state).

Data kept on the tree (`NodeProvenance`, one per node that is not strictly exact): per token, the
bound of its KV (positions are non-increasing within one request's insert, so a node split keeps
each half's own values), and the bound of the node's state checkpoint, if it holds one.

The forward computes the per-position bounds (`CarryBound`): the gate hooks hand each linear layer's
per-token log-decay of the rows a request computes after its approximate start; per layer and head
a running log-sum, per row the max over heads and layers. Decode tokens are not seen by the hooks:
they carry the bound of the last prompt row (an upper bound: bounds do not grow).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from sglang_ext.tail_replay.provenance.forward import HeadShards

#: the bound of KV computed exactly from an exact state after reading KV of bound > 0
TAINT = 1.1754943508222875e-38   # float32's smallest normal value: > 0, below any threshold
#: the bound of a position whose gates the forward did not see (a replay from zero drops at most
#: the whole state: relative error <= 1)
UNKNOWN = 1.0
#: the bound of KV or a state whose computation no record tracks (`provenance.writes`): not exact
#: under any threshold, and never resumed from
UNTRACKED = math.inf


def counts_exact(bound: float, threshold: float) -> bool:
    """Whether a bound counts as exact under a threshold (0: strictly exact only)."""
    return bound <= threshold if threshold > 0 else bound == 0.0


@dataclass
class NodeProvenance:
    """What one tree node carries (attribute `PROVENANCE_ATTR` of the node; absent = strictly exact).

    kv: per token of the node's key, the bound of its attention KV (float32, CPU), or None (all 0).
    state: the bound of the node's device state checkpoint (meaningful while it holds one)."""

    kv: torch.Tensor | None = None
    state: float = 0.0

    def kv_max(self) -> float:
        return 0.0 if self.kv is None or self.kv.numel() == 0 else float(self.kv.max())

    def split(self, at: int) -> tuple[NodeProvenance, NodeProvenance]:
        """(first `at` tokens, the rest): the state stays with the rest (it sits at the node's end)."""
        if self.kv is None:
            return NodeProvenance(), NodeProvenance(None, self.state)
        return NodeProvenance(self.kv[:at].clone()), NodeProvenance(self.kv[at:].clone(), self.state)


@dataclass(frozen=True)
class PathState:
    """A device state on the matched path: its depth (tokens), bound and tree node id."""

    depth: int
    bound: float
    node_id: object


@dataclass(frozen=True)
class PathProvenance:
    """The matched path [0, L) read from the root down (`path_provenance`).

    first_inexact: positions < this have KV bound 0 (strictly exact); states: the device states on
    the path, deepest first."""

    matched: int
    first_inexact: int
    states: tuple[PathState, ...] = ()

    def deepest_exact_state(self, threshold: float, strict: bool) -> PathState | None:
        """The deepest state that counts as exact: strict, a state of bound 0 on a strictly exact
        path (what `exactness: "exact"` may read); else a state whose bound is <= threshold (the
        KV it sits on is read as it is, whatever its bound: see the module docstring)."""
        for state in self.states:
            if strict and state.depth <= self.first_inexact and state.bound == 0.0:
                return state
            if not strict and counts_exact(state.bound, threshold):
                return state
        return None

    def deepest_approximate_state(self, threshold: float) -> PathState | None:
        """The deepest state that does not count as exact under `threshold`."""
        for state in self.states:
            if not counts_exact(state.bound, threshold):
                return state
        return None

    def read_floor(self, upto: int) -> float:
        """The floor a request that reads the KV of [0, upto) carries: TAINT if any of it is not
        strictly exact, else 0."""
        return TAINT if upto > self.first_inexact else 0.0


def path_provenance(path: Sequence[tuple[int, NodeProvenance | None, bool, object]]) -> PathProvenance:
    """path: root-first (key length, provenance or None, holds a device state, node id) of the
    matched nodes."""
    depth = 0
    first_inexact = None
    states: list[PathState] = []
    for length, prov, has_state, node_id in path:
        kv = None if prov is None else prov.kv
        if first_inexact is None and kv is not None and kv.numel():
            positive = (kv > 0).nonzero()
            if positive.numel():
                first_inexact = depth + int(positive[0])
        depth += length
        if has_state:
            states.append(PathState(depth, 0.0 if prov is None else prov.state, node_id))
    return PathProvenance(depth, depth if first_inexact is None else first_inexact, tuple(reversed(states)))


@dataclass
class CarryBound:
    """The per-position bound of the tokens one request computes after an approximate start.

    start: first position carried (L - W for an approximate replay: the replayed tail is carried
    too, so a state stored inside it gets its partial bound; C for a resume from a checkpoint of
    bound > 0); base_log: the log-bound at `start` for every head (0 for a replay: the whole state
    was dropped; a checkpoint's stored bound). The request's read floor (0 or TAINT) lives on its
    record (`TailReplayRequest.floor`), which an insert may raise. Mutated only by `add_rows`."""

    start: int
    base_log: float = 0.0
    #: per layer: running log-sum [heads] (fp32) since `start` (without the base)
    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per layer: rows seen
    tokens: dict[int, int] = field(default_factory=dict)
    #: per forward chunk: (first position, log-bound per row [n], max over the layers seen)
    chunks: list[list] = field(default_factory=list)
    #: bumped by every change above (`row_bounds`, `merge_rows`): what `carried_bounds` memoizes
    #: is keyed by it
    version: int = field(default=0, compare=False)
    #: (version, the filled bounds of [start, start + n) before the floor: float64), or None
    memo: tuple[int, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def add_rows(self, layer: int, position: int, log_decay: torch.Tensor) -> None:
        """log_decay [n, heads]: this layer's per-token log-decay of rows [position, position + n).
        Adds the rows' log-bound (base_log + the running sum) into the chunk's max over layers."""
        self.merge_rows(position, self.row_bounds(layer, log_decay))

    def row_bounds(self, layer: int, log_decay: torch.Tensor) -> torch.Tensor:
        """log_decay [n, heads]: this layer's per-token log-decay of the next n rows; advances the
        layer's running sum and returns each row's log-bound [n] (base_log + the running sum, max
        over the heads given). Under tensor parallelism the heads given are this rank's: the
        caller takes the max over the ranks before `merge_rows` (`CarrySegments.accumulate`)."""
        import torch

        values = log_decay.float()
        running = self.sums.get(layer)
        cumulative = torch.cumsum(values, dim=0)
        if running is not None:
            cumulative = cumulative + running
        self.sums[layer] = cumulative[-1].clone() if values.shape[0] else (
            running if running is not None else torch.zeros(values.shape[-1], device=values.device))
        self.tokens[layer] = self.tokens.get(layer, 0) + values.shape[0]
        self.version += 1
        return (cumulative + self.base_log).amax(dim=-1)

    def merge_rows(self, position: int, rows: torch.Tensor) -> None:
        """rows [n]: one layer's log-bound of rows [position, position + n), into the chunk's max
        over layers."""
        import torch

        self.version += 1
        for chunk in self.chunks:
            if chunk[0] == position and chunk[1].shape[0] == rows.shape[0]:
                chunk[1] = torch.maximum(chunk[1], rows)
                return
        self.chunks.append([position, rows])

    def complete(self) -> bool:
        """Whether every layer seen saw every row (a CUDA-graph prefill or an unhooked layer kind
        leaves gaps: then the carried bound is UNKNOWN)."""
        seen = {self.tokens.get(layer, 0) for layer in self.sums}
        rows = sum(chunk[1].shape[0] for chunk in self.chunks)
        return len(seen) == 1 and seen == {rows}


def carried_bounds(carry: CarryBound | None, start: int, end: int, exact_floor: float) -> torch.Tensor:
    """The bound of each position in [start, end) that a request computed (float32, CPU).

    Positions before `carry.start` (or all, without a carry) get `exact_floor`. A carried position
    the forward saw gets exp(its row's log-bound); one it did not see (a chunk that ran inside a
    CUDA graph, decode tokens) the bound of the last row seen before it, which is an upper bound
    since bounds never grow along a request (before any row: the start bound). A carry whose rows
    some layer did not see (the max over layers would miss it) is UNKNOWN throughout. A carried
    position is never strictly exact (at least TAINT). One host sync (the rows' copy) per change of
    the carry: the filled bounds are memoized on it (`CarryBound.memo`), since a request's inserts,
    overlaps and labels ask again between its forwards."""
    import torch

    out = torch.full((max(end - start, 0),), exact_floor, dtype=torch.float32)
    if carry is None or end <= carry.start:
        return out
    lo = max(start, carry.start)
    if carry.chunks and not carry.complete():
        out[lo - start:] = max(UNKNOWN, exact_floor)
        return out
    bounds = _filled(carry, end - carry.start).clamp(min=max(TAINT, exact_floor), max=UNKNOWN).float()
    out[lo - start:] = bounds[lo - carry.start:]
    return out


def _filled(carry: CarryBound, span: int) -> torch.Tensor:
    """The bound of positions [carry.start, carry.start + span) before the floor (float64): a seen
    row's, else the last seen row's before it, else the start bound. A position's value depends
    only on the rows at or before it, so a longer memo's prefix is the answer. May mutate: the
    carry's memo. Not to be written to (it is the memo)."""
    import torch

    memo = carry.memo
    if memo is not None and memo[0] == carry.version and memo[1].shape[0] >= span:
        return memo[1][:span]
    values = torch.full((span,), float("nan"), dtype=torch.float64)
    for position, rows in carry.chunks:
        first = position - carry.start
        if first >= span:
            continue
        take = rows[:span - first].double().exp().cpu()
        values[first:first + take.shape[0]] = take
    seen = ~torch.isnan(values)
    last_seen = torch.where(seen, torch.arange(span), torch.full((span,), -1)).cummax(0).values
    start_bound = min(math.exp(carry.base_log), UNKNOWN)
    filled = torch.where(last_seen >= 0, values[last_seen.clamp(min=0)], torch.tensor(start_bound, dtype=torch.float64))
    carry.memo = (carry.version, filled)
    return filled


def log_of_bound(bound: float) -> float:
    """The log of a stored bound, as a carry's `base_log` (a bound of 0 never starts a carry)."""
    return math.log(max(bound, TAINT))


@dataclass(frozen=True)
class CarrySegments:
    """The rows of one packed extend batch that requests compute after an approximate start.

    rows [n] (long): batch rows, request after request; parts: per request (its CarryBound, the
    first row's position, offset into `rows`, count); end: one past the largest row."""

    rows: torch.Tensor
    parts: tuple[tuple[CarryBound, int, int, int], ...]
    end: int
    #: the tensor-parallel ranks holding the other heads (`provenance.forward.HeadShards`; None: this
    #: rank holds every head)
    shards: HeadShards | None = field(default=None, compare=False)

    def accumulate(self, layer: int, log_decay_rows: torch.Tensor) -> None:
        """log_decay_rows [n, heads]: the log-decay of `rows` at `layer` (one cumsum per request;
        under tensor parallelism one max over the ranks of every part's row bounds, so every rank
        carries the same bounds)."""
        if self.shards is None:
            for carry, position, offset, count in self.parts:
                carry.add_rows(layer, position, log_decay_rows[offset:offset + count])
            return
        import torch

        local = [carry.row_bounds(layer, log_decay_rows[offset:offset + count])
                 for carry, _, offset, count in self.parts]
        every = self.shards.max_rows(torch.cat(local))   # (a CarrySegments has parts)
        for carry, position, offset, count in self.parts:
            carry.merge_rows(position, every[offset:offset + count])


def carry_segments(carries: Sequence[CarryBound | None], prefix_lens: Sequence[int],
                   extend_lens: Sequence[int], shards: HeadShards | None = None) -> CarrySegments | None:
    """carries[i]: the request's CarryBound or None; prefix_lens / extend_lens: the requests'
    extend segments in batch order. None when no row is carried."""
    import torch

    rows: list[torch.Tensor] = []
    parts = []
    offset = count = 0
    for carry, prefix, extend in zip(carries, prefix_lens, extend_lens):
        if carry is not None:
            lo, hi = max(prefix, carry.start), prefix + extend
            if hi > lo:
                rows.append(torch.arange(offset + lo - prefix, offset + hi - prefix))
                parts.append((carry, lo, count, hi - lo))
                count += hi - lo
        offset += extend
    if not rows:
        return None
    all_rows = torch.cat(rows)
    return CarrySegments(all_rows, tuple(parts), int(all_rows.max()) + 1, shards)
