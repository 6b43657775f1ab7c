"""The exactness fuzzer's pure parts: the workload generator, the oracles and the shrinker (no
server; the live runs are tests/e2e/test_exactness_fuzz.py)."""

from __future__ import annotations

import json

from eval.fuzz.oracles import (
    batch_key,
    exactness_claim,
    exactness_violations,
    label_violations,
    log_violations,
    pressure_violations,
    status_violations,
    tenancy_violations,
)
from eval.fuzz.shrink import shrink
from eval.fuzz.workload import LONG_DECODE, TENANTS, WorkloadShape, generate_workload, paths_of, requests_in


def test_same_seed_same_workload_and_ops_are_valid():
    shape = WorkloadShape(linearkv=True, max_context=900)
    a, b = generate_workload(3, 120, 4, shape), generate_workload(3, 120, 4, shape)
    assert json.dumps(a.rounds) == json.dumps(b.rounds)
    assert json.dumps(generate_workload(4, 120, 4, shape).rounds) != json.dumps(a.rounds)
    ops = a.ops()
    assert [op["index"] for op in ops] == list(range(120))
    round_of = {op["index"]: r for r, rnd in enumerate(a.rounds) for op in rnd}
    kinds = {op["op"] for op in ops}
    assert kinds == {"generate", "batch", "abort", "session", "foreign_session"}
    paths = {path for op in generate_workload(3, 400, 4, shape).ops() for path in paths_of(op)}
    assert {"chunked", "input_logprobs", "n_gt_1", "long_decode", "sampled", "continuation", "plain", "batch",
            "abort", "session", "foreign_session"} <= paths, paths
    assert any("linearkv" in op for op in ops) and any("continue_of" in op for op in ops)
    for op in ops:
        assert tuple(op["tenant"]) in TENANTS and requests_in(op) >= 1
        if "continue_of" in op:   # continues an op of an earlier round, same tenant
            assert round_of[op["continue_of"]] < round_of[op["index"]]
            assert ops[op["continue_of"]]["tenant"] == op["tenant"]
        if op["op"] == "foreign_session":   # the second turn is another tenant's
            assert op["turns"][1]["tenant"] != op["tenant"] and "tenant" not in op["turns"][2]
        if "logprob_start" in op:
            assert 0 <= op["logprob_start"] < len(op["ids"])
        if "sample" in op:       # a temperature and a seed, never with n > 1 or input logprobs
            assert op["sample"][0] > 0 and isinstance(op["sample"][1], int) and op.get("n", 1) == 1
            assert "logprob_start" not in op
        if op["op"] == "generate" and op["new"] >= LONG_DECODE:
            assert len(op["ids"]) + op["new"] < shape.max_context
        if "linearkv" in op:      # spans ordered, disjoint, inside the prompt, a question after them
            spans = op["linearkv"]["chunks"]
            assert all(s < e for s, e in spans) and all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))
            assert spans[-1][1] < len(op["ids"])
    # a chunked request's own tokens come back later as a plain prompt asking for exactness
    twins = [op for op in ops if op["op"] == "generate" and "linearkv" not in op
             and any("linearkv" in o and o["ids"] == op["ids"] and round_of[o["index"]] < round_of[op["index"]] for o in ops)]
    assert twins and all(t["tail_replay"]["exactness"] == "exact" for t in twins)
    assert not any("linearkv" in op for op in generate_workload(3, 120, 4, WorkloadShape()).ops())


def _obs(op, ids, out, tenant=(None, None), cached=0, rnd=0, details=None, overrides=None, completed=True, **kw):
    return {"op": op, "part": 0, "kind": kw.pop("kind", "generate"), "status": 200, "tenant": list(tenant), "ids": ids, "new": len(out),
            "output_ids": out, "logprobs": [-1.0] * len(out), "cached_tokens": cached, "details": details or {},
            "tail_replay": overrides, "chunked": False, "completed": completed, "round": rnd, "error": None, **kw}


