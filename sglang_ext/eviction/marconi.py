"""Marconi-style eviction (Pan et al., "Marconi: Prefix Caching for the Era of Hybrid
LLMs", MLSys 2025): utility = recency + alpha * FLOP efficiency, both normalised over the
current candidates; the lowest utility goes first.

FLOP efficiency is compute saved per byte kept: ``compute_cost / n_tokens`` (KV bytes
grow with tokens). Normalisation constants are refreshed every ``refresh_every``
decisions (and the candidate heap rebuilt) so that each decision stays O(log n).
Marconi tunes alpha by a bootstrapped search; here it is a fixed config value.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import NEVER, EntryInfo, Key, Priority, PriorityPolicy, RequestInfo, register


@dataclass(frozen=True)
class MarconiConfig:
    alpha: float = 1.0
    refresh_every: int = 256


@register
class MarconiPolicy(PriorityPolicy):
    name = "marconi"

    def __init__(self, config: MarconiConfig = MarconiConfig()) -> None:
        super().__init__()
        self.config = config
        self._last_access: dict[Key, float] = {}
        self._efficiency: dict[Key, float] = {}
        self._time_origin, self._time_span, self._efficiency_max = 0.0, 1.0, 1.0
        self._decisions = 0

    def priority(self, key: Key) -> Priority:
        recency = (self._last_access[key] - self._time_origin) / self._time_span
        return recency + self.config.alpha * self._efficiency[key] / self._efficiency_max

    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._last_access[key] = request.time
        self._efficiency[key] = _efficiency(info)

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._last_access[key] = request.time
        self._efficiency[key] = _efficiency(info)
        self._refresh(key)

    def resize(self, key: Key, info: EntryInfo) -> None:
        self._efficiency[key] = _efficiency(info)
        self._refresh(key)

    def victim(self, now: float) -> Key | None:
        if self._decisions % self.config.refresh_every == 0:
            self._renormalise(now)
        self._decisions += 1
        return self._queue.peek()

    def _renormalise(self, now: float) -> None:
        keys = list(self._evictable)
        if not keys:
            return
        self._time_origin = min(self._last_access[k] for k in keys)
        self._time_span = max(now - self._time_origin, 1e-9)
        self._efficiency_max = max(max(self._efficiency[k] for k in keys), 1e-12)
        for key in keys:
            self._queue.set(key, self.priority(key))

    def _forget(self, key: Key) -> None:
        del self._last_access[key], self._efficiency[key]


def _efficiency(info: EntryInfo) -> float:
    return info.compute_cost / max(info.n_tokens, 1)
