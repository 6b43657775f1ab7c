"""Offline references for a replay: the ideal reuse and the LRU bound (pure, no SGLang).

Both work on the scaled token sequences in replay order, at page size 1, and count a request's
reusable tokens the way SGLang does: at most `len(prompt) - 1`, because the server always
computes the last prompt token to produce the first output token.

* **ideal** (infinite prefix cache): request i reuses
  `min(len_i - 1, max_{j < i} LCP(tokens_i, tokens_j))`, LCP = longest common prefix.

* **LRU bound** at capacity C tokens: a token trie (one node per token of a distinct prefix)
  holding at most C nodes, each stamped with the index of the last request whose prompt went
  through it. For request i, in order:
    1. reuse = min(len_i - 1, length of the longest prefix of tokens_i present in the trie);
    2. insert tokens_i: every node on its path is stamped i (new nodes are created);
    3. while the trie holds more than C nodes, remove the leaf with the oldest stamp (ties: the
       node created first).
  This is an attention-only radix cache with SGLang's default LRU leaf eviction and a KV pool of
  C tokens, where any cached prefix is reusable (no recurrent state needed). It is what a hybrid
  cache whose reuse is limited only by attention KV could reach under LRU at the same KV
  capacity: stock SGLang's hybrid cache, which can reuse only up to a state checkpoint, stays
  below it. It is a reference, not a proof: it ignores the KV the running requests hold besides
  the cache and the generated tokens SGLang also caches (1 per request here), and another
  eviction order (not LRU) can beat it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReuseCurve:
    """Per-request reusable tokens under one reference, in replay order."""

    name: str
    capacity_tokens: int | None  # None: infinite
    per_request: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.per_request)


class TokenTrieLRU:
    """Token trie with LRU leaf eviction (see the module docstring); capacity None = infinite."""

    def __init__(self, capacity_tokens: int | None) -> None:
        if capacity_tokens is not None and capacity_tokens < 1:
            raise ValueError(f"capacity must be >= 1 token, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self.children: list[dict[int, int]] = [{}]   # node 0 is the root (holds no token)
        self.parent: list[int] = [-1]
        self.token: list[int] = [-1]
        self.stamp: list[int] = [-1]
        self.alive: list[bool] = [True]
        self.size = 0                                  # tokens held (root excluded)
        self._leaves: list[tuple[int, int]] = []       # (stamp, node), lazily invalidated

    def match(self, tokens: Sequence[int]) -> int:
        node, depth = 0, 0
        for token in tokens:
            node = self.children[node].get(token, -1)
            if node < 0:
                break
            depth += 1
        return depth

    def insert(self, tokens: Sequence[int], stamp: int) -> None:
        node = 0
        for token in tokens:
            child = self.children[node].get(token, -1)
            if child < 0:
                child = len(self.parent)
                self.children.append({})
                self.parent.append(node)
                self.token.append(token)
                self.stamp.append(stamp)
                self.alive.append(True)
                self.children[node][token] = child
                self.size += 1
            self.stamp[child] = stamp
            node = child
        if node and not self.children[node]:
            heapq.heappush(self._leaves, (stamp, node))
        if self.capacity is not None:
            self._evict_to(self.capacity)

    def _evict_to(self, capacity: int) -> None:
        while self.size > capacity:
            stamp, node = heapq.heappop(self._leaves)
            if not self.alive[node] or self.children[node] or self.stamp[node] != stamp:
                continue  # stale entry: removed, no longer a leaf, or touched since
            self.alive[node] = False
            self.size -= 1
            parent = self.parent[node]
            siblings = self.children[parent]
            del siblings[self.token[node]]
            if parent and not siblings:
                heapq.heappush(self._leaves, (self.stamp[parent], parent))


def reuse_curve(sequences: Sequence[Sequence[int]], capacity_tokens: int | None,
                name: str) -> ReuseCurve:
    """Reusable tokens per request (see the module docstring) for one capacity."""
    trie = TokenTrieLRU(capacity_tokens)
    hits = []
    for i, tokens in enumerate(sequences):
        hits.append(min(max(len(tokens) - 1, 0), trie.match(tokens)))
        trie.insert(tokens, i)
    return ReuseCurve(name, capacity_tokens, tuple(hits))


def ideal_curve(sequences: Sequence[Sequence[int]]) -> ReuseCurve:
    return reuse_curve(sequences, None, "ideal")


def lru_curve(sequences: Sequence[Sequence[int]], capacity_tokens: int) -> ReuseCurve:
    return reuse_curve(sequences, capacity_tokens, "lru_bound")