def test_tenancy_oracle_bounds_cached_tokens_by_the_tenants_own_prefixes():
    a, b = ("tenant-a", None), ("tenant-b", None)
    doc = list(range(10, 60))
    obs = [_obs(0, doc, [1, 2], tenant=a),
           _obs(1, doc + [7], [3], tenant=a, cached=50, rnd=1),          # its own document: fine
           _obs(2, doc + [8], [3], tenant=b, cached=20, rnd=1),          # tenant a's tokens: a leak
           _obs(3, doc[:30] + [9], [3], tenant=b, cached=30, rnd=2)]     # now b has sent them itself
    found = tenancy_violations(obs)
    assert [(v["op"], v["detail"]["own_tenant_prefix"]) for v in found] == [(2, 0)]
    # an answer cut short may have cached up to `new` tokens past what the client saw
    cut = [_obs(0, doc, [1], tenant=a, completed=False), _obs(1, doc + [1, 5, 6], [2], tenant=a, cached=52, rnd=1)]
    cut[0]["new"] = 4
    assert tenancy_violations(cut) == []


def test_exactness_oracle_checks_claims_and_exact_requests_against_the_reference():
    def reference(ids, new, start=-1, sample=None):
        return [5] * new, [-1.0] * new

    claimed = {"tail_replay": {"exact": True}}
    obs = [_obs(0, [1, 2], [5, 5], details=claimed),
           _obs(1, [1, 3], [5, 6], details=claimed),                                            # other tokens
           _obs(2, [1, 4], [5, 5], details={"tail_replay": {"exact": False}}),                 # no claim
           _obs(3, [1, 5], [5, 5], details={"tail_replay": {"exact": True, "kv_exact": False}}),  # kv_exact wins
           _obs(4, [1, 6], [5, 7], overrides={"exactness": "exact"})]                          # asked, no meta
    obs[0]["logprobs"] = [-1.0, -1.0 + 5e-5]
    obs[3]["output_ids"] = [9, 9]
    found = exactness_violations(obs, reference, tolerance=1e-4)
    assert [v["op"] for v in found] == [1, 4]
    obs[0]["logprobs"] = [-1.0, -1.02]
    assert [v["op"] for v in exactness_violations(obs[:1], reference, tolerance=1e-4)] == [0]
    # the reference asked alone agrees with op 1: its batched answer was the odd one out
    found = exactness_violations(obs[:2], reference, tolerance=1e-4, recheck=lambda ids, new, start, sample: ([5, 6], [-1.0] * new))
    assert [(v["op"], v["oracle"]) for v in found] == [(0, "exactness"), (1, "reference unstable")]
    assert exactness_claim({"tail_replay": {"exact": True, "kv_exact": False}}) is False
    assert exactness_claim({}) is None


def test_a_batch_part_may_agree_with_the_same_batch_and_the_control_claims_every_answer():
    def reference(ids, new, start=-1, sample=None):
        return [5] * new, [-1.0] * new

    claimed = {"tail_replay": {"exact": True}}
    part = _obs(0, [1, 2], [5, 5], details=claimed, kind="batch")
    part["logprobs"] = [-1.0, -1.0002]                     # off the reference asked alone
    same = {batch_key(part): ([5, 5], [-1.0, -1.0002])}   # as the server without cache answers the batch
    assert [v["op"] for v in exactness_violations([part], reference, 1e-4)] == [0]
    assert exactness_violations([part], reference, 1e-4, same_batch=same) == []
    assert [v["op"] for v in exactness_violations([part], reference, 1e-4,
                                                  same_batch={batch_key(part): ([5, 5], [-1.0, -1.01])})] == [0]
    # SGLang's own cache (no Tail-Replay block): checked only as the control (all_exact)
    stock = _obs(1, [1, 3], [5, 6])
    assert exactness_violations([stock], reference, 1e-4) == []
    found = exactness_violations([stock], reference, 1e-4, all_exact=True)
    assert [(v["op"], v["detail"]["claim"]) for v in found] == [(1, True)]


