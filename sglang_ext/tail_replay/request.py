"""Tail-Replay's per-request record: everything the wing keeps about one request, in one place.

SGLang's scheduler-side request (`Req`) carries it under a single attribute, `RECORD_ATTR`, reached
only through `record_of(req)` / `attach(req, config)`; nothing else of Tail-Replay is stored on the
request. Pure: no SGLang import (the request is duck-typed), no torch import at run time.

A record is the request's resolved config (`config.TailReplayConfig`), its planned hit
(`PlannedHit`: frozen, replaced whole at each match by `set_plan`), the accumulator of what its
answer reads beyond the plan (`BoundAccumulator`: a new one with each plan; the forward, the first
output and an insert overlap add to it), what was done once (`first_time`, `ONCE`) and the
request's own lifecycle marks.

Life of a record (scheduler process):
- created at the request's first prefix match (`tail_replay.cache`), with the request's config
  resolved once (server config + `custom_params["tail_replay"]`, and on the server's own background
  runs its out-of-band mark: `request_fields.request_overrides`); a re-match (after retraction)
  keeps the record and its config, and replaces the plan and the tail's slots;
- read by the forward (`patches/tail_replay/batch.py`: tail rows and slots, metrics at the first
  forward; the gate hooks add the tail's log-decay to `tail_decay`; the audit seam,
  `patches/tail_replay/audit.py`, at the first output's logits), the output
  (`patches/tail_replay/meta.py`) and the cache (`tail_replay.cache`, `tail_replay.own_tail`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.planner import ReplayPlan
from sglang_ext.tail_replay.provenance.bounds import CarryBound, carried_bounds
from sglang_ext.tail_replay.provenance.forward import StateBound, TailDecay

if TYPE_CHECKING:
    import torch

#: the one attribute of SGLang's `Req` that holds the record
RECORD_ATTR = "sglang_ext_tail_replay"
#: label kinds of answers served without a plan (`TailReplayRequest.drop_plan`,
#: `metrics.answer_label`): what they read has no known provenance / was assembled from chunk KV
KIND_UNTRACKED = "untracked"
KIND_ASSEMBLED = "assembled"
#: label kind of a PD decode server's answer whose prefill server carried no readable label with
#: the transfer (`label_transfer.decode_side_label`: a stock prefill, a transfer that does not copy
#: the label's buffer, the fake backend, a damaged row)
KIND_TRANSFERRED_UNLABELLED = "transferred_unlabelled"


@dataclass(frozen=True)
class HostLoad:
    """A plan that reads the host tier (tokens): the device prefix SGLang counts ends at
    `device_len`; the load-back brings the KV of [device_len, load_end) to the device (load_end = L
    when the plan reads its tail's KV from the tree, else the prefix) and, if `state_node` is set,
    that checkpoint's host state into the request's slot; the request's prefix is then
    `prefix_len`."""

    device_len: int
    prefix_len: int
    load_end: int
    #: the tree node (id) whose host state the plan starts from, or None
    state_node: object = None


@dataclass(frozen=True)
class PlannedHit:
    """How a request's prefix hit is reused, fixed at its (re-)match (`TailReplayRequest.set_plan`);
    replaced whole, never edited."""

    plan: ReplayPlan
    #: exact KV mode: the tree's KV slots of the replayed tail [plan.prefix_len, plan.matched_tokens)
    #: (a host plan learns them at its load-back: `TailReplayRequest.loaded`)
    kv_slots: torch.Tensor | None = None
    #: HiCache: the plan's prefix reaches into KV held on the host tier, which SGLang's load-back
    #: brings to the device at admission (`TailReplayRadixCache.init_load_back`, which takes it)
    host_load: HostLoad | None = None
    #: kv_mode "recompute": up to where the request's tail KV is its own (L), else None
    own_end: int | None = None


@dataclass
class BoundAccumulator:
    """What the request's answer reads beyond its plan, accumulated from its match on (a new one
    with every plan). May be mutated by: the forward's gate hooks (`tail_decay`, `carry`'s rows),
    the first output (`bound`, `output_bound`), an insert overlap that hands it inexact tree KV
    (`floor`)."""

    #: approximate plans: the replayed tail's summed log-decay per linear layer, added by the
    #: forward (`patches/tail_replay/linear_bound.py`, every linear kind's gates) chunk by chunk
    tail_decay: TailDecay = field(default_factory=TailDecay)
    #: provenance (tail_replay/provenance/bounds.py): the per-position bound of what the request computes
    #: after an approximate start (a replay, or a checkpoint of bound > 0); None: its state is
    #: strictly exact. Set at match, filled by the forward's gate hooks.
    carry: CarryBound | None = None
    #: 0, or TAINT when the request reads KV of bound > 0 (set at match, raised by an overlap)
    floor: float = 0.0
    #: the state bound computed from `tail_decay` at the first output (`metrics.replay_summary`)
    bound: StateBound | None = None
    #: the bound of the last prompt position (computed at the first output, `metrics.replay_summary`)
    output_bound: float | None = None


#: what a request does at most once (`TailReplayRequest.first_time`): its plan into the metrics
#: (at its first forward), its bound into the histogram, its outcome into the counters, the audit
#: decision (at the forward that gives its first output), a repair run's finish into the counters
ONCE = ("plan_recorded", "bound_recorded", "exactness_recorded", "audit_decided", "repair_counted")


@dataclass
class TailReplayRequest:
    """Everything the wing keeps about one request (scheduler process): its resolved config, its
    planned hit (frozen, replaced at each match), the bound accumulator of what it reads, the
    things done once, and the request's own lifecycle marks."""

    #: the request's config: the server's, with its `custom_params["tail_replay"]` options
    config: TailReplayConfig
    #: how its prefix hit is reused (None before the first match, or after `drop_plan`)
    hit: PlannedHit | None = None
    #: what its answer reads beyond the plan (a new one with every plan)
    acc: BoundAccumulator = field(default_factory=BoundAccumulator)
    #: which of `ONCE` were done
    done: set[str] = field(default_factory=set)
    #: set by `prepare_for_caching_req`, read and reset by `cleanup_after_caching_req`: the
    #: request's state was kept out of the tree
    state_withheld: bool = False
    #: kv_mode "recompute": (first position, KV slots) the request holds as its own tail
    own_kv: tuple[int, torch.Tensor] | None = None
    #: live quality audit (tail_replay/audit.py): why the request is audited ("forced" /
    #: "sampled"; None: not audited), set once its served distribution is kept
    audit: str | None = None
    #: shared-state repair (tail_replay/repair.py): the prefix length whose exact state this
    #: request asks for (set at a match, at most once; sent with its first output, then None)
    shared_repair: int | None = None
    #: the depth whose exact state this request asked a repair for (`shared_repair` as it was
    #: set; kept): the request stores no inexact state of its own there, which would hold the node
    #: (its lock while it runs) against the repair's exact state (`InsertContext.awaits_repair_at`)
    repair_asked_at: int | None = None
    #: where stock SGLang's miss of this request keeps its state instead of at the request's own
    #: end: its branch point, under the extra buffer, when this request's approximate plan branches
    #: off the tree there (`SharedRepairRules.note`; read by the state order's stock
    #: shadow at the request's inserts, `StockLastOrder._stock_inserts`). Set at a match, kept.
    stock_branch_depth: int | None = None
    #: the length of the sequence the last match planned: the prompt, or after a retraction the
    #: prompt and the output so far (its next token is computed from the last position); None:
    #: not matched yet (`begin_match`)
    label_end: int | None = None
    #: the bound of what the request generated under earlier plans (a retraction re-plans it; the
    #: tokens it had generated stay in the answer): its label never says less (`begin_match`)
    earlier_bound: float = 0.0
    #: why the request has no plan after a match that made one (`drop_plan`): the answer's label
    #: kind (`metrics.answer_label`): "assembled" (another wing served it from chunk KV), "untracked"
    #: (what it reads has no known provenance); None while it has a plan or was never matched
    served_as: str | None = None
    #: `served_as` of an earlier match under which the request generated tokens (then it was
    #: retracted and matched again): the answer keeps that label kind, whatever the new plan
    earlier_served_as: str | None = None
    #: PD disaggregation, decode side: the label the prefill server carried with the transfer
    #: (`label_transfer.decode_side_label`; fail closed where none was readable), which
    #: `metrics.answer_label` returns; None on every other server
    carried_label: dict | None = None

    # ---- the planned hit, read ------------------------------------------------------------------
    @property
    def plan(self) -> ReplayPlan | None:
        return None if self.hit is None else self.hit.plan

    @property
    def kv_slots(self) -> torch.Tensor | None:
        return None if self.hit is None else self.hit.kv_slots

    @property
    def host_load(self) -> HostLoad | None:
        return None if self.hit is None else self.hit.host_load

    @property
    def own_end(self) -> int | None:
        return None if self.hit is None else self.hit.own_end

    # ---- the accumulator, read (written through `acc`) ------------------------------------------
    @property
    def carry(self) -> CarryBound | None:
        return self.acc.carry

    @property
    def floor(self) -> float:
        return self.acc.floor

    @property
    def tail_decay(self) -> TailDecay:
        return self.acc.tail_decay

    @property
    def bound(self) -> StateBound | None:
        return self.acc.bound

    @property
    def output_bound(self) -> float | None:
        return self.acc.output_bound

    def first_time(self, what: str) -> bool:
        """True the first time `what` (one of `ONCE`) is asked of this request, then False."""
        assert what in ONCE, what
        if what in self.done:
            return False
        self.done.add(what)
        return True

    @property
    def strict(self) -> bool:
        """Whether the request is served strictly (reads only KV and states of bound 0, takes no
        inexact tree KV at a chunk boundary, is labelled against threshold 0): its config says so
        (`exactness: "exact"`, or "exact_unless_pressed" not pressed), or it was pressed and its
        approximate plan was beyond the tolerance, so it was planned as "exact" and is served
        as a never-pressed request would be."""
        return self.config.strict or (self.plan is not None and self.plan.pressure == "beyond_tolerance")

    @property
    def threshold(self) -> float:
        """The bound up to which what the request reads counts as exact (0 when `strict`)."""
        return 0.0 if self.strict else self.config.threshold

    def begin_match(self, sequence_len: int) -> None:
        """A (re-)match of the request's sequence so far (`sequence_len` tokens: its prompt, plus
        its output after a retraction). Where the previous plan already generated tokens, their
        bound (the state the first of them came from, which every later one carries) stays in the
        answer's label (`earlier_bound`; where they were served without a plan, that label's kind:
        `earlier_served_as`), so a re-plan cannot make an answer exact again."""
        if self.label_end is not None and sequence_len > self.label_end:
            if self.plan is not None:
                self.earlier_bound = max(self.earlier_bound, answer_bound(self, self.label_end))
            elif self.served_as is not None:   # served without a plan (assembled, untracked)
                self.earlier_served_as = self.earlier_served_as or self.served_as
        self.label_end = sequence_len

    def set_plan(self, plan: ReplayPlan, carry: CarryBound | None = None, floor: float = 0.0, *,
                 kv_slots: torch.Tensor | None = None, host_load: HostLoad | None = None) -> None:
        """A (re-)match: the new planned hit, and a new accumulator holding its provenance."""
        self.hit = PlannedHit(plan, kv_slots, host_load, own_tail_end(plan, self.config.knobs.kv_mode))
        self.acc = BoundAccumulator(carry=carry, floor=floor)
        self.served_as = None

    def loaded(self, kv_slots: torch.Tensor | None) -> None:
        """A host plan's load-back brought its prefix to the device: the planned hit reads the
        tail's KV slots off the loaded path, and loads nothing more."""
        assert self.hit is not None
        self.hit = dataclasses.replace(self.hit, kv_slots=kv_slots, host_load=None)

    def take_host_load(self) -> HostLoad | None:
        """The planned hit's host load, once (the load-back runs it)."""
        load = self.host_load
        if load is not None:
            assert self.hit is not None
            self.hit = dataclasses.replace(self.hit, host_load=None)
        return load

    def drop_plan(self, served_as: str = KIND_UNTRACKED) -> None:
        """The request is served some other way than its plan (another wing took over after the
        match, e.g. assembling cached chunks: `served_as` "assembled"), or from what has no known
        provenance ("untracked"): no plan, no tail slots, no provenance carry. Its answer is
        labelled not exact, of kind `served_as` (`metrics.answer_label`)."""
        self.hit = None
        self.acc = dataclasses.replace(self.acc, carry=None)
        self.served_as = served_as

    def withhold_state(self) -> None:
        """Keep the request's state out of the tree at its next caching (its release frees it)."""
        self.state_withheld = True


