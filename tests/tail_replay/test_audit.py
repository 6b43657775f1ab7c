"""The live quality audit's pure parts (`sglang_ext.tail_replay.audit`: sampling decision, divergence,
store of served distributions, config keys) and its scheduler side (`patches/tail_replay/audit.py`'s
`observe_forward`) on duck-typed requests, with no server."""

from __future__ import annotations

import math
from array import array
from types import SimpleNamespace

import pytest
import torch

import sglang_ext.tail_replay as face
from sglang_ext.patches.tail_replay import audit as tail_replay_audit
from sglang_ext.tail_replay import metrics
from sglang_ext.tail_replay.audit import (
    FORCED,
    MAX_PENDING,
    SAMPLED,
    AuditResult,
    PendingAudits,
    ServedAnswer,
    audit_trigger,
    divergence,
    log_probs,
    prompt_key,
    reference_overrides,
    sampled,
)
from sglang_ext.tail_replay.config import (
    BACKGROUND_PARAM_KEY,
    DEFAULTS,
    TailReplayConfig,
    TailReplayConfigError,
    config_from_dict,
    parse_config,
    user_settings,
)
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan
from sglang_ext.tail_replay.request import attach
from sglang_ext.tail_replay.request_fields import RequestLimits, background_mark, check_request, request_overrides, with_overrides


def test_sampling_is_a_deterministic_share_of_request_ids():
    rids = [f"req-{i}" for i in range(20000)]
    assert not any(sampled(r, 0.0) for r in rids) and all(sampled(r, 1.0) for r in rids)
    share = sum(sampled(r, 0.1) for r in rids) / len(rids)
    assert 0.09 < share < 0.11
    assert [sampled(r, 0.1) for r in rids[:200]] == [sampled(r, 0.1) for r in rids[:200]]
    # a lower rate audits a subset of a higher one's (the same uniform draw per rid)
    assert all(sampled(r, 0.3) for r in rids if sampled(r, 0.1))


def test_which_requests_are_audited():
    common = {"rid": "r", "rate": 1.0}
    assert audit_trigger(forced=False, reference=False, exact=False, **common) == SAMPLED
    assert audit_trigger(forced=False, reference=False, exact=True, **common) is None   # exact: nothing to audit
    assert audit_trigger(forced=True, reference=False, exact=True, **common) == FORCED  # forced: whatever it was
    assert audit_trigger(forced=True, reference=True, exact=False, **common) is None    # never a reference run
    assert audit_trigger(forced=False, reference=False, exact=False, rid="r", rate=0.0) is None   # off


def _dist(*logits: float) -> torch.Tensor:
    return log_probs(torch.tensor(logits))


def test_divergence_of_equal_distributions_is_zero():
    p = _dist(1.0, 2.0, 0.5, -3.0)
    d = divergence(p, p.clone())
    assert d.kl == 0.0 and d.tv == 0.0 and d.top1_agree and d.reference_top1 == d.served_top1 == 1


def test_divergence_matches_the_definitions():
    ref, srv = _dist(1.0, 2.0, 0.5), _dist(2.5, 0.0, 0.5)
    p, q = ref.double().exp(), srv.double().exp()
    d = divergence(ref, srv)
    assert d.kl == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-9) and d.kl > 0
    assert d.tv == pytest.approx(0.5 * float((p - q).abs().sum()), rel=1e-9)
    assert not d.top1_agree and (d.reference_top1, d.served_top1) == (1, 0)


def test_divergence_over_tokens_one_side_rules_out():
    ref = _dist(0.0, 0.0, -math.inf)         # the reference never emits token 2: no contribution
    srv = _dist(0.0, 0.0, 0.0)
    assert divergence(ref, srv).kl == pytest.approx(math.log(1.5), rel=1e-6)   # float32 log-probabilities
    assert divergence(srv, ref).kl == math.inf   # the served side rules out a token the reference emits


def test_divergence_refuses_different_vocabularies():
    with pytest.raises(ValueError, match="different shapes"):
        divergence(_dist(1.0, 2.0), _dist(1.0, 2.0, 3.0))