def test_chunked_and_input_logprob_requests_are_checked_too():
    """No exemptions: a chunked request asking exact is compared like any (it is prefilled); a
    request with input logprobs is compared on them as well (the reference asked from the same
    position); a chunked request's reuse is bounded by its tenant's prefixes and what it
    registered itself (P and its chunks: up to its last chunk's end)."""
    def reference(ids, new, start=-1, sample=None):
        return [5] * new, ([-2.0] * (len(ids) - start - 1) if start >= 0 else []) + [-1.0] * new

    chunked = _obs(0, [1, 2, 3, 4], [5, 6], overrides={"exactness": "exact"}, chunked=True)
    assert [v["op"] for v in exactness_violations([chunked], reference, 1e-4)] == [0]
    logprobs = _obs(1, [1, 2, 3, 4], [5, 5], details={"tail_replay": {"exact": True, "kv_exact": True}},
                    logprob_start=1, input_logprobs=[-2.0, -2.0])
    assert exactness_violations([logprobs], reference, 1e-4) == []
    logprobs["input_logprobs"] = [-2.0, -2.5]
    assert [v["op"] for v in exactness_violations([logprobs], reference, 1e-4)] == [1]
    a = ("tenant-a", None)
    own = _obs(2, list(range(10, 60)), [3], tenant=a, cached=38, chunked=True, chunks_end=38,
               details={"linearkv": {"reused_tokens": 30}})   # (EPIC heads: counted cached, not reused)
    assert tenancy_violations([own]) == []
    own["cached_tokens"] = 39
    assert [v["op"] for v in tenancy_violations([own])] == [2]


def test_every_answer_has_one_consistent_label_and_valid_requests_are_not_refused():
    good = {"tail_replay": {"kind": "miss", "exact": True, "kv_exact": True, "bound": 0.0}}
    obs = [_obs(0, [1], [2], details=good, answered=True),
           _obs(1, [1], [2], details={}, answered=True),                                            # no label
           _obs(2, [1], [2], details={"tail_replay": {"kind": "assembled", "exact": True, "kv_exact": False,
                                                       "bound": None}}, answered=True),              # unknown, exact
           _obs(3, [1], [2], details={"tail_replay": {"kind": "approximate", "exact": False, "kv_exact": True,
                                                       "bound": 0.5}}, answered=True),               # kv_exact, not exact
           _obs(4, [1], [2], details={}, answered=False)]                                            # a cut stream
    assert [(v["op"], v["detail"]["why"]) for v in label_violations(obs)] == [
        (1, "no label"), (2, "inconsistent label"), (3, "inconsistent label")]
    refused = {"status": 400, "output_ids": [], "completed": False}
    statuses = [_obs(5, [1], [], **{**refused, "error": "'exactness': 'exact' cannot be honoured in streaming session 's'"}),
                _obs(6, [1], [], **{**refused, "error": "custom_params: unknown key"}),
                _obs(7, [1], [], **{**refused, "error": "session_params.id 's': this turn's extra_key differ"},
                     expect="refused"),
                _obs(8, [1], [2], expect="refused")]                                         # answered: a leak
    assert [(v["op"], v["oracle"]) for v in status_violations(statuses)] == [(6, "4xx"), (8, "tenancy")]


def test_log_oracle_finds_tracebacks_and_leaks():
    assert log_violations("INFO all good\n") == []
    log = "x\nTraceback (most recent call last):\n  ...\nValueError: token_to_kv_pool memory leak detected! n=3\n"
    assert {v["detail"]["pattern"] for v in log_violations(log)} == {"traceback", "memory leak"}
    starting = '[t] INFO:     127.0.0.1:1 - "GET /health_generate HTTP/1.1" 503 Service Unavailable\n'
    assert log_violations(starting) == []
    failed = '[t] INFO:     127.0.0.1:1 - "POST /generate HTTP/1.1" 500 Internal Server Error\n'
    assert [v["detail"]["pattern"] for v in log_violations(starting + failed)] == ["http 5xx"]


def test_shrink_keeps_dependencies_and_drops_unrelated_ops():
    ops = [{"index": i, "op": "generate", "ids": [i] * 20, "tenant": [None, None]} for i in range(8)]
    ops[6]["continue_of"] = 2
    ops[7]["ids"] = [3] * 20                                  # shares its lead with op 3
    ops[7]["continue_of"] = 6
    runs = []

    def reproduces(cand):   # the violation of op 7 needs op 5 before it
        runs.append([op["index"] for op in cand])
        return 5 in runs[-1] and 7 in runs[-1]

    result = shrink(ops, 7, reproduces, budget=10)
    assert result["reproduced"] and [op["index"] for op in result["ops"]] == [2, 5, 6, 7]
    assert runs[0] == [2, 6, 7]   # first the op with what it continues
    assert not shrink(ops, 7, lambda cand: False, budget=10)["reproduced"]


