"""The replay's client: each request streamed to a server (greedy, `--new-tokens` output tokens),
at most `--concurrency` in flight, arriving in the trace's order, and the warm-up and flush before
a server's replay."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from eval.replay.goodput import arrivals_at, unit_gaps
from eval.replay.metrics import router_counters
from eval.replay.router import one_decision
from eval.replay.servers import flush_cache, stream_generate
from eval.replay.tokens import ScaledRequest, block_tokens
from sglang_ext.tail_replay import META_KEY

WARMUP_BLOCK = 1 << 40  # a block id no trace reaches


def request_custom_params(req: ScaledRequest) -> dict:
    """`--typed`: the request's spans and (for traces with sessions) its session."""
    out: dict = {"token_types": [list(s) for s in req.spans]}
    if req.session is not None and req.session >= 0:
        out["session"] = int(req.session)
    return out


def replay_requests(url: str, requests: list[ScaledRequest], new_tokens: int, concurrency: int,
                    desc: str, typed: bool = False, session_ids: bool = False,
                    router_metrics: str | None = None, rate: float | None = None,
                    seed: int = 0) -> tuple[list[dict], float]:
    """Send every request (at most `concurrency` in flight); records in request order and the wall
    time from the first send to the last answer. Requests arrive in order: each is posted once the
    server accepted the one before it (its response headers came back), so which of two requests
    sent together reaches the scheduler first does not depend on the client's thread timing (a
    conversation's next turn, sent while its previous one runs, never overtakes it; without this a
    server could see the trace in a different order than the server it is compared with).
    `router_metrics`:
    the router's Prometheus URL; one request at a time, each record gets the router's decision
    for it (`router`: its predicted match ratio and branch, eval/replay/router.py).

    `rate` (requests/s): open loop instead of `concurrency`. Request i is sent at its Poisson
    arrival time (exponential gaps of mean 1 / rate, seeded: the same arrivals for every server),
    whatever is in flight, and its TTFT counts from that time (a send the client could not make
    on time, `send_lag_s`, counts against the server's TTFT, as a queue would)."""
    per_request = router_metrics is not None and concurrency == 1
    schedule = arrivals_at(unit_gaps(len(requests), seed), rate) if rate is not None else None

    accepted = [threading.Event() for _ in requests]

    def one(i: int, req: ScaledRequest) -> dict:
        if i:
            accepted[i - 1].wait()
        lag = 0.0
        if schedule is not None:
            lag = t0 + schedule[i] - time.perf_counter()
            if lag > 0:
                time.sleep(lag)
            lag = max(0.0, time.perf_counter() - (t0 + schedule[i]))
        try:
            before = router_counters(router_metrics) if per_request else None
            resp = stream_generate(url, list(req.tokens), new_tokens,
                                   custom_params=request_custom_params(req) if typed else None,
                                   session_id=f"conversation-{req.session}" if session_ids and req.session >= 0 else None,
                                   on_accepted=accepted[i].set)
        finally:
            accepted[i].set()   # refused or failed: the next one goes
        details = (resp.meta_info.get("cached_tokens_details") or {}) if resp.ok else {}
        rec = {"index": req.index, "session": req.session, "prompt_tokens": len(req.tokens),
               "ok": resp.ok, "error": resp.error,
               "cached_tokens": int(resp.meta_info.get("cached_tokens") or 0) if resp.ok else 0,
               "tail_replay": details.get(META_KEY),
               "ttft_s": None if resp.ttft_s is None else resp.ttft_s + lag,
               "latency_s": None if resp.latency_s is None else resp.latency_s + lag, "output_ids": list(resp.output_ids)}
        if schedule is not None:
            rec["send_lag_s"] = lag
        if before is not None:
            rec["router"] = one_decision(router_counters(router_metrics).since(before))
        return rec

    records: list[dict] = [None] * len(requests)  # type: ignore[list-item]
    bar = tqdm(total=len(requests), desc=desc, unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency if schedule is None else min(len(requests), 1024) or 1) as pool:
        futures = [pool.submit(one, i, req) for i, req in enumerate(requests)]
        for i, future in enumerate(futures):
            records[i] = future.result()
            bar.update(1)
    wall = time.perf_counter() - t0
    bar.close()
    return records, wall


def warm_and_flush(url: str, tokens_per_block: int, seed: int) -> None:
    """One unrelated request (first-call costs out of the timings), then an empty cache."""
    warm = block_tokens([WARMUP_BLOCK + i for i in range(max(1, 64 // tokens_per_block))], tokens_per_block, seed)
    resp = stream_generate(url, [int(t) for t in warm], 1)
    if not resp.ok:
        raise RuntimeError(f"warm-up request failed on {url}: {resp.error}")
    flush_cache(url)
