"""Modeled GPU goodput at a TTFT SLO: each replayed request's modeled GPU service time
(`gpu_model.modeled_ttfts`: its prefill on the named GPU and real model, plus the server's
scheduler CPU beyond the baseline's) fed through a queue, at offered loads of the baseline's
capacity (no SGLang, no HTTP; a report directory of `python -m eval.replay` in, `goodput.json` out).

The queue, and what it assumes:

* One server, first come first served, one prefill at a time: a request's TTFT is its wait plus
  its own service time. A real GPU batches prefills (chunked prefill), so queues here are longer
  than a GPU's at the same load; every server is priced the same way.
* Arrivals: a Poisson process (exponential gaps, seeded), the same gaps for every server (common
  random numbers), scaled to the rate. The rate at load u is u / the baseline's mean service time,
  so u = 0.5 / 0.7 / 0.85 is the baseline server's utilisation; another server's utilisation at
  the same rate is the rate x its own mean service.
* Each request keeps the reuse it had in the live run (`cached_tokens` at the replay's own
  concurrency): the cache's state is not re-simulated under the new arrival order.
* Goodput: the requests per second whose TTFT is within the SLO (rate x the share within it, as
  aiperf's `--goodput time_to_first_token:<ms>`). The highest rate within the SLO: the largest
  rate at which `within` (default 90 %) of requests are within it, found by bisection (with the
  gaps scaled by 1 / rate every wait grows with the rate, so the share within falls monotonically).

    python -m eval.replay.goodput REPORT_DIR [REPORT_DIR ...] [--slo-s 1.0] [--loads 0.5 0.7 0.85]
        [--pressure NAME EXACT PRESSED QUEUE_WAIT_S ...]

`--pressure` models `exactness: "exact_unless_pressed"` with a `queue_wait_s` threshold in the same
queue, from two servers of the report: EXACT (the policy's server never pressed, or any exact one)
and PRESSED (the same server pressed on every request: each request's plan under pressure, within
the tolerance). A request arriving while the oldest request still waiting has waited at least
QUEUE_WAIT_S takes its PRESSED service time, any other its EXACT one: the decision at arrival, from
the queue, as the live policy's stamp. It assumes a request's reuse in either mode does not depend
on which mode earlier requests took (the live cache does: an approximate answer stores inexact
states), so it is a model of the policy's queueing, not of its cache.

Every replay's report.json carries the table at the defaults (`modeled_gpu_goodput`, and each
server row its share: `add_modeled_goodput`); the command recomputes it for a report directory,
also one written before, with other settings.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections.abc import Sequence
from pathlib import Path

from eval.replay.gpu_model import modeled_ttfts
from eval.replay.real_models import gpu, real_model

DEFAULT_LOADS = (0.5, 0.7, 0.85)
DEFAULT_SLO_S = 1.0
DEFAULT_WITHIN = 0.9
SEED = 0


def fcfs_ttfts(arrivals: Sequence[float], services: Sequence[float]) -> list[float]:
    """Each request's TTFT (wait + service) in a one-server first-come-first-served queue; the
    requests in arrival order (`arrivals` non-decreasing)."""
    free_at, out = float("-inf"), []
    for arrival, service in zip(arrivals, services, strict=True):
        start = max(arrival, free_at)
        free_at = start + service
        out.append(free_at - arrival)
    return out


def pressure_ttfts(arrivals: Sequence[float], exact: Sequence[float], pressed: Sequence[float],
                   queue_wait_s: float) -> tuple[list[float], list[bool]]:
    """`fcfs_ttfts` where each request chooses its service at arrival: `pressed[i]` when the
    oldest request still waiting then (arrived, not started) has waited at least `queue_wait_s`
    (0 with nobody waiting, so a threshold of 0 always is, as the live policy's), else `exact[i]`.
    Returns the TTFTs and which requests were pressed."""
    starts: list[float] = []
    arrived: list[float] = []
    free_at, oldest, ttfts, flags = float("-inf"), 0, [], []
    for arrival, e, p in zip(arrivals, exact, pressed, strict=True):
        while oldest < len(starts) and starts[oldest] <= arrival:   # started by now: not waiting
            oldest += 1
        waited = arrival - arrived[oldest] if oldest < len(starts) else 0.0   # 0 with nobody waiting, as live
        is_pressed = waited >= queue_wait_s
        start = max(arrival, free_at)
        free_at = start + (p if is_pressed else e)
        starts.append(start)
        arrived.append(arrival)
        ttfts.append(free_at - arrival)
        flags.append(is_pressed)
    return ttfts, flags


def unit_gaps(n: int, seed: int = SEED) -> list[float]:
    """n exponential gaps of mean 1 (a Poisson process of rate 1), seeded."""
    rng = random.Random(seed)
    return [rng.expovariate(1.0) for _ in range(n)]


def arrivals_at(gaps: Sequence[float], rate: float) -> list[float]:
    """Arrival times of the gaps scaled to `rate` requests per second (the first at its gap)."""
    if not rate > 0:
        raise ValueError(f"the rate must be > 0, got {rate}")
    t, out = 0.0, []
    for gap in gaps:
        t += gap / rate
        out.append(t)
    return out


def share_within(ttfts: Sequence[float], slo_s: float) -> float:
    return sum(t <= slo_s for t in ttfts) / len(ttfts) if ttfts else 0.0


def max_rate_within(services: Sequence[float], gaps: Sequence[float], slo_s: float, within: float,
                    iterations: int = 60, queue=None) -> float | None:
    """The largest rate (requests/s) at which `within` of the requests' TTFTs are at most `slo_s`;
    0 when even an empty queue misses it (the services alone exceed the SLO); None when no rate
    does (all of them arriving at once still meet it: too few requests to tell). `queue`: the
    TTFTs at given arrivals (default `fcfs_ttfts` over `services`; the pressure model passes its
    own, whose unloaded services are `services`)."""
    ttfts_at = queue or (lambda arrivals: fcfs_ttfts(arrivals, services))
    if share_within(services, slo_s) < within:
        return 0.0
    if not all(s > 0 for s in services):
        raise ValueError("every service time must be > 0")
    if share_within(ttfts_at([0.0] * len(services)), slo_s) >= within:
        return None
    lo, hi = 0.0, len(services) / sum(services)   # the rate that keeps the server busy on average
    while share_within(ttfts_at(arrivals_at(gaps, hi)), slo_s) >= within:
        lo, hi = hi, hi * 2
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if mid > 0 and share_within(ttfts_at(arrivals_at(gaps, mid)), slo_s) >= within:
            lo = mid
        else:
            hi = mid
    return lo


def goodput_table(services: dict[str, list[float]], baseline: str, *, slo_s: float = DEFAULT_SLO_S,
                  loads: Sequence[float] = DEFAULT_LOADS, within: float = DEFAULT_WITHIN,
                  seed: int = SEED, pressure: Sequence[tuple[str, str, str, float]] = ()) -> dict:
    """Per server: goodput and TTFT at each load of the baseline's capacity, and the highest rate
    within the SLO (module docstring). `services`: each server's per-request service times in
    seconds, in trace order. `pressure`: (name, exact server, pressed server, queue_wait_s) rows
    of the modeled pressure policy (module docstring; each load's row says `pressed_share`)."""
    if baseline not in services or not services[baseline]:
        raise ValueError(f"no service times for the baseline server {baseline!r}")
    from eval.replay.report import percentile

    n = max(len(v) for v in services.values())
    gaps = unit_gaps(n, seed)
    base_mean = sum(services[baseline]) / len(services[baseline])
    out: dict = {"slo_s": slo_s, "within": within, "loads": list(loads), "seed": seed, "baseline": baseline,
                 "baseline_mean_service_s": base_mean, "servers": {}}
    for name, times in services.items():
        if not times:   # a server that answered nothing has no queue to model
            continue
        mean = sum(times) / len(times)
        rows = []
        for load in loads:
            rate = load / base_mean
            ttfts = fcfs_ttfts(arrivals_at(gaps[:len(times)], rate), times)
            rows.append({"load": load, "rate_per_s": rate, "utilisation": rate * mean,
                         "goodput_per_s": rate * share_within(ttfts, slo_s), "share_within_slo": share_within(ttfts, slo_s),
                         "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p50_s": percentile(ttfts, 50),
                         "ttft_p95_s": percentile(ttfts, 95)})
        out["servers"][name] = {"requests": len(times), "mean_service_s": mean, "at_load": rows,
                                "max_rate_within_slo_per_s": max_rate_within(times, gaps[:len(times)], slo_s, within)}
    for name, exact_name, pressed_name, wait_s in pressure:
        exact, pressed = services.get(exact_name), services.get(pressed_name)
        if not exact or not pressed or len(exact) != len(pressed):
            raise ValueError(f"--pressure {name}: needs servers {exact_name!r} and {pressed_name!r} of the report "
                             "with one service time per request each")
        if name in out["servers"]:
            raise ValueError(f"--pressure {name}: the report has a server of that name")

        def queue(arrivals, exact=exact, pressed=pressed, wait_s=wait_s):
            return pressure_ttfts(arrivals, exact, pressed, wait_s)[0]

        rows = []
        for load in loads:
            rate = load / base_mean
            ttfts, flags = pressure_ttfts(arrivals_at(gaps[:len(exact)], rate), exact, pressed, wait_s)
            served = [p if f else e for e, p, f in zip(exact, pressed, flags)]
            rows.append({"load": load, "rate_per_s": rate, "utilisation": rate * sum(served) / len(served),
                         "goodput_per_s": rate * share_within(ttfts, slo_s), "share_within_slo": share_within(ttfts, slo_s),
                         "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p50_s": percentile(ttfts, 50),
                         "ttft_p95_s": percentile(ttfts, 95), "pressed_share": sum(flags) / len(flags)})
        out["servers"][name] = {"requests": len(exact), "mean_service_s": sum(exact) / len(exact), "at_load": rows,
                                "pressure": {"exact": exact_name, "pressed": pressed_name, "queue_wait_s": wait_s},
                                "max_rate_within_slo_per_s": max_rate_within(exact, gaps[:len(exact)], slo_s, within,
                                                                             queue=queue)}
    base = out["servers"][baseline]
    for row in out["servers"].values():
        row["goodput_x_baseline"] = [
            (r["goodput_per_s"] / b["goodput_per_s"]) if b["goodput_per_s"] else None
            for r, b in zip(row["at_load"], base["at_load"])]
        row["max_rate_x_baseline"] = (row["max_rate_within_slo_per_s"] / base["max_rate_within_slo_per_s"]
                                      if row["max_rate_within_slo_per_s"] is not None
                                      and base["max_rate_within_slo_per_s"] else None)
    return out


def _records(directory: Path, index: int, server: str) -> list[dict]:
    for name in (f"requests-{index}-{server}.jsonl", f"requests-{index}-{server}.jsonl.gz"):
        path = directory / name
        if path.exists():
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt") as handle:
                return [json.loads(line) for line in handle if line.strip()]
    raise FileNotFoundError(f"{directory}: no requests-{index}-{server}.jsonl(.gz)")


def services_from(rows: Sequence[dict], per_server: dict[str, Sequence[dict]], spec: dict) -> dict[str, list[float]]:
    """Each server's modeled GPU service times (s): its answered requests' modeled prefill under the
    report's GPU model (`spec`: report.json's `gpu_model`) plus its row's CPU term."""
    model, device = real_model(spec["model"]), gpu(spec["gpu"])
    scale = spec.get("real_tokens_per_replayed_token", 1.0)
    services = {}
    for row in rows:
        modeled = row.get("modeled_gpu_ttft_s") or {}
        cpu_s = (modeled.get("cpu_beyond_baseline_ms") or 0.0) / 1e3
        services[row["server"]] = modeled_ttfts(per_server[row["server"]], model, device, spec["efficiency"], cpu_s, scale)
    return services


def report_services(directory: Path) -> tuple[dict[str, list[float]], str]:
    """Each server's modeled GPU service times (s) from a replay report directory (report.json's GPU
    model and each row's CPU term, the per-request files' tokens), and the baseline's name."""
    report = json.loads((directory / "report.json").read_text())
    spec = report.get("gpu_model")
    if not spec:
        raise ValueError(f"{directory}/report.json has no gpu_model (run the replay with a GPU model)")
    per_server = {row["server"]: _records(directory, index, row["server"]) for index, row in enumerate(report["servers"])}
    baseline = spec.get("baseline") or report["servers"][0]["server"]
    return services_from(report["servers"], per_server, spec), baseline


def add_modeled_goodput(rows: list[dict], per_server: dict[str, Sequence[dict]], spec: dict,
                        baseline: str | None) -> dict | None:
    """The replay's own goodput table at the defaults (report.json's `modeled_gpu_goodput`), and
    each row's share of it (`modeled_gpu_goodput`: goodput x the baseline's at each load, the
    highest rate within the SLO); None without a baseline that answered. Mutates `rows` only."""
    services = services_from(rows, per_server, spec)
    if baseline is None or not services.get(baseline):
        return None
    table = goodput_table(services, baseline)
    for row in rows:
        mine = table["servers"].get(row["server"])
        row["modeled_gpu_goodput"] = None if mine is None else {
            "slo_s": table["slo_s"], "loads": table["loads"], "goodput_x_baseline": mine["goodput_x_baseline"],
            "max_rate_within_slo_per_s": mine["max_rate_within_slo_per_s"]}
    return table


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.replay.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="replay report directories (report.json inside)")
    parser.add_argument("--slo-s", type=float, default=DEFAULT_SLO_S, help="the TTFT SLO in seconds")
    parser.add_argument("--loads", type=float, nargs="+", default=list(DEFAULT_LOADS),
                        help="offered loads, as the baseline server's utilisation")
    parser.add_argument("--within", type=float, default=DEFAULT_WITHIN,
                        help="share of requests within the SLO for the highest rate")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--pressure", nargs=4, action="append", default=[],
                        metavar=("NAME", "EXACT", "PRESSED", "QUEUE_WAIT_S"),
                        help="model exact_unless_pressed with a queue_wait_s threshold from two servers of the "
                             "report (module docstring); repeatable")
    args = parser.parse_args(argv)
    try:
        pressure = [(name, exact, pressed, float(wait)) for name, exact, pressed, wait in args.pressure]
    except ValueError:
        parser.error(f"--pressure: QUEUE_WAIT_S must be a number of seconds, got {args.pressure}")
    if any(not (w >= 0) for *_, w in pressure):
        parser.error("--pressure: QUEUE_WAIT_S must be >= 0")
    for directory in args.reports:
        services, baseline = report_services(directory)
        try:
            table = goodput_table(services, baseline, slo_s=args.slo_s, loads=args.loads, within=args.within,
                                  seed=args.seed, pressure=pressure)
        except ValueError as err:
            parser.error(f"{directory}: {err}")
        table["command"] = "python -m eval.replay.goodput " + " ".join(
            [str(directory), "--slo-s", f"{args.slo_s:g}", "--loads", *(f"{x:g}" for x in args.loads),
             "--within", f"{args.within:g}", "--seed", str(args.seed),
             *(f"--pressure {n} {e} {p} {w:g}" for n, e, p, w in pressure)])
        (directory / "goodput.json").write_text(json.dumps(table, indent=1) + "\n")
        print(f"{directory}: SLO {args.slo_s:g} s, loads {args.loads} of {baseline}'s capacity")
        for name, row in table["servers"].items():
            cells = " ".join(f"{r['goodput_per_s']:.2f}/s ({x:.2f}x)" if x is not None else f"{r['goodput_per_s']:.2f}/s"
                             for r, x in zip(row["at_load"], row["goodput_x_baseline"]))
            top = row["max_rate_within_slo_per_s"]
            print(f"  {name:10s} goodput {cells}; max rate within SLO "
                  + ("unbounded (too few requests)" if top is None else f"{top:.2f}/s")
                  + (f" ({row['max_rate_x_baseline']:.2f}x)" if row["max_rate_x_baseline"] else ""))


if __name__ == "__main__":
    main()
