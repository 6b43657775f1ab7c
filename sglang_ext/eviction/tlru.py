"""Tail-optimised LRU as SGLang's ``TLRUStrategy`` (Zhang et al., arXiv:2510.15152).

A branch whose history reached ``L`` tokens and whose next prompt adds about
``next_prompt_estimate`` tokens must keep ``L + next_prompt_estimate - threshold``
tokens cached to hold its next prefill under the budget; entries that start past that
point are "TEL-safe" and go first (phase 1), then plain LRU (phase 2). ``L`` is the
branch's high-water depth and does not shrink when its tail is trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import NEVER, EntryInfo, Key, Priority, PriorityPolicy, RequestInfo, register


@dataclass(frozen=True)
class TLRUConfig:
    threshold: int = 2048  # tokens of prefill the TTFT budget allows
    next_prompt_estimate: int = 512  # tokens the next turn is expected to add


@register
class TLRUPolicy(PriorityPolicy):
    name = "tlru"

    def __init__(self, config: TLRUConfig = TLRUConfig()) -> None:
        super().__init__()
        self.config = config
        self._last_access: dict[Key, float] = {}
        self._history_len: dict[Key, int] = {}
        self._start: dict[Key, int] = {}

    def priority(self, key: Key) -> Priority:
        return (0 if self._tel_safe(key) else 1, self._last_access[key])

    def _tel_safe(self, key: Key) -> bool:
        budget = self._history_len[key] + self.config.next_prompt_estimate - self.config.threshold
        return self._start[key] >= max(budget, 0)

    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._start[key] = info.start_token
        self._history_len[key] = max(request.prompt_tokens, info.start_token + info.n_tokens)
        self._last_access[key] = request.time

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self._history_len[key] = max(self._history_len[key], request.prompt_tokens)
        self._last_access[key] = request.time
        self._refresh(key)

    def _forget(self, key: Key) -> None:
        del self._last_access[key], self._history_len[key], self._start[key]
