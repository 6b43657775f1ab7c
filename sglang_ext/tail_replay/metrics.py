"""Prometheus counters for Tail-Replay (served on SGLang's /metrics with --enable-metrics),
and the per-request summary put into `meta_info`. Recorded once per request, at its first
forward, in the scheduler process (SGLang runs prometheus_client in multiprocess mode); the
state-bound histogram once per approximate hit, at its first output (when its tail is replayed).

Under tensor / context / pipeline parallelism every rank of a model replica runs the same batch,
so the counters are recorded only on the replica's first rank (attention-TP rank 0, attention-CP
rank 0, PP rank 0), as SGLang gates its own scheduler statistics on `attn_tp_rank == 0 and
attn_cp_rank == 0`; the counters carry no rank label, so each request is counted once per
replica (each DP replica serves its own requests). The meta_info summary is unaffected.

The live quality audit (`audit`) records one observation per audit, when the reference's next-token
distribution meets the served one's (scheduler, reference's forward); an audit's reference run is
not traffic: it goes into none of the request counters above."""

from __future__ import annotations

import functools

from sglang_ext.tail_replay.audit import Divergence
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan
from sglang_ext.tail_replay.provenance.bounds import counts_exact
from sglang_ext.tail_replay.provenance.forward import summarize
from sglang_ext.tail_replay.request import KIND_UNTRACKED, TailReplayRequest, answer_bound