def test_shrink_reads_the_lead_of_every_op_kind():
    """Sessions (own and another tenant's) and batches lead with their first turn's or prompt's ids;
    a workload that holds every kind before the violating op is shrunk without error."""
    lead = [9] * 20
    ops = [{"index": 0, "op": "foreign_session", "tenant": ["a", None], "turns": [{"ids": lead, "new": 1}]},
           {"index": 1, "op": "session", "tenant": ["b", None], "turns": [{"ids": [1] * 20, "new": 1}]},
           {"index": 2, "op": "batch", "tenant": [None, None], "prompts": [[2] * 20], "new": 1},
           {"index": 3, "op": "abort", "tenant": [None, None], "ids": [3] * 20, "new": 30},
           {"index": 4, "op": "generate", "tenant": [None, None], "ids": lead + [4], "new": 1}]
    result = shrink(ops, 4, lambda cand: 0 in [op["index"] for op in cand], budget=10)
    assert result["reproduced"] and [op["index"] for op in result["ops"]] == [0, 4]


def test_sampled_answers_are_compared_under_their_seed():
    """The reference is asked with the answer's temperature and seed (a greedy reference would
    differ); the same tokens under another seed are not the reference's."""
    asked = []

    def reference(ids, new, start=-1, sample=None):
        asked.append(sample)
        return ([7] * new if sample == [1.0, 3] else [5] * new), [-1.0] * new

    obs = _obs(0, [1, 2], [7, 7], details={"tail_replay": {"exact": True}}, sample=[1.0, 3])
    assert exactness_violations([obs], reference, 1e-4) == [] and asked == [[1.0, 3]]
    obs["sample"] = [1.0, 4]
    assert [v["op"] for v in exactness_violations([obs], reference, 1e-4)] == [0]
    heavy = generate_workload(5, 300, 4, WorkloadShape(long_decode_rate=0.3, sampled_rate=0.0)).ops()
    assert sum(op.get("new", 0) >= LONG_DECODE for op in heavy) > 3 * sum(
        op.get("new", 0) >= LONG_DECODE for op in generate_workload(5, 300, 4, WorkloadShape()).ops())
    assert not any("sample" in op for op in heavy)


def test_pressure_oracle_and_unpressed_answers_are_exactness_targets():
    """An approximate plan under pressure: pressed, certified within the tolerance, labelled not
    exact. An answer not pressed (or pressed beyond the tolerance) must equal the reference though
    it neither claims nor asked exactness."""
    def label(pressed_by, outcome, bound, exact=False):
        return {"tail_replay": {"kind": "approximate", "exact": exact, "kv_exact": False, "bound": 0.01,
                                "pressure": {"pressed_by": pressed_by, "outcome": outcome, "planned_bound": bound}}}

    obs = [_obs(0, [1], [2], details=label(["num_queue_reqs"], "approximate", 0.04)),
           _obs(1, [1], [2], details=label(["num_queue_reqs"], "approximate", 0.06)),    # beyond tolerance
           _obs(2, [1], [2], details=label([], "approximate", 0.01)),                    # not pressed
           _obs(3, [1], [2], details=label(["num_queue_reqs"], "approximate", 0.01, exact=True)),  # says exact
           _obs(4, [1], [2], details=label(["num_queue_reqs"], "approximate", None))]     # no certified bound
    assert [v["op"] for v in pressure_violations(obs, 0.05)] == [1, 2, 3, 4]
    assert [v["op"] for v in pressure_violations(obs, None)] == [0, 1, 2, 3, 4]

    def reference(ids, new, start=-1, sample=None):
        return [9] * new, [-1.0] * new

    served = [_obs(5, [1], [2], details=label([], "not_pressed", None)),
              _obs(6, [1], [2], details=label(["num_queue_reqs"], "beyond_tolerance", 0.2)),
              _obs(7, [1], [2], details=label(["num_queue_reqs"], "approximate", 0.01))]
    assert [v["op"] for v in exactness_violations(served, reference, 1e-4)] == [5, 6]
