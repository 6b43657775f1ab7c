"""Tiny hand-made traces and a checked replay driver (used by the tests; handy for
experimenting with a policy on a few requests)."""

from __future__ import annotations

import random

from .cost_model import PrefillCostModel
from .simulate import prepare, replay
from .trace import BlockTable, Request

UNIT_COST = PrefillCostModel(a=1.0, b=0.0, c=0.0, source="test")
TYPES = ("system", "user", "tool_output", "response")


def trace_from_paths(paths, times=None, sessions=None, block_tokens=1):
    """Each path is a list of block labels; labels are prefix-chained by position."""
    table, requests = BlockTable(), []
    for i, path in enumerate(paths):
        keys = [tuple(path[: j + 1]) for j in range(len(path))]
        types = [TYPES[len(k) % len(TYPES)] for k in keys]  # depth-dependent, deterministic
        last = table.intern_path(keys, types)
        requests.append(Request(time=float(times[i] if times else i), last_block=last,
                                prompt_tokens=len(path) * block_tokens,
                                session=sessions[i] if sessions else -1))
    return table.freeze("hand", block_tokens, requests)


def random_paths(seed: int, n_requests: int, alphabet: int = 3, max_len: int = 4):
    rng = random.Random(seed)
    return [[rng.randrange(alphabet) for _ in range(rng.randint(1, max_len))]
            for _ in range(n_requests)]


def run(trace, policy, capacity, check=False):
    prepared = prepare(trace)
    if not check:
        return replay(prepared, policy, capacity, UNIT_COST)
    cache = None
    for i in range(len(trace.requests)):
        cache = replay(prepared, policy, capacity, UNIT_COST, start=i, stop=i + 1, cache=cache)
        cache.check_invariants()
    return cache
