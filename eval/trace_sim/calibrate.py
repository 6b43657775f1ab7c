"""Measure prefill TTFT of a running SGLang server and fit the cost model.

    python -m eval.trace_sim.calibrate --url http://127.0.0.1:PORT --out cost_model.json

For every (cached prefix, new tokens) point of the grid: flush the cache, send the
prefix alone (it gets cached), then time ``prefix + new`` with ``max_new_tokens=1``
through ``/generate`` (``input_ids``, greedy). ``meta_info['cached_tokens']`` gives the
prefix length the server really reused. Token ids are drawn from a seeded generator
so that different points never share a prefix by accident.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cost_model import fit_cost_model, save_cost_model

SAMPLING = {"max_new_tokens": 1, "temperature": 0}


@dataclass(frozen=True)
class Point:
    new_tokens: int
    cached_tokens: int
    ttft_s: float


def _post(url: str, payload: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def generate(base_url: str, input_ids: list[int], clock=time.perf_counter) -> tuple[float, dict]:
    """One greedy 1-token request; returns (seconds by ``clock``, meta_info)."""
    started = clock()
    reply = _post(f"{base_url}/generate", {"input_ids": input_ids, "sampling_params": SAMPLING})
    return clock() - started, reply.get("meta_info", {})


def flush(base_url: str) -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(f"{base_url}/flush_cache", method="POST"),
                               timeout=60).read()
    except OSError:
        pass  # older servers: fresh random ids already avoid reuse between points


def measure_point(base_url: str, rng, prefix: int, new: int, vocab: int, repeats: int,
                  clock=time.perf_counter) -> Point:
    samples, cached = [], []
    for _ in range(repeats):
        flush(base_url)
        ids = rng.integers(10, vocab, size=prefix + new).tolist()
        if prefix:
            generate(base_url, ids[:prefix])
        seconds, meta = generate(base_url, ids, clock)
        samples.append(seconds)
        cached.append(int(meta.get("cached_tokens", prefix)))
    return Point(new_tokens=new + prefix - int(statistics.median(cached)),
                 cached_tokens=int(statistics.median(cached)), ttft_s=statistics.median(samples))


def calibrate(base_url: str, prefixes, news, vocab: int, repeats: int, seed: int = 0,
              clock=time.perf_counter) -> list[Point]:
    rng = np.random.default_rng(seed)
    generate(base_url, rng.integers(10, vocab, size=16).tolist())  # warm-up
    return [measure_point(base_url, rng, p, n, vocab, repeats, clock)
            for p in prefixes for n in news]


def main(argv=None, clock=time.perf_counter) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.trace_sim.calibrate")
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefixes", default="0,1024,4096,16384")
    parser.add_argument("--news", default="64,256,1024,4096")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    points = calibrate(args.url.rstrip("/"), ints(args.prefixes), ints(args.news), args.vocab,
                       args.repeats, clock=clock)
    model = fit_cost_model([p.new_tokens for p in points], [p.cached_tokens for p in points],
                           [p.ttft_s for p in points], source=f"measured via {args.url}/generate")
    raw = [p.__dict__ for p in points]
    save_cost_model(model, args.out, {"points": raw, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(f"a={model.a:.4g} s  b={model.b:.4g} s/token  c={model.c:.4g} s/token^2  -> {args.out}")


if __name__ == "__main__":
    main()
