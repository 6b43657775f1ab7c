"""The fuzzer's oracles over observations (`eval.fuzz.client`) and server logs. Pure: the
reference answers come in as a function.

1. `exactness_violations`: an answer whose meta_info says it is exact (`kv_exact` in the
   `tail_replay` block where the server reports it, else `exact`; every answer of SGLang's own
   cache, the control, with `all_exact`), or one whose request asked for `exactness: "exact"`
   (chunk layouts included: such a request is never assembled), has the greedy tokens of a
   server without cache and its output logprobs, and the input logprobs it asked for, within
   `tolerance`. A part of a batch request may instead agree with the server
   without cache asked the same batch (SGLang's CPU path computes a batch's parts together, and
   their logprobs move with the batch: by 1.4e-4 in the fuzzer's long run, on the server without
   cache as on any cache).
2. `tenancy_violations`: a request's cached tokens never exceed the longest common prefix of its ids
   with a sequence (prompt + answer) its own tenant (`extra_key`, `cache_salt`) sent before or
   alongside it: nothing another tenant cached is reused. A chunked LinearKV request registered
   its prefix P and every chunk itself on arrival, in its tenant's chunk namespace: it may reuse
   up to its last chunk's end (SGLang counts the whole assembled span as cached, EPIC's
   recomputed chunk heads included).
3. and 4. `log_violations`: SGLang's strict idle pool check and tree sanity check (their errors
   reach the log), tracebacks, and `status_violations`: 5xx answers, requests a hung server
   never answered, a 4xx to a valid request (except the documented refusals, `REFUSALS`), and a
   turn of another tenant's session that was not refused with a 400 naming the field.
5. `label_violations` (servers of the extension): every whole answer carries one label
   (`cached_tokens_details.tail_replay` with `kind`, `exact`, `kv_exact`, `bound`), consistent:
   `kv_exact` implies `exact`, `kv_exact` is `bound == 0`, an unknown bound is not exact.
6. `pressure_violations` (`exactness: "exact_unless_pressed"`): an approximate plan taken under
   pressure was pressed, certified within the server's tolerance and labelled not exact; an answer
   not pressed (or pressed beyond the tolerance) is an exactness target like an `"exact"` one.

Sampled answers (`sample`: temperature and seed) are compared with the server without cache
sampling under the same seed (both run `--enable-deterministic-inference`).

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


#: 400s a valid request may get by design (the server says why it cannot honour it): an
#: `exactness: "exact"` turn of a streaming session whose earlier turns were not strictly exact
REFUSALS = ("cannot be honoured in streaming session",)
#: the words a refused turn of another tenant's session must carry (`sglang_ext.session_tenancy`)
FOREIGN_TURN_REFUSAL = re.compile(r"this turn's (extra_key|cache_salt|lora_path)")


def asked_exact(obs: dict) -> bool:
    return bool(obs.get("tail_replay")) and obs["tail_replay"].get("exactness") == "exact"


def pressure_block(obs: dict) -> dict | None:
    label = (obs.get("details") or {}).get("tail_replay")
    block = label.get("pressure") if isinstance(label, dict) else None
    return block if isinstance(block, dict) else None


def strict_by_pressure(obs: dict) -> bool:
    """Under `exact_unless_pressed`: an answer whose arrival was not pressed, or pressed with no
    approximate plan within the tolerance (`beyond_tolerance`), is served as `exact` would be."""
    block = pressure_block(obs)
    return block is not None and (not block.get("pressed_by") or block.get("outcome") == "beyond_tolerance")


def claimed(obs: dict, all_exact: bool = False) -> bool | None:
    """The answer's claim; with `all_exact` (SGLang's own cache, exact by construction) an answer
    without a Tail-Replay block claims exact too."""
    claim = exactness_claim(obs["details"])
    return True if claim is None and all_exact else claim


def exactness_targets(observations: Iterable[dict], all_exact: bool = False) -> list[dict]:
    """Observations the exactness oracle checks: complete 200 answers that claim or asked exactness."""
    return [o for o in observations if o["status"] == 200 and o["completed"] and o["output_ids"]
            and (claimed(o, all_exact) or asked_exact(o) or strict_by_pressure(o))]


def batch_key(obs: dict) -> tuple:
    """A batch part's key in `same_batch` answers: (round, op, part)."""
    return obs.get("round"), obs["op"], obs["part"]


def _violation(oracle: str, obs: dict, detail: dict) -> dict:
    return {"oracle": oracle, "op": obs["op"], "part": obs["part"], "round": obs.get("round"), "kind": obs["kind"],
            "detail": detail}


Answer = tuple[list[int], list[float]]


def read_logprobs(obs: dict) -> list[float]:
    """What an answer's logprobs are compared by: the input logprobs it asked for, then its output
    logprobs (a reference asked with the same `logprob_start` gives the same layout)."""
    return list(obs.get("input_logprobs") or ()) + list(obs["logprobs"])


def _agrees(obs: dict, answer: Answer, tolerance: float) -> bool:
    ids, lp = answer
    mine = read_logprobs(obs)
    return obs["output_ids"] == ids and len(mine) == len(lp) and max(
        (abs(a - b) for a, b in zip(mine, lp, strict=True)), default=0.0) <= tolerance


