"""How much future knowledge the LRU-to-Belady gap needs: Belady with noisy arrival times.

``NoisyBeladyPolicy`` ranks entries like Belady, by the time of the next request that
reads them, but sees that time only up to a log-normal error: a next request due in
``d`` seconds looks ``d * exp(sigma * z)`` away, with one standard normal ``z`` per
request (seeded), shared by every entry that request reads. ``sigma = 0`` is Belady
by time; larger sigma means an oracle that knows less. Whether an entry is read again
at all stays exact, so it is an optimistic reference (not a proven bound) for a policy
whose arrival forecasts have that spread (see docs/saecache.md, section 5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sglang_ext.eviction import NEVER, BeladyPolicy, EntryInfo, Key, LRUPolicy, RequestInfo

from .simulate import PreparedTrace, replay


class NoisyBeladyPolicy(BeladyPolicy):
    """Not in the policy registry: it needs the trace's request times."""

    name = "belady-noisy"

    def __init__(self, request_times: Sequence[float], log_sigma: float, seed: int = 0) -> None:
        if not log_sigma >= 0 or math.isinf(log_sigma):
            raise ValueError(f"log_sigma must be a finite number >= 0, got {log_sigma!r}")
        super().__init__()
        self._times = np.asarray(request_times, dtype=float)
        self._error = np.exp(log_sigma * np.random.default_rng(seed).standard_normal(len(self._times)))

    def _seen(self, now: float, next_use: float) -> float:
        if next_use == NEVER or next_use >= len(self._times):  # the simulator's "never again"
            return NEVER
        request = int(next_use)
        return now + max(float(self._times[request]) - now, 0.0) * float(self._error[request])

    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use=NEVER) -> None:
        super().admit(key, info, request, self._seen(request.time, next_use))

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use=NEVER) -> None:
        super().touch(key, info, request, self._seen(request.time, next_use))


def run_bound(prepared: PreparedTrace, capacity_fraction: float, cost, sigmas: Sequence[float],
              seed: int = 0) -> list[dict]:
    """LRU, Belady and Belady with each arrival-time error ``sigma`` at one capacity."""
    capacity = max(1, int(round(capacity_fraction * prepared.distinct_blocks)))
    times = [r.time for r in prepared.trace.requests]
    policies = {"lru": LRUPolicy(), "belady": BeladyPolicy()}
    policies.update({f"belady-noisy(sigma={s:g})": NoisyBeladyPolicy(times, s, seed) for s in sigmas})
    rows = []
    for label, policy in policies.items():
        cache = replay(prepared, policy, capacity, cost, progress=f"{label} @{capacity_fraction:g}")
        rows.append({"policy": label, "capacity_fraction": capacity_fraction,
                     "capacity_blocks": capacity, **cache.stats.summary()})
    return rows
