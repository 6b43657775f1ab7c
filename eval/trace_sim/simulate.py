"""Replay a trace through the prefix cache for one policy and capacity."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from tqdm import tqdm

from sglang_ext.eviction import EvictionPolicy, RequestInfo

from .ablations import make_sim_policy
from .cache import PrefixCache
from .cost_model import PrefillCostModel
from .trace import NO_BLOCK, Trace
from .tree import NodeTree, RequestPaths, build_node_tree, build_request_paths, next_uses


@dataclass
class PreparedTrace:
    """A trace with its node tree and request paths, built once for many runs."""

    trace: Trace

    @cached_property
    def tree(self) -> NodeTree:
        return build_node_tree(self.trace)

    @cached_property
    def paths(self) -> RequestPaths:
        return build_request_paths(self.trace, self.tree)

    @cached_property
    def next_use(self) -> np.ndarray:
        return next_uses(self.paths, self.tree.length.shape[0])

    @cached_property
    def request_infos(self) -> list[RequestInfo]:
        return [RequestInfo(index=i, time=r.time, prompt_tokens=r.prompt_tokens,
                            session=None if r.session == NO_BLOCK else r.session)
                for i, r in enumerate(self.trace.requests)]

    @property
    def distinct_blocks(self) -> int:
        return self.trace.n_blocks

    def infinite_cache_hit_ratio(self) -> float:
        seen = np.zeros(self.trace.n_blocks, dtype=bool)
        hits = total = 0
        for r in self.trace.requests:
            if r.last_block == NO_BLOCK:
                continue
            chain = _chain(self.trace.parent, r.last_block)
            hits += int(seen[chain].sum())
            total += len(chain)
            seen[chain] = True
            if r.output_last_block != NO_BLOCK:
                seen[_chain(self.trace.parent, r.output_last_block)] = True
        return hits / max(total, 1)


def _chain(parent: np.ndarray, block: int) -> list[int]:
    out = []
    while block != NO_BLOCK:
        out.append(block)
        block = int(parent[block])
    return out


def replay(prepared: PreparedTrace, policy: EvictionPolicy, capacity_blocks: int,
           cost: PrefillCostModel, progress: str | None = None, start: int = 0,
           stop: int | None = None, cache: PrefixCache | None = None) -> PrefixCache:
    """Serve requests ``start:stop`` in order; returns the cache (its ``stats`` hold the
    metrics). Pass ``cache`` to continue a previous replay."""
    trace, paths = prepared.trace, prepared.paths
    if cache is None:
        cache = PrefixCache(prepared.tree, capacity_blocks, policy, trace.block_tokens, cost)
    future = prepared.next_use if policy.needs_future else None
    infos, offsets, n_prompt = prepared.request_infos, paths.offsets, paths.n_prompt_nodes
    flat = paths.nodes
    stop = len(trace.requests) if stop is None else stop
    for i in tqdm(range(start, stop), desc=progress, disable=progress is None,
                  mininterval=2.0, leave=False, unit="req"):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        nxt = future[lo:hi].tolist() if future is not None else None
        cache.serve(infos[i], flat[lo:hi].tolist(), int(n_prompt[i]), nxt)
    return cache


def run_policy(prepared: PreparedTrace, policy_name: str, capacity_fraction: float,
               cost: PrefillCostModel, progress: bool = False) -> dict:
    capacity = max(1, int(round(capacity_fraction * prepared.distinct_blocks)))
    policy = make_sim_policy(policy_name)
    label = f"{prepared.trace.name} {policy_name} @{capacity_fraction:g}" if progress else None
    cache = replay(prepared, policy, capacity, cost, progress=label)
    return {"policy": policy_name, "capacity_fraction": capacity_fraction,
            "capacity_blocks": capacity, **cache.stats.summary()}


def prepare(trace: Trace) -> PreparedTrace:
    return PreparedTrace(trace)