def exactness_violations(observations: Iterable[dict], reference: Callable[..., Answer],
                         tolerance: float, recheck: Callable[..., Answer] | None = None,
                         same_batch: dict[tuple, Answer] | None = None, all_exact: bool = False) -> list[dict]:
    """`reference(ids, new, logprob_start, sample) -> (output ids, input logprobs from logprob_start
    (none for -1) then output logprobs)` of a server without cache, greedy or sampled with the
    answer's [temperature, seed] (answers asked side by side);
    `recheck`: the same server asked once more, alone. A disagreement that the
    recheck does not confirm (the server without cache answered differently alone than in a
    batch) is reported as oracle "reference unstable", not as a cache's violation. `same_batch`:
    per batch part (`batch_key`), the server without cache's answer to the same batch request;
    agreeing with it is agreeing. `all_exact`: every answer claims exact (the control)."""
    out = []
    for obs in exactness_targets(observations, all_exact):
        if same_batch is not None and obs["kind"] == "batch" and batch_key(obs) in same_batch \
                and _agrees(obs, same_batch[batch_key(obs)], tolerance):
            continue
        start, sample = obs.get("logprob_start", -1), obs.get("sample")
        ref_ids, ref_lp = reference(obs["ids"], len(obs["output_ids"]), start, sample)
        claim = claimed(obs, all_exact)
        why = ("meta_info says exact" if claim else "asked exactness: exact" if asked_exact(obs)
               else "not pressed, or pressed beyond the tolerance: served as exact")
        if not _agrees(obs, (ref_ids, ref_lp), tolerance) and recheck is not None:
            alone = recheck(obs["ids"], len(obs["output_ids"]), start, sample)
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
        diff = max((abs(a - b) for a, b in zip(read_logprobs(obs), ref_lp, strict=False)), default=0.0)
        if diff > tolerance or len(read_logprobs(obs)) != len(ref_lp):
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
        if obs["status"] != 200 or not obs["cached_tokens"]:
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
        if obs["chunked"]:   # its own registrations (on arrival, in its tenant's chunk namespace)
            allowed = max(allowed, obs.get("chunks_end", 0))
        if obs["cached_tokens"] > allowed:
            out.append(_violation("tenancy", obs, {"tenant": list(tenant), "cached_tokens": obs["cached_tokens"],
                                                   "own_tenant_prefix": allowed}))
    return out


def status_violations(observations: Iterable[dict]) -> list[dict]:
    """5xx answers (a 400 is a refusal, allowed; status 0 of an op cut on purpose is the client's)
    and requests without an answer (`eval.fuzz.client.TIMEOUT_S`: a hung server)."""
    out = [_violation("5xx", o, {"status": o["status"], "error": o["error"]}) for o in observations if o["status"] >= 500]
    out += [_violation("no answer", o, {"error": o["error"]}) for o in observations
            if o["status"] == 0 and (o["error"] or "").startswith("timeout")]
    for o in observations:
        if o.get("expect") == "refused":
            if o["status"] != 400 or not FOREIGN_TURN_REFUSAL.search(o["error"] or ""):
                out.append(_violation("tenancy", o, {"why": "another tenant's session turn was not refused naming "
                                                     "the field", "status": o["status"], "error": o["error"],
                                                     "cached_tokens": o["cached_tokens"]}))
        elif 400 <= o["status"] < 500 and not any(r in (o["error"] or "") for r in REFUSALS):
            out.append(_violation("4xx", o, {"status": o["status"], "error": o["error"]}))
    return out


LABEL_KEYS = ("kind", "exact", "kv_exact", "bound")


def label_violations(observations: Iterable[dict]) -> list[dict]:
    """Whole answers (not cut streams) of a server of the extension without one consistent label
    (see the module doc)."""
    out = []
    for o in observations:
        if o["status"] != 200 or not o.get("answered"):
            continue
        label = (o["details"] or {}).get("tail_replay")
        if not isinstance(label, dict) or any(key not in label for key in LABEL_KEYS):
            out.append(_violation("label", o, {"why": "no label", "details": o["details"]}))
            continue
        exact, kv_exact, bound = label["exact"], label["kv_exact"], label["bound"]
        wrong = (kv_exact and not exact) or (bound is None and (exact or kv_exact)) \
            or (bound is not None and kv_exact != (bound == 0.0))
        if wrong:
            out.append(_violation("label", o, {"why": "inconsistent label", "label": label}))
    return out


def pressure_violations(observations: Iterable[dict], tolerance: float | None) -> list[dict]:
    """Under `exact_unless_pressed` with the server's `pressure.tolerance`: an answer that took an
    approximate plan because it was pressed must have been pressed (`pressed_by` not empty), its
    certified planned bound within the tolerance, and say `exact: false`."""
    out = []
    for o in observations:
        block = pressure_block(o) if o["status"] == 200 else None
        if block is None or block.get("outcome") != "approximate":
            continue
        bound = block.get("planned_bound")
        label = o["details"]["tail_replay"]
        if not block.get("pressed_by") or bound is None or tolerance is None or bound > tolerance or label.get("exact"):
            out.append(_violation("pressure", o, {"pressure": block, "tolerance": tolerance, "exact": label.get("exact")}))
    return out


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
