"""LRU, SGLang's default (``LRUStrategy``: priority = last access time)."""

from __future__ import annotations

from .base import NEVER, EntryInfo, Key, Priority, PriorityPolicy, RequestInfo, register


@register
class LRUPolicy(PriorityPolicy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._last_access: dict[Key, float] = {}

    def priority(self, key: Key) -> Priority:
        return self._last_access[key]

    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._last_access[key] = request.time

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._last_access[key] = request.time
        self._refresh(key)

    def _forget(self, key: Key) -> None:
        del self._last_access[key]
