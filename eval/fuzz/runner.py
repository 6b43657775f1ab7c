"""Run fuzzer seeds against one live server configuration and apply the oracles.

`fuzz_server(server, reference, seeds, ...)` sends each seed's workload (`generate_workload`) to a
running server (the cache emptied between seeds, so a seed reproduces alone), checks after every
round that the server is up, after every seed that SGLang's idle check ran again (its strict pool
check and tree sanity check raise in the scheduler on a leak: the server dies), and applies the
oracles (`eval.fuzz.oracles`) to the seed's observations and the seed's part of the server log. A
server that died is reported with the round in flight and restarted. The first violation of each
kind (oracle, op kind, chunked or not) per configuration is shrunk (`eval.fuzz.shrink`).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable

import requests

from eval.fuzz.client import run_ops
from eval.fuzz.oracles import (
    batch_key,
    exactness_claim,
    exactness_targets,
    exactness_violations,
    label_violations,
    log_violations,
    pressure_violations,
    status_violations,
    tenancy_violations,
)
from eval.fuzz.reference import NoCacheReference
from eval.fuzz.shrink import shrink
from eval.fuzz.workload import Workload, WorkloadShape, generate_workload

_SANITY_METRIC = re.compile(r'^sglang:scheduler_stage_seconds_total\{category="sanity_check_cache"[^}]*\} (\S+)$', re.M)


class ServerDied(RuntimeError):
    pass


def idle_check_seconds(url: str) -> float:
    """Seconds SGLang's idle tree-cache sanity check has run so far (grows each time it runs)."""
    return sum(float(v) for v in _SANITY_METRIC.findall(requests.get(f"{url}/metrics", timeout=60).text))


