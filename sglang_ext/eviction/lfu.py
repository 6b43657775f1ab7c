"""LFU as SGLang's ``LFUStrategy``: priority = (hit count, last access time)."""

from __future__ import annotations

from .base import NEVER, EntryInfo, Key, Priority, PriorityPolicy, RequestInfo, register


@register
class LFUPolicy(PriorityPolicy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._hits: dict[Key, int] = {}
        self._last_access: dict[Key, float] = {}

    def priority(self, key: Key) -> Priority:
        return (self._hits[key], self._last_access[key])

    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._hits[key] = 0
        self._last_access[key] = request.time

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._hits[key] += 1
        self._last_access[key] = request.time
        self._refresh(key)

    def _forget(self, key: Key) -> None:
        del self._hits[key], self._last_access[key]
