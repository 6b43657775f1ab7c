"""``SAEPolicy``: the eviction events, the scorer and the choice between the model's
victim and the LRU expert's. The parts: ``owners`` (who owns what, the rank-class
heaps, the session clock), ``learning`` (the fits, H, ghosts), ``expert`` (LRU and the
duel judge), ``reuse_model`` (the math)."""

from __future__ import annotations

import math
from typing import NamedTuple

from ..base import NEVER, EntryInfo, EvictionPolicy, Key, RequestInfo, register
from .config import SAEAblation, SAEConfig
from .expert import LRUExpert
from .keys import OUTPUT_TYPES, PACE_STEP, RankClass, ReuseClass, State, output_state
from .learning import Learner, SAEState
from .owners import Entry, Owner, OwnerQueues, Sessions, requester_of
from .reuse_model import ClassStats, ReuseTimeModel, hit_density, soon


class _RankValues(NamedTuple):
    """Memoised values of a rank class's oldest and youngest head owners."""

    t_head: float
    t_young: float
    old_value: float
    young_value: float


def cost_bucket(info: EntryInfo) -> int:
    """log2 bucket of the recompute cost per block; representative cost 2**bucket."""
    if info.compute_cost <= 0 or info.n_blocks <= 0:
        return 0
    return round(math.log2(info.compute_cost / info.n_blocks))


