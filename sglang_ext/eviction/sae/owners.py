"""Owners and their queues, and the session clock.

Cached entries belong to *owners*: the session whose private context they are
(``session`` queue), the single request of unknown session that brought them
(``single``), or, once a second session / request reads them, the entry itself
(``shared``). ``OwnerQueues`` keeps the entries, the owners, and per ``RankClass`` two
heaps of owners by the age of their head (oldest evictable entry): oldest first and
youngest first. ``Sessions`` keeps the sessions waiting for their next request, learns
their gaps and declares the silent ones ended.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import NamedTuple

from ..base import EntryInfo, Key, LazyMinHeap, RequestInfo
from .config import SAEAblation
from .keys import PACE_STEP, RankClass, ReuseClass, State
from .learning import Learner

OwnerKey = Hashable  # ("session", id) | ("request", index) | ("entry", key)


class Entry:
    """SAE's record of one cached entry."""

    __slots__ = ("token_type", "start", "n_blocks", "t_last", "owner", "cost_bucket",
                 "requester")

    def __init__(self, info: EntryInfo, owner: OwnerKey, requester: Hashable, now: float,
                 bucket: int) -> None:
        self.token_type, self.start, self.n_blocks = info.token_type, info.start_token, info.n_blocks
        self.t_last, self.owner, self.requester, self.cost_bucket = now, owner, requester, bucket


class Owner:
    """A session (or request, or shared entry) and its evictable entries."""

    __slots__ = ("key", "queue", "state", "t_request", "request", "entries", "rank", "open",
                 "n_entries", "log_pace", "pace", "out_blocks", "ended", "retired")

    def __init__(self, key: OwnerKey, queue: str, state: State, now: float, request: int) -> None:
        self.key, self.queue, self.state = key, queue, state
        self.t_request, self.request = now, request
        self.entries = LazyMinHeap()  # evictable entries by (t_last, -start): oldest, then deepest
        self.rank: RankClass | None = None  # the rank class it is queued under; None: not queued
        self.open = False  # waiting for its next request (session outcome bookkeeping)
        self.n_entries = 0  # cached entries it owns (evictable or not)
        self.log_pace, self.pace = 0.0, 0  # running log(own gap / class median), its bucket
        self.out_blocks = 0  # output blocks cached by its current request
        self.ended = False  # declared ended (silent past its class's quantile), not back yet
        self.retired = False  # a session the server stopped tracking: dropped with its last entry

    @property
    def disposable(self) -> bool:
        """Dropped once it owns no entry: every owner but a session still tracked (a session
        waits for its next request with its statistics)."""
        return self.queue != "session" or self.retired

    @property
    def klass(self) -> ReuseClass:
        return ReuseClass(self.queue, self.state)


class Head(NamedTuple):
    """An owner at the front of a rank-class heap: the last access of its head entry."""

    t_head: float
    owner: OwnerKey


def requester_of(request: RequestInfo) -> Hashable:
    """Known sessions are ints; unknown ones become per-request tokens."""
    return request.session if request.session is not None else ("request", request.index)


