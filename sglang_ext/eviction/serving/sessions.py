"""SAE's session table: (tenant, session name) -> the int the policy knows the session by,
bounded (``max_sessions`` of the server config) and fair between tenants. Pure Python.

A session is keyed by its tenant (the namespace SGLang's radix tree gives the request:
``request.tenant_of``), so two tenants sending the same session name are two sessions and
neither reads or moves the other's statistics. Past the cap one session is evicted: the least
recently used session of the tenant that holds the most sessions (ties: the tenant whose least
recently used session is the oldest). So one tenant alone is plain LRU, and a tenant holding
no more than its fair share (``cap // tenants present``) never loses a session to another
tenant's new ones. An evicted session that comes back gets a new id: the policy forgets the
old one (``SAEPolicy.end_session``). O(log tenants) per use (a heap with lazy deletion).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict


class SessionTable:
    """At most ``cap`` sessions by (tenant, name), ids handed out in first-use order from 0.
    Mutates only itself."""

    def __init__(self, cap: int) -> None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"the session table's cap must be an integer >= 1, got {cap!r}")
        self.cap = cap
        self._tick = 0
        self._next_id = 0
        #: tenant -> session name -> (id, tick of its last use), least recently used first
        self._tenants: dict[str, OrderedDict[str, tuple[int, int]]] = {}
        self._held: set[int] = set()
        #: (-sessions held, tick of its least recently used session, tenant): one record per
        #: change of a tenant; a record that no longer matches its tenant is skipped (lazy)
        self._heap: list[tuple[int, int, str]] = []

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, session_id: int) -> bool:
        """Whether ``session_id`` is a session the table still holds."""
        return session_id in self._held

    def sessions_of(self, tenant: str) -> list[str]:
        """The names of ``tenant``'s sessions held, least recently used first."""
        return list(self._tenants.get(tenant, ()))

    def use(self, tenant: str, name: str) -> tuple[int, list[int]]:
        """A request of session ``name`` of ``tenant`` arrived: its id (a new one when the session
        is not held) and the ids of the sessions evicted to stay within the cap, in eviction
        order (never the one just used). Mutates: the table."""
        self._tick += 1
        sessions = self._tenants.setdefault(tenant, OrderedDict())
        held = sessions.pop(name, None)
        if held is None:
            session_id = self._next_id
            self._next_id += 1
            self._held.add(session_id)
        else:
            session_id = held[0]
        sessions[name] = (session_id, self._tick)
        self._record(tenant)
        evicted = []
        while len(self._held) > self.cap:
            evicted.append(self._evict_one())
        return session_id, evicted

    def _record(self, tenant: str) -> None:
        sessions = self._tenants[tenant]
        heapq.heappush(self._heap, (-len(sessions), next(iter(sessions.values()))[1], tenant))
        if len(self._heap) > 2 * len(self._tenants) + 64:   # drop the stale records
            self._heap = [(-len(s), next(iter(s.values()))[1], t) for t, s in self._tenants.items()]
            heapq.heapify(self._heap)

    def _evict_one(self) -> int:
        while True:
            count, tick, tenant = heapq.heappop(self._heap)
            sessions = self._tenants.get(tenant)
            if sessions and len(sessions) == -count and next(iter(sessions.values()))[1] == tick:
                break
        _, (session_id, _) = sessions.popitem(last=False)
        self._held.discard(session_id)
        if sessions:
            self._record(tenant)
        else:
            del self._tenants[tenant]
        return session_id