#: key of the per-request summary in `meta_info["cached_tokens_details"]`
META_KEY = "tail_replay"
#: histogram buckets of the state bound (a relative error: 0 .. 1)
STATE_BOUND_BUCKETS = (1e-9, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
#: buckets of stored bounds (0 = exact goes into the first)
STORED_BOUND_BUCKETS = (0.0, 1e-30, 1e-9, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.1, 0.5, 1.0)
#: buckets of an audit's KL(reference || served) in nats (0 = equal distributions goes into the first)
AUDIT_KL_BUCKETS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
#: buckets of an audit's total variation distance (0 .. 1)
AUDIT_TV_BUCKETS = (0.0, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


@functools.lru_cache(maxsize=1)
def _counters() -> dict:
    from prometheus_client import Counter, Histogram

    return {
        "matched": Counter("sglang_ext:tail_replay_matched_tokens",
                           "Prompt tokens whose attention KV was found in the radix tree"),
        "reused": Counter("sglang_ext:tail_replay_reused_tokens",
                          "Matched tokens skipped by the forward (SGLang's prefix length)"),
        "replayed": Counter("sglang_ext:tail_replay_replayed_tokens",
                            "Matched tokens run through the model again to rebuild linear-layer state"),
        "hits": Counter("sglang_ext:tail_replay_hits", "Requests by hit kind", ["kind"]),
        "state_bound": Histogram(
            "sglang_ext:tail_replay_state_bound",
            "Approximate hits: bound on the replayed linear state's relative error, max over layers and "
            "heads of exp(sum of the replayed tail's log-decay)", buckets=STATE_BOUND_BUCKETS),
        "requests": Counter("sglang_ext:tail_replay_requests",
                            "Requests by outcome: exact (the state the answer was computed from counts as "
                            "exact: bound <= the exact threshold; 0 in the exact mode) or approximate", ["exact"]),
        "kv_exact": Counter("sglang_ext:tail_replay_kv_exact_requests",
                            "Requests by whether everything they read was exact (kv_exact: no KV or state of "
                            "bound > 0 anywhere on what the answer was computed from, bound 0; what exactness "
                            "'exact' guarantees) or not", ["kv_exact"]),
        "stored": Histogram(
            "sglang_ext:tail_replay_stored_bound",
            "Bounds of what enters the tree: per new node its KV's largest bound (kind=kv), per stored "
            "state its bound (kind=state); 0 is exact", ["kind"], buckets=STORED_BOUND_BUCKETS),
        "audit_kl": Histogram(
            "sglang_ext:tail_replay_audit_kl",
            "Live quality audit: KL(exact reference || served) of the next-token distribution at the first "
            "output, in nats, by trigger (sampled: audit_rate's share of approximate answers; forced: "
            "audit true)", ["trigger"], buckets=AUDIT_KL_BUCKETS),
        "audit_tv": Histogram(
            "sglang_ext:tail_replay_audit_tv",
            "Live quality audit: total variation distance between the exact reference's and the served "
            "next-token distribution at the first output, by trigger", ["trigger"], buckets=AUDIT_TV_BUCKETS),
        "repairs": Counter(
            "sglang_ext:tail_replay_repairs",
            "Exact repair runs finished (their sequence inserted into the tree): a finished answer that was "
            "not exact recomputed exactly in the background (kind=answer; repair: true), so its sequence's nodes "
            "and end state become exact; an approximate state that conversations branch from recomputed "
            "exactly (kind=shared_state; repair_shared: true)", ["kind"]),
        "pressure": Counter(
            "sglang_ext:tail_replay_pressure_requests",
            "exactness 'exact_unless_pressed': requests by the thresholds their arrival's stamp met (pressed_by, "
            "comma-separated; empty: not pressed) and outcome: approximate (an approximate plan within the "
            "tolerance), beyond_tolerance (the approximate plan's bound was above it: served exactly), exact "
            "(pressed, the plan was exact anyway), not_pressed", ["pressed_by", "outcome"]),
        "states_first": Counter(
            "sglang_ext:tail_replay_states_freed_before_kv",
            "--enable-unified-memory: cached states freed before any KV because each was worth less per "
            "byte than KV (the replay it saved was shorter than its bytes' worth of KV tokens), by the "
            "shortfall that asked (state: a new state's bytes; kv: KV's bytes)", ["shortfall"]),
        "audits": Counter(
            "sglang_ext:tail_replay_audits",
            "Live quality audits recorded, by trigger and by whether the served and the exact reference's "
            "next-token distributions put the same token first", ["trigger", "top1_agree"]),
    }


def is_recording_rank(attn_tp_rank: int, attn_cp_rank: int = 0, pp_rank: int = 0) -> bool:
    """Whether a scheduler with these ranks records the counters (pure)."""
    return attn_tp_rank == 0 and attn_cp_rank == 0 and pp_rank == 0


def records_here() -> bool:
    """Whether this scheduler process is its replica's recording rank (`is_recording_rank`)."""
    return _this_rank_records()


def _this_rank_records() -> bool:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return is_recording_rank(parallel.attn_tp_rank, parallel.attn_cp_rank, parallel.pp_rank)


def record_plan(plan: ReplayPlan) -> None:
    if not _this_rank_records():
        return
    counters = _counters()
    counters["matched"].inc(plan.matched_tokens)
    counters["reused"].inc(plan.prefix_len)
    counters["replayed"].inc(plan.replayed_tokens)
    counters["hits"].labels(kind=plan.kind.value).inc()


def record_first_forward(record: TailReplayRequest) -> None:
    """At a request's forward: its plan into the counters, once per request (a retracted and
    re-matched request is not counted again)."""
    if record.plan is not None and record.first_time("plan_recorded"):
        if not record.config.background:   # an audit's reference or a repair run is not traffic
            record_plan(record.plan)
            pressure = pressure_summary(record)
            if pressure is not None and _this_rank_records():
                _counters()["pressure"].labels(pressed_by=",".join(pressure["pressed_by"]),
                                               outcome=pressure["outcome"]).inc()


def pressure_summary(record: TailReplayRequest) -> dict | None:
    """Under `exactness: "exact_unless_pressed"`: the thresholds the request's arrival met
    (`pressed_by`), what its plan did under them (`outcome`: planner.UNDER_PRESSURE, or
    "not_pressed") and the certified bound checked against the tolerance (`planned_bound`, None
    where no approximate plan was considered); None under the other modes."""
    config, plan = record.config, record.plan
    if config.knobs.exactness != "exact_unless_pressed" or plan is None:
        return None
    return {"pressed_by": list(config.pressed_by), "outcome": plan.pressure or "not_pressed",
            "planned_bound": plan.planned_bound}


def record_stored_bound(kind: str, bound: float) -> None:
    """A node (kind "kv") or state (kind "state") entered the tree with this bound. (A tree in a
    process that published no parallel ranks, SGLang's cache unit-test kit, is no server: nothing
    is recorded.)"""
    try:
        recording = _this_rank_records()
    except RuntimeError:
        return
    if recording:
        _counters()["stored"].labels(kind=kind).observe(bound)


def output_bound(record: TailReplayRequest, prompt_len: int, logprob_start: int = -1) -> float:
    """The bound of the answer: the state its next token is computed from, at the end of the
    sequence its last match planned (the prompt, or prompt and output after a retraction:
    `TailReplayRequest.label_end`), the input-logprob positions from `logprob_start` on when it
    returns them, and what it generated under earlier plans (`earlier_bound`)."""
    end = max(prompt_len, record.label_end or 0)
    return max(record.earlier_bound, answer_bound(record, end, logprob_start))


def output_provenance(record: TailReplayRequest, prompt_len: int, logprob_start: int = -1) -> tuple[float, bool]:
    """(bound, exact) of the request's output (`output_bound`, computed once per plan and kept in
    the record) and whether it counts as exact under the request's exactness."""
    bound = record.output_bound
    if bound is None:
        bound = record.acc.output_bound = output_bound(record, prompt_len, logprob_start)
    return bound, counts_exact(bound, record.threshold)


def kv_exact(answer_bound: float) -> bool:
    """Whether everything an answer read was exact: its bound is 0 (any KV of bound > 0 it read,
    a state stored by a request that read such KV, a checkpoint's float-noise bound make it TAINT
    or more). `exact` may still hold under a threshold > 0 (`exactness: "exact_first"`)."""
    return answer_bound == 0.0


def plan_summary(plan: ReplayPlan) -> dict:
    """The plan's part of `meta_info.cached_tokens_details.tail_replay`."""
    return {"kind": plan.kind.value, "matched_tokens": plan.matched_tokens,
            "reused_tokens": plan.prefix_len, "replayed_tokens": plan.replayed_tokens}


def replay_summary(record: TailReplayRequest, prompt_len: int | None = None, logprob_start: int = -1) -> dict:
    """`meta_info.cached_tokens_details.tail_replay` of a request with a plan: `plan_summary`,
    `exact`, `kv_exact` and `bound` (provenance of its output, given `prompt_len`: the last prompt
    position's bound; whether the state it was computed from counts as exact under the request's
    exactness; whether everything it read was exact, `kv_exact`), and for an approximate hit
    `state_bound` / `state_bound_per_layer` (`provenance.forward.StateBound`; None where the forward did
    not see the whole tail's gates), and for an audited request `audit` (why: "forced" or
    "sampled"; the tokenizer process then sends its reference run). Call once its tail is replayed
    (at an output): the bounds are computed at the first call (host syncs), kept in the record, and
    go into the metrics once per request."""
    assert record.plan is not None
    summary = plan_summary(record.plan)
    if prompt_len is not None:
        answer_bound, exact = output_provenance(record, prompt_len, logprob_start)
        summary["exact"] = exact
        summary["kv_exact"] = read_exact = kv_exact(answer_bound)
        summary["bound"] = answer_bound
        if record.first_time("exactness_recorded"):
            if not record.config.background and _this_rank_records():
                _counters()["requests"].labels(exact=str(exact).lower()).inc()
                _counters()["kv_exact"].labels(kv_exact=str(read_exact).lower()).inc()
    if record.audit is not None:
        summary["audit"] = record.audit
    if (pressure := pressure_summary(record)) is not None:
        summary["pressure"] = pressure
    if record.plan.kind is not HitKind.APPROXIMATE:
        return summary
    if record.bound is None:
        record.acc.bound = summarize(record.tail_decay, record.plan.replayed_tokens)
        if record.bound is not None and record.first_time("bound_recorded"):
            record_bound(record.bound.state_bound)
    bound = record.bound
    summary["state_bound"] = None if bound is None else bound.state_bound
    summary["state_bound_per_layer"] = None if bound is None else list(bound.per_layer)
    return summary


def answer_label(record: TailReplayRequest | None, prompt_len: int, logprob_start: int = -1) -> dict:
    """`meta_info.cached_tokens_details.tail_replay` of any answer of a server that serves with
    Tail-Replay: `replay_summary` where the request has a plan; otherwise (no record: it was never
    planned; a record whose plan was dropped: another wing served it, or what it read has no known
    provenance; or that generated tokens so served before a retraction re-planned it) the
    fail-closed label `exact: false, kv_exact: false, bound: None` with the kind
    that says why (`TailReplayRequest.served_as`: "assembled", "untracked"). Counted once per
    request with a record, as `replay_summary` counts. On a PD decode server: the label the prefill
    server carried with the transfer (`TailReplayRequest.carried_label`; not counted here, the
    prefill server counted the request)."""
    if record is not None and record.carried_label is not None:
        return dict(record.carried_label)
    if record is not None and record.plan is not None and record.earlier_served_as is None:
        return replay_summary(record, prompt_len, logprob_start)
    kind = KIND_UNTRACKED if record is None else (record.earlier_served_as or record.served_as or KIND_UNTRACKED)
    if record is not None and record.first_time("exactness_recorded"):
        if not record.config.background and _this_rank_records():
            _counters()["requests"].labels(exact="false").inc()
            _counters()["kv_exact"].labels(kv_exact="false").inc()
    return {"kind": kind, "exact": False, "kv_exact": False, "bound": None}


def record_bound(state_bound: float) -> None:
    if _this_rank_records():
        _counters()["state_bound"].observe(state_bound)


def record_repair_finished(record: TailReplayRequest) -> None:
    """A repair run's final output (SGLang has inserted its sequence into the tree by then): counted
    once."""
    if record.config.repair_of is not None and _this_rank_records() and record.first_time("repair_counted"):
        _counters()["repairs"].labels(kind=record.config.repair_kind).inc()


def record_audit(trigger: str, divergence: Divergence) -> None:
    """One audit's divergence into the audit metrics (the recording rank only)."""
    if _this_rank_records():
        counters = _counters()
        counters["audit_kl"].labels(trigger=trigger).observe(divergence.kl)
        counters["audit_tv"].labels(trigger=trigger).observe(divergence.tv)
        counters["audits"].labels(trigger=trigger, top1_agree=str(divergence.top1_agree).lower()).inc()


def record_states_freed_first(shortfall: str, count: int) -> None:
    """States the byte budget freed before KV for a `shortfall` ("state" or "kv")."""
    if count > 0 and _this_rank_records():
        _counters()["states_first"].labels(shortfall=shortfall).inc(count)