def wait_for_idle_check(server, before: float, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc is None or server.proc.poll() is not None:
            raise ServerDied("the server died while idle (SGLang's strict pool check raises on a leak)")
        if idle_check_seconds(server.url) > before:
            return True
        time.sleep(0.5)
    return False


def _answers_or_died(server, r: int) -> None:
    """After a request went unanswered: a server that answers no new request counts as dead."""
    try:
        ok = requests.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    except requests.RequestException:
        ok = False
    if not ok:
        raise ServerDied(f"the server hung in round {r}: a request got no answer, and /health_generate none in 60 s")


def flush(url: str, wait_s: float = 60.0) -> None:
    deadline = time.monotonic() + wait_s
    while requests.post(f"{url}/flush_cache", timeout=120).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/flush_cache refused for {wait_s:.0f} s")
        time.sleep(0.3)


def same_batch_answers(observations: list[dict], reference: NoCacheReference, all_exact: bool = False) -> dict:
    """The server without cache's answers to every checked batch request, asked as the same batch
    (`oracles.batch_key` -> answer); a batch whose parts did not all complete is left out."""
    targets = {(o.get("round"), o["op"]) for o in exactness_targets(observations, all_exact) if o["kind"] == "batch"}
    groups: dict[tuple, list[dict]] = {}
    for o in observations:
        if o["kind"] == "batch" and (o.get("round"), o["op"]) in targets:
            groups.setdefault((o.get("round"), o["op"]), []).append(o)
    out = {}
    for parts in groups.values():
        parts.sort(key=lambda o: o["part"])
        if not all(o["status"] == 200 and o["completed"] for o in parts):
            continue
        for o, answer in zip(parts, reference.ask_batch([o["ids"] for o in parts], parts[0]["new"]), strict=True):
            out[batch_key(o)] = answer
    return out


def check(observations: list[dict], reference: NoCacheReference, tolerance: float, all_exact: bool = False,
          pressure_tolerance: float | None = None) -> list[dict]:
    """Every oracle over one seed's observations; `all_exact`: the server is SGLang's own cache (the
    control), whose every answer must equal the server without cache's; `pressure_tolerance`: the
    server's `pressure.tolerance` (None: no pressure thresholds)."""
    reference.prefetch([(o["ids"], len(o["output_ids"]), o.get("logprob_start", -1), o.get("sample"))
                        for o in exactness_targets(observations, all_exact)])
    return (exactness_violations(observations, reference, tolerance, recheck=reference.ask,
                                 same_batch=same_batch_answers(observations, reference, all_exact), all_exact=all_exact)
            + tenancy_violations(observations)
            + status_violations(observations)
            + pressure_violations(observations, pressure_tolerance)
            + ([] if all_exact else label_violations(observations)))


def path_counts(observations: list[dict], violations: list[dict], ops_by_index: dict[int, dict]) -> dict:
    """Per request path (`workload.paths_of`): {"requests", "violations"}."""
    from eval.fuzz.workload import paths_of

    out: dict[str, dict[str, int]] = {}
    for o in observations:
        for path in o.get("paths") or ():
            out.setdefault(path, {"requests": 0, "violations": 0})["requests"] += 1
    by_request = {(o["op"], o["part"]): o.get("paths") for o in observations}
    for v in violations:
        op = ops_by_index.get(v.get("op"))
        seen = by_request.get((v.get("op"), v.get("part")))
        for path in seen or (paths_of(op) if op is not None else ("server",)):
            out.setdefault(path, {"requests": 0, "violations": 0})["violations"] += 1
    return out


def _closure_ops(workload: Workload, observations: list[dict], in_flight: list[dict]) -> list[dict]:
    """The round that hung or killed the server: its ops (the round the last observation came from
    when it raised after the round)."""
    if observations:
        r = observations[-1]["round"]
        return workload.rounds[r]
    return in_flight


def _signature(v: dict, ops_by_index: dict[int, dict]) -> tuple:
    op = ops_by_index.get(v["op"], {})
    return v["oracle"], v["kind"], "linearkv" in op


def _replay(server, reference: NoCacheReference, tolerance: float, violation: dict,
            all_exact: bool = False, pressure_tolerance: float | None = None) -> Callable[[list[dict]], bool]:
    def reproduces(ops: list[dict]) -> bool:
        flush(server.url)
        observations = run_ops(server.url, [[op] for op in ops])
        return any(v["oracle"] == violation["oracle"] and v["op"] == violation["op"] and v["part"] == violation["part"]
                   for v in check(observations, reference, tolerance, all_exact, pressure_tolerance))
    return reproduces


def fuzz_server(server, reference: NoCacheReference, seeds: list[int], n_ops: int, shape: WorkloadShape,
                tolerance: float, concurrency: int = 4, shrink_budget: int = 8, max_shrinks: int = 4,
                deadline: float | None = None, restart: Callable[[], None] | None = None,
                all_exact: bool = False, pressure_tolerance: float | None = None,
                storage: bool = False) -> dict:
    """Returns {"seeds", "ops", "requests", "statuses", "claims", "paths" (per request path: requests
    and violations), "violations", "wall_s"}; each
    violation carries its seed and, where shrunk, its reproduction. `all_exact`: the server is
    SGLang's own cache (the control): every answer is checked against the server without cache.
    `pressure_tolerance`: the server's `pressure.tolerance`. `storage`: the server has HiCache's
    storage tier: it is emptied before each seed, and the server is restarted (`restart`, which
    must keep the storage and the port) after the seed's middle round, so the rest of the seed
    reads what the first half stored (path `l3`: the requests after the restart)."""
    t0 = time.monotonic()
    paths: dict[str, dict[str, int]] = {}
    statuses: Counter = Counter()
    claims: Counter = Counter()
    violations: list[dict] = []
    shrunk: set[tuple] = set()
    done_seeds, n_ops_sent, n_requests = [], 0, 0
    for seed in seeds:
        if deadline is not None and time.monotonic() > deadline:
            break
        workload: Workload = generate_workload(seed, n_ops, concurrency, shape)
        ops_by_index = {op["index"]: op for op in workload.ops()}
        log_start = len(server.log_text())
        earlier_log = ""   # the log of the server before a restart within the seed
        middle = len(workload.rounds) // 2 - 1 if storage and restart is not None else None

        def alive(r: int, this_round: list[dict], middle: int | None = middle) -> None:
            nonlocal log_start, earlier_log
            if server.proc is None or server.proc.poll() is not None:
                raise ServerDied(f"the server died in round {r}")
            if any(o["status"] == 0 and (o["error"] or "").startswith("timeout") for o in this_round):
                _answers_or_died(server, r)
            if r == middle and restart is not None:
                earlier_log += server.log_text()[log_start:]
                restart()
                log_start = 0

        observations: list[dict] = []
        try:
            if storage:
                requests.post(f"{server.url}/hicache/storage-backend/clear", timeout=120).raise_for_status()
            flush(server.url)
            run_ops(server.url, workload.rounds, after_round=alive, observations=observations)
            before = idle_check_seconds(server.url)
            idle_checked = wait_for_idle_check(server, before)
        except (ServerDied, requests.RequestException) as err:
            log = earlier_log + server.log_text()[log_start:]
            last = max((o["round"] for o in observations), default=-1) + 1
            in_flight = workload.rounds[last] if last < len(workload.rounds) else workload.rounds[-1]
            violations.append({"oracle": "server died", "seed": seed, "op": None, "part": None, "round": None,
                               "kind": None, "detail": {"error": str(err)[:300]},
                               "reproduction": {"seed": seed, "note": "the seed's workload, run as generated; "
                                                "the ops of the last round sent are in `ops`",
                                                "ops": _closure_ops(workload, observations, in_flight)}})
            violations += [{**v, "seed": seed, "reproduction": {"seed": seed}} for v in status_violations(observations)]
            violations += [{**v, "seed": seed} for v in log_violations(log)]
            if restart is None:
                break
            restart()
            done_seeds.append(seed)
            continue
        done_seeds.append(seed)
        n_ops_sent += len(ops_by_index)
        n_requests += len(observations)
        statuses.update(str(o["status"]) for o in observations)
        claims.update(str(exactness_claim(o["details"])) for o in observations if o["status"] == 200)
        if middle is not None:
            for o in observations:
                if o["round"] > middle:
                    o["paths"] = [*o["paths"], "l3"]
        found = check(observations, reference, tolerance, all_exact, pressure_tolerance)
        found += log_violations(earlier_log + server.log_text()[log_start:])
        if not idle_checked:
            found.append({"oracle": "idle check", "op": None, "part": None, "round": None, "kind": None,
                          "detail": {"error": "SGLang's idle pool and tree check did not run within 60 s of the "
                                              "seed's last answer (a request still running, or a stuck scheduler)"}})
        for v in found:
            v["seed"] = v.get("seed", seed)
            sig = _signature(v, ops_by_index)
            if v["oracle"] == "reference unstable":
                v["reproduction"] = {"seed": seed, "round": v["round"], "ops": [ops_by_index[v["op"]]],
                                     "note": "the server without cache's batched answer, not a cache's"}
            elif v["op"] is not None and sig not in shrunk and len(shrunk) < max_shrinks:
                shrunk.add(sig)
                result = shrink(workload.ops(), v["op"],
                                _replay(server, reference, tolerance, v, all_exact, pressure_tolerance), shrink_budget)
                v["reproduction"] = {"seed": seed, "round": v["round"], **result}
            elif v["op"] is not None:
                v["reproduction"] = {"seed": seed, "round": v["round"], "ops": [ops_by_index[v["op"]]],
                                     "note": "not shrunk (a violation of this kind was shrunk already)"}
        violations += found
        for path, counts in path_counts(observations, found, ops_by_index).items():
            total = paths.setdefault(path, {"requests": 0, "violations": 0})
            total["requests"] += counts["requests"]
            total["violations"] += counts["violations"]
    return {"seeds": done_seeds, "ops": n_ops_sent, "requests": n_requests, "statuses": dict(statuses),
            "claims": dict(claims), "paths": paths, "violations": violations,
            "wall_s": round(time.monotonic() - t0, 1)}
