"""Belady's MIN: evict the entry whose next use lies farthest in the future.

Offline: the caller passes ``next_use`` (e.g. index of the next request that reads the
entry, ``NEVER`` if none) with every admit/touch. Among entries with equal next use,
the deeper one (larger ``start_token``) goes first, then FIFO.
"""

from __future__ import annotations

from .base import NEVER, EntryInfo, Key, Priority, PriorityPolicy, RequestInfo, register


@register
class BeladyPolicy(PriorityPolicy):
    name = "belady"
    needs_future = True

    def __init__(self) -> None:
        super().__init__()
        self._next_use: dict[Key, float] = {}
        self._start: dict[Key, int] = {}

    def priority(self, key: Key) -> Priority:
        return (-self._next_use[key], -self._start[key])

    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._next_use[key] = next_use
        self._start[key] = info.start_token

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._next_use[key] = next_use
        self._refresh(key)

    def _forget(self, key: Key) -> None:
        del self._next_use[key], self._start[key]