def test_log_probs_are_float32_on_the_cpu():
    out = log_probs(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert float(out.exp().sum()) == pytest.approx(1.0)


def _served(rid: str, trigger: str = FORCED) -> ServedAnswer:
    return ServedAnswer(rid=rid, trigger=trigger, kind="approximate", bound=0.25, exact=False,
                        prompt=prompt_key([1, 2]), log_probs=_dist(1.0, 2.0))


def test_pending_audits_are_bounded_oldest_first():
    store = PendingAudits(capacity=2)
    for rid in ("a", "b", "c"):
        store.add(_served(rid))
    assert len(store) == 2 and "a" not in store and store.dropped == 1
    assert store.take("b").rid == "b" and store.take("b") is None and len(store) == 1
    assert PendingAudits().capacity == MAX_PENDING
    with pytest.raises(ValueError):
        PendingAudits(capacity=0)


def test_prompt_key_is_the_same_for_a_list_and_an_array():
    assert prompt_key([1, 2, 3]) == prompt_key(array("q", [1, 2, 3])) == prompt_key(array("l", [1, 2, 3]))
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4]) and prompt_key([1, 2]) != prompt_key([1, 2, 0])


def test_log_line_names_the_request_its_bound_and_the_divergence():
    result = AuditResult(served=_served("abc"), reference_rid="ref-1",
                         divergence=divergence(_dist(1.0, 2.0), _dist(2.0, 1.0)))
    line = result.log_line()
    assert line.startswith("Tail-Replay audit: rid=abc trigger=forced kind=approximate bound=2.500e-01 exact=false kl=")
    assert "top1_agree=false" in line and "reference rid=ref-1" in line


# ---------------------------------------------------------------- config keys


def test_audit_keys_are_validated_naming_the_key():
    assert DEFAULTS.server.audit_rate == 0.0 and DEFAULTS.audit is False and DEFAULTS.audit_of is None
    assert config_from_dict({"audit_rate": 0.05}).server.audit_rate == 0.05
    assert config_from_dict({"audit_rate": 1}).server.audit_rate == 1
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(TailReplayConfigError, match="'audit_rate': must be in \\[0, 1\\]"):
            config_from_dict({"audit_rate": bad})
    with pytest.raises(TailReplayConfigError, match="'audit_rate': has the wrong type"):
        config_from_dict({"audit_rate": True})
    with pytest.raises(TailReplayConfigError, match="'audit': is a per-request key; a server config cannot set it"):
        parse_config('{"audit": true}')
    with pytest.raises(TailReplayConfigError, match="'audit_of': is set by the server on its own background runs; "
                                                    "a server config cannot set it"):
        parse_config('{"audit_of": "x"}')
    with pytest.raises(TailReplayConfigError, match="'audit_rate': is a server setting"):
        with_overrides(DEFAULTS, {"audit_rate": 1.0})
    allowing = config_from_dict({"allow_request_audit_repair": True})
    with pytest.raises(TailReplayConfigError, match="'audit': has the wrong type"):
        with_overrides(allowing, {"audit": 1})
    for value in (7, "x"):   # whatever its value: the server's bookkeeping
        with pytest.raises(TailReplayConfigError, match="'audit_of': is set by the server on its own background "
                                                        "runs; a request cannot set it"):
            with_overrides(allowing, {"audit_of": value})
    assert with_overrides(allowing, {"audit": True}).audit
    assert "audit" not in user_settings(DEFAULTS) and "audit_of" not in user_settings(DEFAULTS)
    assert user_settings(DEFAULTS)["audit_rate"] == 0.0


def test_a_request_asks_for_its_own_audit_only_where_the_server_allows_it():
    assert DEFAULTS.server.allow_request_audit_repair is False
    for value in (True, False):
        with pytest.raises(TailReplayConfigError, match="'audit': is refused on this server: per-request audit and "
                                                        "repair are off \\(server config key 'allow_request_audit_repair'"):
            check_request(DEFAULTS, {"tail_replay": {"audit": value}})
    with pytest.raises(TailReplayConfigError, match="'allow_request_audit_repair': is a server setting"):
        check_request(DEFAULTS, {"tail_replay": {"allow_request_audit_repair": True}})
    allowing = config_from_dict({"allow_request_audit_repair": True})
    assert check_request(allowing, {"tail_replay": {"audit": True}}).audit


def test_the_servers_mark_never_comes_from_a_client():
    mark = background_mark(reference_overrides("someone-elses-rid"))
    with pytest.raises(TailReplayConfigError, match="custom_params\\['tail_replay_background'\\] is set by the "
                                                    "server on its own background runs; a request cannot set it"):
        check_request(DEFAULTS, {BACKGROUND_PARAM_KEY: mark})
    with pytest.raises(TailReplayConfigError, match="'audit_of': is set by the server"):
        check_request(DEFAULTS, {"tail_replay": dict(reference_overrides("someone-elses-rid"))})
    # what the scheduler resolves for a run the server marked (only the tokenizer process sets it)
    config = request_overrides(DEFAULTS, {BACKGROUND_PARAM_KEY: mark})
    assert config.background and config.audit_of == "someone-elses-rid"