class OwnerQueues:
    """Entries, owners and the per-rank-class heaps of owners."""

    def __init__(self) -> None:
        self.entries: dict[Key, Entry] = {}
        self.owners: dict[OwnerKey, Owner] = {}
        self._oldest: dict[RankClass, LazyMinHeap] = {}  # per rank class: owners by head age, oldest first
        self._youngest: dict[RankClass, LazyMinHeap] = {}  # per rank class: youngest first

    def owner_for(self, request: RequestInfo) -> Owner:
        """The session / single-request owner of what ``request`` brings. Mutates: owners (insert)."""
        if request.session is not None:
            key, queue = ("session", request.session), "session"
        else:
            key, queue = ("request", request.index), "single"
        owner = self.owners.get(key)
        if owner is None:
            owner = self.owners[key] = Owner(key, queue, "unknown", request.time, -1)
        return owner

    def owner_of(self, key: Key) -> Owner:
        return self.owners[self.entries[key].owner]

    def make_shared(self, key: Key, entry: Entry, evictable: bool) -> Owner:
        """A second requester read ``key``: it becomes its own ``shared`` owner. Returns
        it. Mutates: both owners, ``entry.owner``, the heaps, owners (insert / drop)."""
        old = self.owners[entry.owner]
        old.entries.discard(key)
        old.n_entries -= 1
        self.requeue(old)
        if old.n_entries == 0 and old.disposable:
            self.drop(old)
        owner = self.owners[("entry", key)] = Owner(("entry", key), "shared", entry.token_type,
                                                    entry.t_last, -1)
        entry.owner = owner.key
        owner.n_entries = 1
        if evictable:
            owner.entries.set(key, (entry.t_last, -entry.start))
        return owner

    def drop(self, owner: Owner) -> None:
        """Forget an owner without entries. Mutates: heaps, owners."""
        if owner.rank is not None:
            self._oldest[owner.rank].discard(owner.key)
            self._youngest[owner.rank].discard(owner.key)
        self.owners.pop(owner.key, None)

    def place(self, key: Key, entry: Entry) -> None:
        """``key`` is evictable at its current access time. Mutates: its owner, heaps."""
        owner = self.owners[entry.owner]
        owner.entries.set(key, (entry.t_last, -entry.start))
        self.requeue(owner)

    def unplace(self, key: Key, owner: Owner) -> None:
        """``key`` is no longer evictable. Mutates: the owner, heaps."""
        owner.entries.discard(key)
        self.requeue(owner)

    def requeue(self, owner: Owner) -> None:
        """File ``owner`` under the rank class of its head entry (or nowhere when it has
        no evictable entry). Mutates: ``owner.rank``, heaps."""
        head = owner.entries.peek_entry()
        if head is None:
            rank = None
        else:
            (t_head, _), _, head_key = head
            rank = RankClass(owner.klass, self.entries[head_key].cost_bucket, owner.pace)
        if owner.rank is not None and owner.rank != rank:
            self._oldest[owner.rank].discard(owner.key)
            self._youngest[owner.rank].discard(owner.key)
        owner.rank = rank
        if rank is None:
            return
        oldest = self._oldest.get(rank)
        if oldest is None:
            oldest = self._oldest[rank] = LazyMinHeap()
            self._youngest[rank] = LazyMinHeap()
        oldest.set(owner.key, t_head)
        self._youngest[rank].set(owner.key, -t_head)

    def heads(self) -> Iterator[tuple[RankClass, Head, Head]]:
        """Per non-empty rank class (in creation order): its oldest and its youngest owner.
        Mutates nothing visible (drops stale heap records)."""
        for rank, oldest in self._oldest.items():
            head = oldest.peek_entry()
            if head is None:
                continue
            young = self._youngest[rank].peek_entry()  # heap entries: (priority, seq, key)
            assert young is not None, "a rank with an oldest entry has a youngest one"
            yield rank, Head(head[0], head[2]), Head(-young[0], young[2])


class Sessions:
    """Sessions waiting for their next request, per reuse class in the order they last
    asked; a session's gap between requests is an exact, uncensored sample."""

    def __init__(self, learner: Learner, ablation: SAEAblation) -> None:
        self.learner, self.ablation = learner, ablation
        self._open: dict[ReuseClass, OrderedDict[OwnerKey, Owner]] = {}

    def open(self, owner: Owner) -> None:
        """A session owner now waits for its next request. Mutates: ``owner.open``, the waiting lists."""
        if owner.queue != "session" or owner.open:
            return
        owner.open = True
        self._open.setdefault(owner.klass, OrderedDict())[owner.key] = owner

    def close(self, owner: Owner) -> None:
        """Stop waiting (its state changes, or it returned). Mutates: ``owner.open``, the waiting lists."""
        if owner.open:
            owner.open = False
            self._open[owner.klass].pop(owner.key, None)

    def returned(self, owner: Owner, now: float) -> None:
        """A session's next request arrived at ``now``: learn the gap (also for a
        session declared ended, unless ``late_returns`` is off), then expire the silent
        ones. Mutates: the owner (open, ended, pace), the class fits, the waiting lists."""
        learner, ablation = self.learner, self.ablation
        klass = owner.klass
        late = owner.ended and ablation.late_returns
        owner.ended = False
        if owner.open or late:
            self.close(owner)
            if learner.config.learning:
                learner.version += 1
                gap = max(now - owner.t_request, 1e-3)
                rate = ablation.session_rate
                if rate > 0:
                    mu = learner.reuse_model(klass).mu
                    owner.log_pace += rate * (math.log(gap) - mu - owner.log_pace)
                    owner.pace = max(-3, min(3, round(owner.log_pace / PACE_STEP)))
                if late:
                    learner.revoke_ended(klass)
                learner.observe_gap(klass, gap, True)
        self.expire(now)

    def expire(self, now: float) -> None:
        """Sessions silent beyond their class's high quantile count as ended (rho -> 0).
        Mutates: those owners (open, ended), the waiting lists, the class fits."""
        learner = self.learner
        z = learner.config.silence_quantile_z
        for klass, waiting in self._open.items():
            limit = learner.reuse_model(klass).quantile(z)
            while waiting:
                owner = next(iter(waiting.values()))
                if now - owner.t_request <= limit:
                    break
                waiting.popitem(last=False)
                owner.open = False
                owner.ended = True
                if learner.config.learning:
                    learner.version += 1
                    learner.observe_gap(klass, None, False)
