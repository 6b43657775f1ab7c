"""The interface every eviction policy implements, plus shared helpers.

A policy only *decides which entry goes* (cachetools spirit). The cache owns storage,
the radix tree, reference counts and sizes; it reports events to the policy and asks
``victim()`` when it needs room. An *entry* is whatever the cache evicts as a unit
(a radix-tree node, i.e. a run of blocks whose tail is trimmed first); keys are opaque
hashables. Pure Python: no SGLang, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable, KeysView
from dataclasses import dataclass
from typing import Any, ClassVar

Key = Hashable
NEVER = float("inf")
#: a policy's sort key for an entry (numbers or tuples of them; smallest is evicted first)
Priority = Any

TOKEN_TYPES = ("system", "user", "tool_output", "response", "reasoning", "tool_call",
               "unknown")


@dataclass(frozen=True)
class EntryInfo:
    """What the cache knows about a cached entry right now."""

    n_blocks: int
    n_tokens: int
    start_token: int  # tokens that precede the entry (its cached prefix length)
    token_type: str = "unknown"
    compute_cost: float = 0.0  # modeled seconds to recompute the entry's tokens


@dataclass(frozen=True)
class RequestInfo:
    """The request that causes an event. ``session`` is None when unknown."""

    index: int
    time: float
    prompt_tokens: int = 0
    session: int | None = None


class EvictionPolicy(ABC):
    """Decides which evictable entry the cache removes next.

    Mutation rules (shared by all implementations):
    * every method may mutate only the policy's own bookkeeping, never the cache;
    * ``victim`` must not change which entries are cached or evictable; it may only
      drop stale internal records (lazy deletion) and update learned state that does
      not depend on the answer being acted upon.
    """

    name: ClassVar[str] = ""
    needs_future: ClassVar[bool] = False  # True: caller passes ``next_use`` (offline)

    @abstractmethod
    def admit(self, key: Key, info: EntryInfo, request: RequestInfo,
              next_use: float = NEVER) -> None:
        """``key`` became cached (not evictable until ``set_evictable``). Mutates: key's record."""

    @abstractmethod
    def touch(self, key: Key, info: EntryInfo, request: RequestInfo,
              next_use: float = NEVER) -> None:
        """A request reused cached ``key``. Mutates: key's record and learned statistics."""

    @abstractmethod
    def resize(self, key: Key, info: EntryInfo) -> None:
        """Cached size of ``key`` changed (grown by a request). Mutates: key's record."""

    @abstractmethod
    def set_evictable(self, key: Key, evictable: bool) -> None:
        """``key`` became (un)evictable: a leaf that no running request holds. Mutates: candidate set."""

    @abstractmethod
    def victim(self, now: float) -> Key | None:
        """The evictable entry to trim next, or None if nothing is evictable."""

    @abstractmethod
    def evicted(self, key: Key, remaining: EntryInfo | None, now: float) -> None:
        """The cache trimmed ``key`` (``remaining`` None: fully removed). Mutates: key's
        record, candidate set, feedback state (ghosts)."""


class LazyMinHeap:
    """Min-priority queue with O(log n) update and lazy deletion; FIFO among ties."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._live: dict[Key, tuple] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Key) -> bool:
        return key in self._live

    def set(self, key: Key, priority: Priority) -> None:
        entry = (priority, next(self._order), key)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._live) + 64:
            self._compact()

    def discard(self, key: Key) -> None:
        self._live.pop(key, None)

    def peek(self) -> Key | None:
        entry = self.peek_entry()
        return None if entry is None else entry[2]

    def peek_entry(self) -> tuple[Any, ...] | None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def pop(self) -> Key | None:
        entry = self.peek_entry()
        if entry is None:
            return None
        heapq.heappop(self._heap)
        del self._live[entry[2]]
        return entry[2]

    def keys(self) -> KeysView[Key]:
        return self._live.keys()

    def _compact(self) -> None:
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)


class PriorityPolicy(EvictionPolicy):
    """Evicts the evictable entry with the smallest ``priority(key)``.

    Subclasses keep per-key records and call ``_refresh(key)`` when a priority changes.
    """

    def __init__(self) -> None:
        self._queue = LazyMinHeap()
        self._evictable: dict[Key, None] = {}  # dict: deterministic iteration

    @abstractmethod
    def priority(self, key: Key) -> Priority:
        """Sort key of an entry; smallest goes first. Must not mutate anything."""

    def _forget(self, key: Key) -> None:
        """Drop the per-key record of a fully evicted entry."""

    def _refresh(self, key: Key) -> None:
        if key in self._evictable:
            self._queue.set(key, self.priority(key))

    def set_evictable(self, key: Key, evictable: bool) -> None:
        if evictable:
            self._evictable[key] = None
            self._queue.set(key, self.priority(key))
        else:
            self._evictable.pop(key, None)
            self._queue.discard(key)

    def victim(self, now: float) -> Key | None:
        return self._queue.peek()

    def resize(self, key: Key, info: EntryInfo) -> None:
        return None

    def evicted(self, key: Key, remaining: EntryInfo | None, now: float) -> None:
        if remaining is None:
            self._evictable.pop(key, None)
            self._queue.discard(key)
            self._forget(key)


POLICY_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make a policy selectable by its ``name`` (e.g. from a CLI)."""
    if not cls.name or cls.name in POLICY_REGISTRY:
        raise ValueError(f"policy name {cls.name!r} missing or taken")
    POLICY_REGISTRY[cls.name] = cls
    return cls