def test_a_wrong_mark_fails_where_it_is_made():
    with pytest.raises(TailReplayConfigError, match="names the request it is for"):
        background_mark({"exactness": "exact"})
    with pytest.raises(TailReplayConfigError, match="unknown fields \\['window'\\]"):
        background_mark({"audit_of": "r", "window": 3})
    with pytest.raises(TailReplayConfigError, match="'repair_kind': must be one of"):
        background_mark({"repair_of": "r", "repair_kind": "branch"})


def test_the_reference_run_passes_any_servers_request_check():
    strict_server = RequestLimits(checkpoints_refused="no room", exact_kv_refused="quantized")
    config = request_overrides(DEFAULTS, {BACKGROUND_PARAM_KEY: background_mark(reference_overrides("rid-1"))},
                               strict_server)
    assert config.strict and config.audit_of == "rid-1" and not config.knobs.keep_checkpoints and not config.audit


def test_a_reference_run_is_not_counted_as_traffic(monkeypatch):
    counted = []
    monkeypatch.setattr(metrics, "record_plan", counted.append)
    plan = ReplayPlan(HitKind.MISS, 0, 0, 0)
    for config in (DEFAULTS, TailReplayConfig.of(audit_of="r")):
        record = attach(SimpleNamespace(), config)
        record.set_plan(plan)
        metrics.record_first_forward(record)
    assert counted == [plan]


# ---------------------------------------------------------------- scheduler side (patch), no server


class _Req(SimpleNamespace):
    pass


def _req(rid, ids, config, kind=HitKind.APPROXIMATE, bound=0.3, extend_end=None):
    req = _Req(rid=rid, origin_input_ids=list(ids), output_ids=[],
               extend_end=len(ids) if extend_end is None else extend_end)
    record = attach(req, config)
    record.set_plan(ReplayPlan(kind, len(ids), 0, 0))
    record.acc.output_bound = bound      # provenance of the output, as the forward left it
    return req


@pytest.fixture
def scheduler(monkeypatch):
    """The patch's scheduler side with a fresh store, this process as the recording rank, and the
    recorded audits collected."""
    recorded = []
    monkeypatch.setattr(tail_replay_audit, "_pending", None)
    monkeypatch.setattr(face, "records_here", lambda: True)
    monkeypatch.setattr(face, "record_audit", lambda trigger, d: recorded.append((trigger, d)))
    monkeypatch.setattr(metrics, "_this_rank_records", lambda: False)   # replay_summary's counters
    return recorded


def test_forced_audit_of_an_approximate_answer_records_its_divergence(scheduler, caplog):
    ids = [5, 6, 7, 8]
    served = _req("served-1", ids, TailReplayConfig.of(audit=True))
    tail_replay_audit.observe_forward([served], torch.tensor([[1.0, 2.0, 0.0]]))
    record = face.record_of(served)
    assert record.audit == FORCED and "served-1" in tail_replay_audit._pending_audits()
    assert metrics.replay_summary(record, len(ids))["audit"] == FORCED

    reference = _req("ref-1", ids, TailReplayConfig.of(**reference_overrides("served-1")), kind=HitKind.MISS, bound=0.0)
    with caplog.at_level("INFO", logger=tail_replay_audit.__name__):
        tail_replay_audit.observe_forward([reference], torch.tensor([[2.0, 1.0, 0.0]]))
    [(trigger, d)] = scheduler
    assert trigger == FORCED and d.kl > 0 and not d.top1_agree
    assert face.record_of(reference).audit is None      # a reference run is never audited itself
    assert "Tail-Replay audit: rid=served-1 trigger=forced kind=approximate bound=3.000e-01" in caplog.text
    assert len(tail_replay_audit._pending_audits()) == 0


def test_forced_audit_of_an_exact_answer_records_zero(scheduler):
    ids = [1, 2, 3]
    served = _req("served-2", ids, TailReplayConfig.of(audit=True), kind=HitKind.MISS, bound=0.0)
    row = torch.tensor([[0.3, -1.0, 2.0]])
    tail_replay_audit.observe_forward([served], row)
    reference = _req("ref-2", ids, TailReplayConfig.of(**reference_overrides("served-2")), kind=HitKind.MISS, bound=0.0)
    tail_replay_audit.observe_forward([reference], row.clone())
    [(trigger, d)] = scheduler
    assert trigger == FORCED and d.kl == 0.0 and d.tv == 0.0 and d.top1_agree


