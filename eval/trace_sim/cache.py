"""Block-level prefix cache with radix semantics, driven by a pluggable policy.

* A block is reusable only if its whole prefix is cached: the cached set is closed
  under prefixes, so a request hits exactly the cached blocks on its path.
* Only leaves are evictable (a node with a cached child is not), and a node is trimmed
  from its tail, one block at a time, so trimming keeps the set prefix-closed.
* Nodes on the running request's path are locked (never evicted) until it finishes.
* Requests run one at a time: match, lock, insert the missing prompt blocks (and the
  cached output blocks), evicting the policy's victims when full, then unlock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from sglang_ext.eviction import NEVER, EntryInfo, EvictionPolicy, RequestInfo

from .cost_model import PrefillCostModel
from .tree import NodeTree


@dataclass
class RunStats:
    """Counters of one replay; ``summary`` turns them into the reported metrics."""

    requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    decisions: int = 0
    decision_ns: int = 0
    evicted_blocks: int = 0

    def summary(self) -> dict:
        ttft = np.asarray(self.ttft_s) if self.ttft_s else np.zeros(1)
        return {
            "requests": self.requests,
            "block_hit_ratio": self.hit_blocks / max(self.prompt_blocks, 1),
            "token_hit_ratio": self.hit_tokens / max(self.prompt_tokens, 1),
            "prefill_tokens": self.prompt_tokens - self.hit_tokens,
            "mean_ttft_s": float(ttft.mean()),
            "p90_ttft_s": float(np.percentile(ttft, 90)),
            "decisions": self.decisions,
            "us_per_decision": self.decision_ns / max(self.decisions, 1) / 1e3,
            "evicted_blocks": self.evicted_blocks,
        }


class PrefixCache:
    def __init__(self, tree: NodeTree, capacity_blocks: int, policy: EvictionPolicy,
                 block_tokens: int, cost: PrefillCostModel) -> None:
        self.tree, self.capacity, self.policy = tree, int(capacity_blocks), policy
        self.block_tokens, self.cost = block_tokens, cost
        n = tree.length.shape[0]
        self.cached = [0] * n  # cached blocks per node (a prefix of the node)
        self.cached_children = [0] * n
        self.locks = [0] * n
        self.evictable = [False] * n
        self.used = 0
        self._parent = tree.parent.tolist()
        self._length = tree.length.tolist()
        self._start = tree.start_block.tolist()
        self.stats = RunStats()

    # ----- one request ----------------------------------------------------------
    def serve(self, request: RequestInfo, path: list[int], n_prompt_nodes: int,
              next_use: list[float] | None = None) -> int:
        """Replay one request; returns the number of prompt blocks that hit."""
        hit_blocks = self._match(path[:n_prompt_nodes])
        locked = []
        for pos, node in enumerate(path):
            future = next_use[pos] if next_use is not None else NEVER
            if not self._hold(node, request, future, locked):
                break
        for node in locked:
            self._release(node)
        self._account(request, hit_blocks, n_prompt_nodes, path)
        return hit_blocks

    def _match(self, prompt_path: list[int]) -> int:
        hits = 0
        for node in prompt_path:
            hits += self.cached[node]
            if self.cached[node] < self._length[node]:
                break
        return hits

    def _hold(self, node: int, request: RequestInfo, future: float, locked: list) -> bool:
        """Touch/insert ``node`` and lock it; False when the path cannot continue."""
        was_cached = self.cached[node] > 0
        if was_cached:
            self.policy.touch(node, self.info(node), request, future)
        self._lock(node, locked)
        if self.cached[node] < self._length[node]:
            if not self._grow(node, request, future, was_cached):
                return False
        return True

    def _lock(self, node: int, locked: list) -> None:
        if self.locks[node] == 0 and self.evictable[node]:
            self._set_evictable(node, False)
        self.locks[node] += 1
        locked.append(node)

    def _release(self, node: int) -> None:
        self.locks[node] -= 1
        self._update_evictable(node)

    def _grow(self, node: int, request: RequestInfo, future: float, was_cached: bool) -> bool:
        need = self._length[node] - self.cached[node]
        self._make_room(need, request.time)
        grant = min(need, self.capacity - self.used)
        if grant <= 0:
            return False
        self.cached[node] += grant
        self.used += grant
        if not was_cached:
            self._attach(node, request, future)
        else:
            self.policy.resize(node, self.info(node))
        return grant == need

    def _attach(self, node: int, request: RequestInfo, future: float) -> None:
        parent = self._parent[node]
        if parent >= 0:
            self.cached_children[parent] += 1
            self._update_evictable(parent)
        self.policy.admit(node, self.info(node), request, future)

    # ----- eviction -------------------------------------------------------------
    def _make_room(self, need: int, now: float) -> None:
        while self.capacity - self.used < need:
            start = time.perf_counter_ns()
            node = self.policy.victim(now)
            self.stats.decision_ns += time.perf_counter_ns() - start
            self.stats.decisions += 1
            if node is None:
                return
            self._trim(node, need - (self.capacity - self.used), now)

    def _trim(self, node: int, blocks: int, now: float) -> None:
        if not self.evictable[node]:
            raise AssertionError(f"policy chose non-evictable node {node}")
        take = min(blocks, self.cached[node])
        self.cached[node] -= take
        self.used -= take
        self.stats.evicted_blocks += take
        if self.cached[node] > 0:
            self.policy.evicted(node, self.info(node), now)
            return
        self._set_evictable(node, False)
        self.policy.evicted(node, None, now)
        parent = self._parent[node]
        if parent >= 0:
            self.cached_children[parent] -= 1
            self._update_evictable(parent)

    def _update_evictable(self, node: int) -> None:
        should = self.cached[node] > 0 and self.locks[node] == 0 and self.cached_children[node] == 0
        if should != self.evictable[node]:
            self._set_evictable(node, should)

    def _set_evictable(self, node: int, evictable: bool) -> None:
        self.evictable[node] = evictable
        self.policy.set_evictable(node, evictable)

    # ----- bookkeeping ----------------------------------------------------------
    def info(self, node: int) -> EntryInfo:
        blocks = self.cached[node]
        start = self._start[node] * self.block_tokens
        tokens = blocks * self.block_tokens
        return EntryInfo(n_blocks=blocks, n_tokens=tokens, start_token=start,
                         token_type=self.tree.token_type[node],
                         compute_cost=self.cost.segment_cost(start, tokens))

    def _account(self, request: RequestInfo, hit_blocks: int, n_prompt_nodes: int, path) -> None:
        stats = self.stats
        prompt_blocks = (self._start[path[n_prompt_nodes - 1]] + self._length[path[n_prompt_nodes - 1]]
                         if n_prompt_nodes else 0)
        hit_tokens = min(hit_blocks * self.block_tokens, request.prompt_tokens)
        stats.requests += 1
        stats.prompt_blocks += prompt_blocks
        stats.hit_blocks += hit_blocks
        stats.prompt_tokens += request.prompt_tokens
        stats.hit_tokens += hit_tokens
        stats.ttft_s.append(self.cost.ttft(request.prompt_tokens - hit_tokens, hit_tokens))

    def check_invariants(self) -> None:
        """Prefix closure, leaf-only evictability, size accounting (used by tests)."""
        assert self.used == sum(self.cached) <= self.capacity
        for node, blocks in enumerate(self.cached):
            parent = self._parent[node]
            if blocks and parent >= 0:
                assert self.cached[parent] == self._length[parent], "prefix closure broken"
            leaf = blocks > 0 and self.cached_children[node] == 0 and self.locks[node] == 0
            assert self.evictable[node] == leaf
