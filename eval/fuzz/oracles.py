"""The fuzzer's oracles over observations (`eval.fuzz.client`) and server logs. Pure: the
reference answers come in as a function.

1. `exactness_violations`: an answer whose meta_info says it is exact (`kv_exact` in the
   `tail_replay` block where the server reports it, else `exact`; every answer of SGLang's own
   cache, the control, with `all_exact`), or one whose request asked for `exactness: "exact"`
   (without a chunk layout), has the greedy tokens of a server without cache and its output
   logprobs within `tolerance`. A part of a batch request may instead agree with the server
   without cache asked the same batch (SGLang's CPU path computes a batch's parts together, and
   their logprobs move with the batch: by 1.4e-4 in the fuzzer's long run, on the server without
   cache as on any cache).
2. `tenancy_violations`: a request's cached tokens never exceed the longest common prefix of its ids
   with a sequence (prompt + answer) its own tenant (`extra_key`, `cache_salt`) sent before or
   alongside it: nothing another tenant cached is reused. (Chunked LinearKV requests reuse their
   own registrations and are not checked.)
3. and 4. `log_violations`: SGLang's strict idle pool check and tree sanity check (their errors
   reach the log), tracebacks, and `status_violations`: 5xx answers and requests a hung server
   never answered.

A violation is a dict: {"oracle", "op", "part", "round", "detail"}.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

#: log lines that are violations (SGLang's pool checks raise ValueError with these messages)
LOG_PATTERNS = {
    "traceback": re.compile(r"^Traceback \(most recent call last\)", re.M),
    "memory leak": re.compile(r"memory leak detected", re.I),
    "sanity check": re.compile(r"sanity.?check.*(fail|error)|AssertionError", re.I),
    "scheduler exception": re.compile(r"Scheduler hit an exception"),
    # (not /health_generate: it answers 503 while a server starts)
    "http 5xx": re.compile(r'"[A-Z]+ /(?!health)\S* HTTP/[\d.]+" 5\d\d\b'),
}


def exactness_claim(details: dict) -> bool | None:
    """What the answer's meta_info says: `kv_exact` where present, else `exact`; None without a
    Tail-Replay block (no plan: no claim)."""
    block = details.get("tail_replay")
    if not isinstance(block, dict):
        return None
    if "kv_exact" in block:
        return bool(block["kv_exact"])
    if "exact" in block:
        return bool(block["exact"])
    return None


def asked_exact(obs: dict) -> bool:
    return bool(obs.get("tail_replay")) and obs["tail_replay"].get("exactness") == "exact" and not obs["chunked"]


def claimed(obs: dict, all_exact: bool = False) -> bool | None:
    """The answer's claim; with `all_exact` (SGLang's own cache, exact by construction) an answer
    without a Tail-Replay block claims exact too."""
    claim = exactness_claim(obs["details"])
    return True if claim is None and all_exact else claim


def exactness_targets(observations: Iterable[dict], all_exact: bool = False) -> list[dict]:
    """Observations the exactness oracle checks: complete 200 answers that claim or asked exactness."""
    return [o for o in observations if o["status"] == 200 and o["completed"] and o["output_ids"]
            and (claimed(o, all_exact) or asked_exact(o))]


def batch_key(obs: dict) -> tuple:
    """A batch part's key in `same_batch` answers: (round, op, part)."""
    return obs.get("round"), obs["op"], obs["part"]


def _violation(oracle: str, obs: dict, detail: dict) -> dict:
    return {"oracle": oracle, "op": obs["op"], "part": obs["part"], "round": obs.get("round"), "kind": obs["kind"],
            "detail": detail}


Answer = tuple[list[int], list[float]]


def _agrees(obs: dict, answer: Answer, tolerance: float) -> bool:
    ids, lp = answer
    return obs["output_ids"] == ids and max((abs(a - b) for a, b in zip(obs["logprobs"], lp, strict=False)),
                                            default=0.0) <= tolerance