def record_of(req: Any) -> TailReplayRequest | None:
    """The request's record, or None (a request Tail-Replay has not matched, or any request of a
    server without the backend)."""
    return getattr(req, RECORD_ATTR, None)


def attach(req: Any, config: TailReplayConfig) -> TailReplayRequest:
    """The request's record, created with `config` if it has none (an existing record keeps the
    config it was created with: a request's config is resolved once)."""
    record = record_of(req)
    if record is None:
        record = TailReplayRequest(config=config)
        setattr(req, RECORD_ATTR, record)
    return record


def own_tail_end(plan: ReplayPlan | None, kv_mode: str) -> int | None:
    """L when a request planned `plan` keeps its own recomputed KV for [prefix_len, L) (`kv_mode:
    "recompute"` with a replayed tail; `own_tail`), else None (pure)."""
    if kv_mode == "recompute" and plan is not None and plan.reuses_tail_kv:
        return plan.matched_tokens
    return None


def owns_tail(record: TailReplayRequest | None) -> bool:
    """Whether the request keeps its own recomputed tail KV (`kv_mode: "recompute"`: its caching's
    inserts claim it, `own_tail.OwnTailClaims`)."""
    return record is not None and record.own_end is not None


def plan_of(req: Any) -> ReplayPlan | None:
    """The request's plan, or None."""
    record = record_of(req)
    return None if record is None else record.plan