def test_sampling_audits_only_answers_that_are_not_exact(scheduler):
    every = TailReplayConfig.of(audit_rate=1.0)
    approx = _req("a", [1, 2], every, bound=0.3)
    exact = _req("e", [1, 2], every, kind=HitKind.EXACT_CHECKPOINT, bound=0.0)
    off = _req("o", [1, 2], DEFAULTS, bound=0.3)
    tail_replay_audit.observe_forward([approx, exact, off], torch.zeros(3, 4))
    assert [face.record_of(r).audit for r in (approx, exact, off)] == [SAMPLED, None, None]
    assert all("audit_decided" in face.record_of(r).done for r in (approx, exact, off))


def test_only_the_forward_that_gives_the_first_output_is_kept(scheduler):
    chunked = _req("c", [1, 2, 3, 4], TailReplayConfig.of(audit=True), extend_end=2)   # a middle chunk
    tail_replay_audit.observe_forward([chunked], torch.zeros(1, 4))
    assert "audit_decided" not in face.record_of(chunked).done
    chunked.extend_end = 4
    tail_replay_audit.observe_forward([chunked], torch.zeros(1, 4))
    assert face.record_of(chunked).audit == FORCED
    chunked.output_ids.append(1)                                                     # later forwards: decided once
    tail_replay_audit.observe_forward([chunked], torch.ones(1, 4))
    assert len(tail_replay_audit._pending_audits()) == 1


def test_a_reference_of_another_prompt_or_unknown_request_is_not_recorded(scheduler, caplog):
    served = _req("s", [1, 2, 3], TailReplayConfig.of(audit=True))
    tail_replay_audit.observe_forward([served], torch.zeros(1, 4))
    other = _req("r1", [1, 2, 4], TailReplayConfig.of(**reference_overrides("s")), kind=HitKind.MISS)
    unknown = _req("r2", [1, 2, 3], TailReplayConfig.of(**reference_overrides("nobody")), kind=HitKind.MISS)
    tail_replay_audit.observe_forward([other, unknown], torch.zeros(2, 4))
    assert scheduler == []
    assert "ran another prompt" in caplog.text and "found no served distribution for rid=nobody" in caplog.text


def test_an_audit_failure_never_reaches_the_scheduler(scheduler, caplog, monkeypatch):
    def broken(reqs, logits):
        raise RuntimeError("boom")

    monkeypatch.setattr(tail_replay_audit, "observe_forward", broken)
    wrapped = tail_replay_audit._wrap_capture(lambda *args: None)
    batch = SimpleNamespace(reqs=[])
    forward = SimpleNamespace(forward_mode=SimpleNamespace(is_extend_without_speculative=lambda: True))
    wrapped(batch, forward, SimpleNamespace(next_token_logits=torch.zeros(0, 4)))
    assert "Tail-Replay audit failed in the scheduler" in caplog.text


def test_finished_audited_requests_are_found_in_the_output():
    state = SimpleNamespace(obj=SimpleNamespace(input_ids=[1, 2]))
    out = SimpleNamespace(
        rids=["a", "b", "c", "d"],
        finished_reasons=[{"type": "length"}, None, {"type": "abort"}, {"type": "stop"}],
        cached_tokens_details=[{"tail_replay": {"audit": "forced"}}, {"tail_replay": {"audit": "forced"}},
                               {"tail_replay": {"audit": "sampled"}}, {"tail_replay": {"kind": "miss"}}])
    states = {rid: state for rid in out.rids}
    assert tail_replay_audit._audits_due(out, states) == [("a", "forced", state.obj)]
    assert tail_replay_audit._audits_due(SimpleNamespace(rids=["a"], finished_reasons=[None]), states) == []


def test_the_server_marks_its_own_runs_after_the_request_check():
    """patches/tail_replay/request.py: the mark goes from the `GenerateReqInput` the server built (a
    Python attribute, no request field) into the sampling params bound for the scheduler, after
    SGLang's check; a request without it (any client's) is left as it is."""
    from sglang_ext.patches.tail_replay import request as tail_replay_request

    def create(self, obj, *args):   # SGLang's _create_tokenized_object, reduced to what the wrapper reads
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=obj.sampling_params.get("custom_params")))

    wrapped = tail_replay_request._wrap_create(create)
    mark = background_mark(reference_overrides("rid-9"))
    own = tail_replay_request.mark_background_run(SimpleNamespace(sampling_params={"max_new_tokens": 1}), mark)
    assert wrapped(None, own).sampling_params.custom_params == {BACKGROUND_PARAM_KEY: mark}
    client = SimpleNamespace(sampling_params={"custom_params": {"tail_replay": {"budget": 0.5}}})
    assert wrapped(None, client).sampling_params.custom_params == {"tail_replay": {"budget": 0.5}}
    assert request_overrides(DEFAULTS, wrapped(None, own).sampling_params.custom_params).audit_of == "rid-9"