def exactness_violations(observations: Iterable[dict], reference: Callable[[list[int], int], Answer],
                         tolerance: float, recheck: Callable[[list[int], int], Answer] | None = None,
                         same_batch: dict[tuple, Answer] | None = None, all_exact: bool = False) -> list[dict]:
    """`reference(ids, new) -> (output ids, output logprobs)` of a server without cache (answers
    asked side by side); `recheck`: the same server asked once more, alone. A disagreement that the
    recheck does not confirm (the server without cache answered differently alone than in a
    batch) is reported as oracle "reference unstable", not as a cache's violation. `same_batch`:
    per batch part (`batch_key`), the server without cache's answer to the same batch request;
    agreeing with it is agreeing. `all_exact`: every answer claims exact (the control)."""
    out = []
    for obs in exactness_targets(observations, all_exact):
        if same_batch is not None and obs["kind"] == "batch" and batch_key(obs) in same_batch \
                and _agrees(obs, same_batch[batch_key(obs)], tolerance):
            continue
        ref_ids, ref_lp = reference(obs["ids"], len(obs["output_ids"]))
        claim = claimed(obs, all_exact)
        why = "meta_info says exact" if claim else "asked exactness: exact"
        if not _agrees(obs, (ref_ids, ref_lp), tolerance) and recheck is not None:
            alone = recheck(obs["ids"], len(obs["output_ids"]))
            if _agrees(obs, alone, tolerance):
                out.append(_violation("reference unstable", obs, {
                    "why": why, "batched_reference_ids": ref_ids, "alone_reference_ids": alone[0],
                    "max_logprob_diff_batched_vs_alone": max((abs(a - b) for a, b in zip(ref_lp, alone[1], strict=False)),
                                                             default=0.0)}))
                continue
            ref_ids, ref_lp = alone
        if obs["output_ids"] != ref_ids:
            first = next(i for i, (a, b) in enumerate(zip(obs["output_ids"] + [None], ref_ids + [None], strict=False)) if a != b)
            out.append(_violation("exactness", obs, {"why": why, "claim": claim, "first_different_token": first,
                                                     "output_ids": obs["output_ids"], "reference_ids": ref_ids,
                                                     "cached_tokens": obs["cached_tokens"], "details": obs["details"]}))
            continue
        diff = max((abs(a - b) for a, b in zip(obs["logprobs"], ref_lp, strict=False)), default=0.0)
        if diff > tolerance:
            out.append(_violation("exactness", obs, {"why": why, "claim": claim, "max_logprob_diff": diff,
                                                     "tolerance": tolerance, "cached_tokens": obs["cached_tokens"],
                                                     "details": obs["details"]}))
    return out


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tenancy_violations(observations: list[dict]) -> list[dict]:
    """Cached tokens above what the request's own tenant could have cached (see the module doc).
    A sequence cut short (an abort, a 200 without all tokens) may have cached up to `new` more
    tokens than the client saw."""
    by_round: dict[int, list[dict]] = {}
    for o in observations:
        by_round.setdefault(o.get("round", 0), []).append(o)
    out = []
    for obs in observations:
        if obs["chunked"] or obs["status"] != 200 or not obs["cached_tokens"]:
            continue
        tenant = tuple(obs["tenant"])
        allowed = 0
        for r in sorted(by_round):
            if r > obs.get("round", 0):
                break
            for other in by_round[r]:
                if tuple(other["tenant"]) != tenant or other is obs or other["status"] not in (0, 200):
                    continue
                seq = other["ids"] + other["output_ids"]
                n = _lcp(obs["ids"], seq)
                if n == len(seq) and not other["completed"]:
                    n += other["new"]
                allowed = max(allowed, n)
        if obs["cached_tokens"] > allowed:
            out.append(_violation("tenancy", obs, {"tenant": list(tenant), "cached_tokens": obs["cached_tokens"],
                                                   "own_tenant_prefix": allowed}))
    return out


def status_violations(observations: Iterable[dict]) -> list[dict]:
    """5xx answers (a 400 is a refusal, allowed; status 0 of an op cut on purpose is the client's)
    and requests without an answer (`eval.fuzz.client.TIMEOUT_S`: a hung server)."""
    out = [_violation("5xx", o, {"status": o["status"], "error": o["error"]}) for o in observations if o["status"] >= 500]
    return out + [_violation("no answer", o, {"error": o["error"]}) for o in observations
                  if o["status"] == 0 and (o["error"] or "").startswith("timeout")]


def log_violations(log_text: str) -> list[dict]:
    """One violation per pattern found, with the first matching line and its context."""
    out = []
    for name, pattern in LOG_PATTERNS.items():
        match = pattern.search(log_text)
        if match:
            start = max(0, log_text.rfind("\n", 0, match.start()) - 200)
            out.append({"oracle": "log", "op": None, "part": None, "round": None, "kind": None,
                        "detail": {"pattern": name, "count": len(pattern.findall(log_text)),
                                   "excerpt": log_text[start:start + 2500]}})
    return out