def bounds_of(record: TailReplayRequest | None, start: int, end: int) -> torch.Tensor:
    """Per position in [start, end) (float32, CPU): the bound of the KV (and state) the request
    computed there (`provenance.carried_bounds`). No record: an insert without a request, exact."""
    import torch

    if record is None:
        return torch.zeros(max(end - start, 0), dtype=torch.float32)
    return carried_bounds(record.carry, start, end, record.floor)


def answer_bound(record: TailReplayRequest, end: int, logprob_start: int = -1) -> float:
    """The bound of what an answer computed from the request's sequence [0, end) reads under its
    current plan: the state at the last position, which its next token is computed from (decode
    tokens carry it: bounds do not grow), and, where input logprobs are returned from
    `logprob_start` on, every position from there (computed in this forward: SGLang caps the
    prefix there). One host sync."""
    if end <= 0:
        return 0.0
    start = logprob_start if 0 <= logprob_start < end else end - 1
    return max_bound_of(record, start, end)


def max_bound_of(record: TailReplayRequest | None, start: int, end: int) -> float:
    """The largest of `bounds_of(record, start, end)` (0 for an empty span). Without a carried row
    in the span (the common, exact case) it is the record's floor, read without building the
    tensor; else one host sync."""
    if end <= start or record is None:
        return 0.0
    if record.carry is None or end <= record.carry.start:
        return record.floor
    return float(bounds_of(record, start, end).max())


def computed_from(record: TailReplayRequest | None) -> int:
    """The first position whose KV the request computed itself (an exact-KV replay copies the
    tree's KV into its tail rows: those slots hold the tree's values, not fresher ones)."""
    if record is None or record.plan is None:
        return 0
    plan = record.plan
    return plan.matched_tokens if plan.reuses_tail_kv and record.config.knobs.kv_mode == "exact" else plan.prefix_len
