"""Segmented LRU as SGLang's ``SLRUStrategy``: entries hit at least
``protected_threshold`` times are protected; probationary ones go first, LRU inside."""

from __future__ import annotations

from dataclasses import dataclass

from .base import NEVER, EntryInfo, Key, Priority, PriorityPolicy, RequestInfo, register


@dataclass(frozen=True)
class SLRUConfig:
    protected_threshold: int = 2  # SGLang's default


@register
class SLRUPolicy(PriorityPolicy):
    name = "slru"

    def __init__(self, config: SLRUConfig = SLRUConfig()) -> None:
        super().__init__()
        self.config = config
        self._hits: dict[Key, int] = {}
        self._last_access: dict[Key, float] = {}

    def priority(self, key: Key) -> Priority:
        protected = self._hits[key] >= self.config.protected_threshold
        return (int(protected), self._last_access[key])

    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._hits[key] = 0
        self._last_access[key] = request.time

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._hits[key] += 1
        self._last_access[key] = request.time
        self._refresh(key)

    def _forget(self, key: Key) -> None:
        del self._hits[key], self._last_access[key]