@register
class SAEPolicy(EvictionPolicy):
    """SAECache (docs/saecache.md section 2). ``config``: user settings; ``state``: a
    learned state to warm-start from (copied); ``ablation``: design switches."""

    name = "sae"

    def __init__(self, config: SAEConfig = SAEConfig(), state: SAEState | None = None,
                 ablation: SAEAblation = SAEAblation()) -> None:
        self.config, self.ablation = config, ablation
        self.state = state.snapshot() if state is not None else SAEState(horizon_s=config.prior_reuse_s)
        self.learner = Learner(config, self.state)
        self.queues = OwnerQueues()
        self.sessions = Sessions(self.learner, ablation)
        self.expert = LRUExpert(config, ablation, self.state)
        self._values: dict[RankClass, _RankValues] = {}  # memo valid at (time, learner version)
        self._values_at: float | None = None
        self._values_version = -1
        self._horizon = self.state.horizon_s

    # ----- events ---------------------------------------------------------------
    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self.expert.referenced(key)
        owner = self.queues.owner_for(request)
        self._request_event(owner, info.token_type, request, info.n_blocks)
        self.queues.entries[key] = Entry(info, owner.key, requester_of(request), request.time,
                                         cost_bucket(info))
        owner.n_entries += 1
        self.learner.cached_blocks += info.n_blocks
        self.learner.ghost_feedback(key, request.time)

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use: float = NEVER) -> None:
        self.expert.referenced(key)
        entry = self.queues.entries[key]
        owner = self.queues.owners[entry.owner]
        evictable = key in owner.entries
        if owner.queue != "shared" and requester_of(request) != entry.requester:
            owner = self.queues.make_shared(key, entry, evictable)
        if owner.queue == "shared":
            if evictable:
                self.learner.learn_reference(owner.klass, request.time - entry.t_last)
            owner.t_request = request.time
        elif owner.queue == "single":
            if evictable:
                self.learner.learn_reference(owner.klass, request.time - entry.t_last)
        else:
            self._request_event(owner, info.token_type, request)
        entry.t_last = request.time
        if evictable:
            self._place(key, entry)

    def resize(self, key: Key, info: EntryInfo) -> None:
        entry = self.queues.entries[key]
        if info.n_blocks > entry.n_blocks:
            self.learner.ghost_feedback(key, entry.t_last)
        self.learner.cached_blocks += info.n_blocks - entry.n_blocks
        entry.n_blocks = info.n_blocks

    def set_evictable(self, key: Key, evictable: bool) -> None:
        entry = self.queues.entries[key]
        if evictable:
            self._place(key, entry)
        else:
            self.expert.lru.discard(key)
            self.queues.unplace(key, self.queues.owners[entry.owner])

    def victim(self, now: float) -> Key | None:
        model = self._model_victim(now)
        if model is None or not self.ablation.use_lru_expert:
            return model
        return self.expert.choose(model)

    def evicted(self, key: Key, remaining: EntryInfo | None, now: float) -> None:
        queues = self.queues
        entry = queues.entries[key]
        owner = queues.owners[entry.owner]
        if self.ablation.use_lru_expert:
            self.expert.note_duel(key, queues.entries, now)
        kept = remaining.n_blocks if remaining is not None else 0
        self.learner.learn_eviction(entry.n_blocks - kept, now)
        self.learner.remember(key, owner.klass, entry.t_last)
        if remaining is None:
            self.expert.lru.discard(key)
            owner.entries.discard(key)
            del queues.entries[key]
            owner.n_entries -= 1
            queues.requeue(owner)
            if owner.n_entries == 0 and owner.disposable:
                queues.drop(owner)
        else:
            entry.n_blocks = remaining.n_blocks
        limit = self.learner.trim_ghosts(len(queues.entries))
        self.expert.expire(limit, self.learner.last_evict_t)

    def end_session(self, session: int) -> None:
        """The caller stopped tracking ``session`` (a bounded session table evicted it; it
        never comes back under this id). Its owner stops waiting (no gap is learned: none was
        observed) and is forgotten now if it owns no entry, else with its last entry. Not an
        eviction event (the simulator never calls it). Mutates: the owner, the waiting lists,
        owners."""
        owner = self.queues.owners.get(("session", session))
        if owner is None:
            return
        self.sessions.close(owner)
        owner.retired = True
        if owner.n_entries == 0:
            self.queues.drop(owner)

    # ----- scoring --------------------------------------------------------------
    def stats(self, klass: ReuseClass) -> ClassStats:
        """The learned stats of ``klass`` (created from the priors on first use)."""
        return self.learner.stats(klass)

    def reuse_model(self, klass: ReuseClass) -> ReuseTimeModel:
        """The reuse-time model of ``klass`` (see ``Learner.reuse_model``)."""
        return self.learner.reuse_model(klass)

    def value(self, rank: RankClass, age: float, horizon: float | None = None) -> float:
        """Value density of an owner of ``rank`` whose head entry has ``age`` seconds:
        hit density (or g) times cost per block ** cost_power. Mutates: as ``stats``."""
        klass, bucket, pace = rank
        if horizon is None:
            horizon = self.state.horizon_s * self.ablation.horizon_scale
        score = hit_density if self.ablation.hit_density else soon
        g = score(self.learner.reuse_model(klass), self.learner.stats(klass).reuse_prob, age,
                  horizon, math.exp(pace * PACE_STEP))
        return g * 2.0 ** (bucket * self.config.cost_power) if self.config.cost_power else g

    def _model_victim(self, now: float) -> Key | None:
        """The model's victim: the head entry of the owner of least value. Values are one
        curve per rank class, decreasing then increasing in age at most once, so only the
        oldest and the youngest owner of each class are scored. Mutates: the value memo."""
        version = self.learner.version
        if now != self._values_at or version != self._values_version:
            self._values.clear()
            self._values_at, self._values_version = now, version
            self._horizon = self.state.horizon_s * self.ablation.horizon_scale  # fixed per instant
        horizon = self._horizon
        cached = self._values
        best, best_value = None, None
        for rank, head, young in self.queues.heads():
            memo = cached.get(rank)
            if memo is None or memo.t_head != head.t_head or memo.t_young != young.t_head:
                old_value = self.value(rank, now - head.t_head, horizon)
                young_value = (self.value(rank, now - young.t_head, horizon)
                               if young.owner != head.owner else old_value)
                memo = cached[rank] = _RankValues(head.t_head, young.t_head, old_value, young_value)
            if best_value is None or memo.old_value < best_value:
                best, best_value = head.owner, memo.old_value
            if memo.young_value < best_value:
                best, best_value = young.owner, memo.young_value
        if best is None:
            return None
        return self.queues.owners[best].entries.peek()

    # ----- owners ---------------------------------------------------------------
    def _place(self, key: Key, entry: Entry) -> None:
        """``key`` is evictable at its last access. Mutates: its owner, the heaps, LRU."""
        self.expert.lru.set(key, entry.t_last)
        self.queues.place(key, entry)

    def _request_event(self, owner: Owner, token_type: str, request: RequestInfo,
                       admitted: int = 0) -> None:
        """A session/request owner saw part of ``request``; its state becomes the type of
        the deepest entry the request reached (events come root to leaf), with the size
        class of the output it cached (generating a long output takes long). Mutates: the
        owner (request, state, out_blocks, queue position), the session clock and fits."""
        if request.index != owner.request:
            if owner.queue == "session" and owner.request >= 0:
                self.sessions.returned(owner, request.time)
            owner.request, owner.t_request = request.index, request.time
            owner.out_blocks = 0
        state: State = token_type
        if token_type in OUTPUT_TYPES and self.ablation.output_size_classes:
            owner.out_blocks += admitted
            state = output_state(token_type, owner.out_blocks)
        if owner.state != state:
            self.sessions.close(owner)
            owner.state = state
            self.queues.requeue(owner)
        self.sessions.open(owner)
