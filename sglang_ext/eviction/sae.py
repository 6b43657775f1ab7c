"""SAECache: semantic-adaptive eviction (design and math: docs/saecache.md).

Cached entries belong to *owners*: the session whose private context they are
(``session`` queue), the single request of unknown session that brought them
(``single``), or, once a second session / request reads them, the entry itself
(``shared``). An owner is in a *state*: the token type its last request ended with
(split by the size of the cached output), e.g. a tool call -> the next request is
seconds away, a response -> a user has to answer. Per (queue, state) class SAE fits
online a log-normal model of the time T to the owner's next reference (for sessions: the
gap between requests, observed exactly) and the chance rho that there is one at all.

To free space SAE evicts the evictable entry with the smallest hit density

    v = H * g_c(a) / E[time held] * cost_per_block ** p,
    g_c(a) = P(next reference within H | none for age a) = rho (S(a) - S(a + H)) / (rho S(a) + 1 - rho)

with ``S`` the log-normal survival, ``a`` the entry's age, ``H`` the cache's mean
block residence time (Little's law: cached blocks / eviction rate) and ``E[time held]``
the expected time until the reference or for H, whichever comes first: references per
block-second of cache, as in LHD (Beckmann et al., NSDI'18). Overdue owners (S(a) small)
and owners whose next request is far away go first; owners about to return are kept
whole.

A second expert, LRU, proposes its own victim. Every disagreement is judged afterwards
by Belady's rule on the pair (whichever of the two candidates is referenced first
should have been kept, weighted by its recompute cost) and SAE follows the model only
while it wins at least half of the recent weighted disagreements. Deterministic: no
randomness, insertion-ordered containers, heaps with sequence-number tie-breaks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from .base import NEVER, EntryInfo, EvictionPolicy, Key, LazyMinHeap, RequestInfo, register

QUEUES = ("shared", "session", "single")
SQRT2 = math.sqrt(2.0)
OUTPUT_TYPES = frozenset(("response", "reasoning", "tool_call"))
MAX_SIZE_CLASS = 7  # output size classes: log2 buckets of cached output blocks, capped
PACE_STEP = 0.7  # log-time width of the per-session pace buckets


@dataclass(frozen=True)
class SAEConfig:
    learning: bool = True  # False: parameters stay as initialised (fixed-parameter variant)
    prior_reuse_s: float = 30.0  # median time to the next reference before any observation
    prior_log_sigma: float = 1.5
    prior_reuse_prob: float = 0.5
    min_sigma: float = 0.5  # the log-normal fit is never more certain than this
    min_stat_rate: float = 0.01  # floor of the 1/n rate of the running moments
    horizon_rate: float = 1e-3  # floor of the 1/n rate of the eviction-rate estimate
    expert_rate: float = 0.01  # floor of the 1/n rate of the model's win rate
    cost_power: float = 0.5  # value *= (recompute cost per block) ** cost_power; 1: TTFT-optimal
    #                          weighting (attention: deeper blocks cost more), 0: hit ratio
    silence_quantile_z: float = 2.33  # a session silent past its class's 99th pct has ended
    ghost_factor: float = 1.0  # ghost / pending-duel capacity relative to cached entries
    min_ghosts: int = 256
    use_lru_expert: bool = True  # follow LRU while the model loses the pairwise duels
    duel_stake_blocks: bool = True  # weigh a duel by the blocks of the entry referenced first
    duel_cost_power: float | None = None  # ... times cost per block ** this (None: cost_power)
    duel_window: float = math.inf  # unresolved duels expire after this many residence times H
    duel_cap_factor: int = 1  # ... or beyond this many per ghost slot (FIFO)
    horizon_scale: float = 1.0  # H multiplier (ablation only; 1 = Little's law residence time)
    session_rate: float = 0.0  # >0: per-session shift of the class's log gap (ablation)
    output_size_classes: bool = True  # split output states by log2 of the cached output size
    late_returns: bool = True  # a session that returns after being declared ended is learned:
    #                            its gap enters the fit and its "ended" outcome is revoked
    hit_density: bool = True  # value per block-second held: g / expected time held (LHD-style);
    #                           False: g alone (version 2)


@dataclass
class ReuseTimeModel:
    """Running mean/variance of log re-reference time: a log-normal fit."""

    mu: float
    var: float
    n: int = 0
    min_sigma: float = 0.5

    def observe(self, seconds: float, min_rate: float) -> None:
        self.observe_log(math.log(max(seconds, 1e-3)), min_rate)

    def observe_log(self, x: float, min_rate: float) -> None:
        self.n += 1
        rate = max(1.0 / self.n, min_rate)
        delta = x - self.mu
        self.mu += rate * delta
        self.var = (1.0 - rate) * (self.var + rate * delta * delta)

    @property
    def sigma(self) -> float:
        return max(math.sqrt(max(self.var, 0.0)), self.min_sigma)

    def survival(self, seconds: float) -> float:
        """P(T > seconds)."""
        if seconds <= 0:
            return 1.0
        return 0.5 * math.erfc((math.log(seconds) - self.mu) / (self.sigma * SQRT2))

    def quantile(self, z: float) -> float:
        return math.exp(self.mu + z * self.sigma)

    def survival_integral(self, lo: float, hi: float) -> float:
        """Integral of the survival over [lo, hi]: E[min(T, hi)] - E[min(T, lo)]. Below the
        median it is taken as a difference of truncated means, above it as a difference
        of tail integrals, each accurate where the other cancels."""
        if hi <= lo:
            return 0.0
        if lo <= 0 or math.log(lo) <= self.mu:
            return self._truncated_mean(hi) - self._truncated_mean(lo)
        return self._tail_integral(lo) - self._tail_integral(hi)

    def _truncated_mean(self, x: float) -> float:
        """E[min(T, x)] = x S(x) + E[T; T <= x]."""
        if x <= 0:
            return 0.0
        return x * self.survival(x) + self._partial_mean(x, upper=False)

    def _tail_integral(self, x: float) -> float:
        """Integral of the survival over [x, inf) = E[T; T > x] - x S(x)."""
        return max(self._partial_mean(x, upper=True) - x * self.survival(x), 0.0)

    def _partial_mean(self, x: float, upper: bool) -> float:
        """E[T; T > x] (upper) or E[T; T <= x]: exp(mu + s^2/2) Phi(-/+ (ln x - mu - s^2) / s)."""
        sigma = self.sigma
        z = (math.log(x) - self.mu - sigma * sigma) / (sigma * SQRT2)
        return math.exp(self.mu + 0.5 * sigma * sigma) * 0.5 * math.erfc(z if upper else -z)


@dataclass
class ClassStats:
    reuse_time: ReuseTimeModel
    reuse_prob: float
    outcomes: int = 0

    def observe_outcome(self, reused: bool, min_rate: float) -> None:
        self.outcomes += 1
        rate = max(1.0 / (self.outcomes + 1), min_rate)
        self.reuse_prob += rate * (float(reused) - self.reuse_prob)

    def soon(self, age: float, horizon: float, scale: float = 1.0) -> float:
        return soon(self.reuse_time, self.reuse_prob, age, horizon, scale)


def soon(model: ReuseTimeModel, rho: float, age: float, horizon: float, scale: float = 1.0) -> float:
    """g(a) = P(a reference within (a, a + H] | none during the age a); ``scale``
    stretches the reuse time (an owner known to be slower or faster than its class)."""
    alive = model.survival(age / scale)
    denom = rho * alive + 1.0 - rho
    if denom <= 1e-300:
        return 0.0
    return max(rho * (alive - model.survival((age + horizon) / scale)), 0.0) / denom


def hit_density(model: ReuseTimeModel, rho: float, age: float, horizon: float,
                scale: float = 1.0) -> float:
    """References per second of cache held, times H: g(a) divided by the expected time
    the entry stays (until its reference or for H, whichever comes first), given no
    reference during the age a. At least g(a); equal to it when the owner would stay the
    whole H (no reference expected within it)."""
    lo, hi = age / scale, (age + horizon) / scale
    hits = rho * (model.survival(lo) - model.survival(hi))
    if hits <= 0.0:
        return 0.0
    held = scale * rho * model.survival_integral(lo, hi) + (1.0 - rho) * horizon
    # never less than holding to the horizon when no reference comes by then (rounding)
    held = max(held, horizon * (rho * model.survival(hi) + 1.0 - rho), 1e-300)
    return hits * horizon / held


@dataclass
class SAEState:
    """Everything SAE learns; ``snapshot`` copies it to warm-start another instance."""

    classes: dict[tuple[str, str], ClassStats] = field(default_factory=dict)
    horizon_s: float = 30.0  # mean block residence time (Little's law)
    evict_dt_ew: float = 0.0  # running sums: seconds between evictions / blocks evicted
    evict_blocks_ew: float = 0.0
    evictions: int = 0
    model_win_rate: float = 0.5  # cost-weighted share of resolved disagreements the model won
    duels: int = 0
    duel_win_ew: float = 0.0  # running sums behind model_win_rate
    duel_weight_ew: float = 0.0

    def snapshot(self) -> "SAEState":
        classes = {k: ClassStats(replace(v.reuse_time), v.reuse_prob, v.outcomes)
                   for k, v in self.classes.items()}
        return replace(self, classes=classes)


class _Entry:
    __slots__ = ("token_type", "start", "n_blocks", "t_last", "owner", "cost_bucket",
                 "requester")

    def __init__(self, info: EntryInfo, owner, requester, now: float, bucket: int) -> None:
        self.token_type, self.start, self.n_blocks = info.token_type, info.start_token, info.n_blocks
        self.t_last, self.owner, self.requester, self.cost_bucket = now, owner, requester, bucket


class _Owner:
    """A session (or request, or shared entry) and its evictable entries."""

    __slots__ = ("key", "queue", "state", "t_request", "request", "entries", "klass", "open",
                 "n_entries", "log_pace", "pace", "out_blocks", "ended")

    def __init__(self, key, queue: str, state: str, now: float, request: int) -> None:
        self.key, self.queue, self.state = key, queue, state
        self.t_request, self.request = now, request
        self.entries = LazyMinHeap()  # evictable entries, oldest (then deepest) first
        self.klass = None  # (queue, state, cost bucket) it is queued under, None: not queued
        self.open = False  # waiting for its next request (session outcome bookkeeping)
        self.n_entries = 0  # cached entries it owns (evictable or not)
        self.log_pace, self.pace = 0.0, 0  # running log(own gap / class median), its bucket
        self.out_blocks = 0  # output blocks cached by its current request
        self.ended = False  # declared ended (silent past its class's quantile), not back yet


@dataclass(frozen=True)
class _Ghost:
    klass: tuple[str, str]
    t_last: float


@register
class SAEPolicy(EvictionPolicy):
    name = "sae"

    def __init__(self, config: SAEConfig = SAEConfig(), state: SAEState | None = None) -> None:
        self.config = config
        self.state = state.snapshot() if state is not None else SAEState(horizon_s=config.prior_reuse_s)
        self._entries: dict[Key, _Entry] = {}
        self._owners: dict[object, _Owner] = {}
        self._oldest: dict[tuple, LazyMinHeap] = {}  # per class: owners by head age, oldest first
        self._youngest: dict[tuple, LazyMinHeap] = {}  # per class: youngest first
        self._lru = LazyMinHeap()  # all evictable entries by last access (the LRU expert)
        self._ghosts: OrderedDict[Key, _Ghost] = OrderedDict()
        self._open: dict[tuple[str, str], OrderedDict] = {}  # per session class: open owners
        self._duels: OrderedDict[int, tuple] = OrderedDict()  # id -> (evicted, kept, model evicted?)
        self._duels_of: dict[Key, list[int]] = {}
        self._duel_ids = 0
        self._cached_blocks = 0
        self._last_evict_t: float | None = None
        self._proposals: tuple = (None, None)  # (model, lru) victims of the last victim() call
        self._values: dict[tuple, tuple] = {}  # per class: memoised values at (time, version)
        self._values_at, self._version, self._values_version = None, 0, -1
        self._horizon = self.state.horizon_s

    # ----- events ---------------------------------------------------------------
    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use=NEVER) -> None:
        self._referenced(key, request.time)
        owner = self._owner_for(request)
        self._request_event(owner, info.token_type, request, info.n_blocks)
        entry = _Entry(info, owner.key, _requester(request), request.time, self._bucket(info))
        self._entries[key] = entry
        owner.n_entries += 1
        self._cached_blocks += info.n_blocks
        self._ghost_feedback(key, request.time)

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use=NEVER) -> None:
        self._referenced(key, request.time)
        entry = self._entries[key]
        requester = _requester(request)
        owner = self._owners[entry.owner]
        evictable = key in owner.entries
        if owner.queue != "shared" and requester != entry.requester:
            self._make_shared(key, entry, evictable)
            owner = self._owners[entry.owner]
        if owner.queue == "shared":
            if evictable:
                self._learn_reference((owner.queue, owner.state), request.time - entry.t_last)
            owner.t_request = request.time
        elif owner.queue == "single":
            if evictable:
                self._learn_reference((owner.queue, owner.state), request.time - entry.t_last)
        else:
            self._request_event(owner, info.token_type, request)
        entry.t_last = request.time
        if evictable:
            self._place(key, entry)

    def resize(self, key: Key, info: EntryInfo) -> None:
        entry = self._entries[key]
        if info.n_blocks > entry.n_blocks:
            self._ghost_feedback(key, entry.t_last)
        self._cached_blocks += info.n_blocks - entry.n_blocks
        entry.n_blocks = info.n_blocks

    def set_evictable(self, key: Key, evictable: bool) -> None:
        entry = self._entries[key]
        owner = self._owners[entry.owner]
        if evictable:
            self._place(key, entry)
        else:
            owner.entries.discard(key)
            self._lru.discard(key)
            self._requeue(owner)

    def victim(self, now: float) -> Key | None:
        model = self._model_victim(now)
        if model is None or not self.config.use_lru_expert:
            return model
        lru = self._lru.peek()
        self._proposals = (model, lru)  # judged later if the two experts disagree
        if lru == model or self.state.model_win_rate >= 0.5:
            return model
        return lru

    def evicted(self, key: Key, remaining: EntryInfo | None, now: float) -> None:
        entry = self._entries[key]
        owner = self._owners[entry.owner]
        self._note_duel(key, now)
        self._learn_eviction(entry, remaining, now)
        self._ghosts.pop(key, None)
        self._ghosts[key] = _Ghost((owner.queue, owner.state), entry.t_last)
        if remaining is None:
            owner.entries.discard(key)
            self._lru.discard(key)
            del self._entries[key]
            owner.n_entries -= 1
            self._requeue(owner)
            if owner.n_entries == 0 and owner.queue != "session":
                self._drop_owner(owner)
        else:
            entry.n_blocks = remaining.n_blocks
        self._trim_ghosts()

    # ----- scoring --------------------------------------------------------------
    def stats(self, klass: tuple[str, str]) -> ClassStats:
        found = self.state.classes.get(klass)
        if found is None:
            cfg = self.config
            mu = 0.0 if isinstance(klass[1], tuple) else math.log(cfg.prior_reuse_s)
            model = ReuseTimeModel(mu=mu, var=cfg.prior_log_sigma ** 2, min_sigma=cfg.min_sigma)
            found = self.state.classes[klass] = ClassStats(model, cfg.prior_reuse_prob)
        return found

    def reuse_model(self, klass: tuple) -> ReuseTimeModel:
        """Reuse-time model of (queue, state). A state split by output size stores only
        its offset from the type's model, so it follows when the type's model moves."""
        queue, state = klass
        if not isinstance(state, tuple):
            return self.stats(klass).reuse_time
        base, offset = self.stats((queue, state[0])).reuse_time, self.stats(klass).reuse_time
        return ReuseTimeModel(mu=base.mu + offset.mu, var=offset.var, n=offset.n,
                              min_sigma=offset.min_sigma)

    def value(self, klass: tuple, age: float, horizon: float | None = None) -> float:
        """Value density of an entry of ``klass`` (queue, state, cost bucket) at ``age``."""
        queue, state, bucket, pace = klass
        if horizon is None:
            horizon = self.state.horizon_s * self.config.horizon_scale
        score = hit_density if self.config.hit_density else soon
        g = score(self.reuse_model((queue, state)), self.stats((queue, state)).reuse_prob, age,
                  horizon, math.exp(pace * PACE_STEP))
        return g * 2.0 ** (bucket * self.config.cost_power) if self.config.cost_power else g

    def _model_victim(self, now: float) -> Key | None:
        best, best_value = None, None
        if now != self._values_at or self._version != self._values_version:
            self._values.clear()
            self._values_at, self._values_version = now, self._version
            self._horizon = self.state.horizon_s * self.config.horizon_scale  # fixed per instant
        horizon = self._horizon
        cached = self._values
        for klass, oldest in self._oldest.items():
            head = oldest.peek_entry()
            if head is None:
                continue
            young = self._youngest[klass].peek_entry()
            memo = cached.get(klass)
            if memo is None or memo[0] != head[0] or memo[1] != young[0]:
                old_value = self.value(klass, now - head[0], horizon)
                young_value = self.value(klass, now + young[0], horizon) if young[2] != head[2] else old_value
                memo = cached[klass] = (head[0], young[0], old_value, young_value)
            if best_value is None or memo[2] < best_value:
                best, best_value = head[2], memo[2]
            if memo[3] < best_value:
                best, best_value = young[2], memo[3]
        if best is None:
            return None
        return self._owners[best].entries.peek()

    def _bucket(self, info: EntryInfo) -> int:
        """log2 bucket of the recompute cost per block; representative cost 2**bucket."""
        if info.compute_cost <= 0 or info.n_blocks <= 0:
            return 0
        return round(math.log2(info.compute_cost / info.n_blocks))

    # ----- owners and queues ----------------------------------------------------
    def _owner_for(self, request: RequestInfo) -> _Owner:
        if request.session is not None:
            key, queue = ("session", request.session), "session"
        else:
            key, queue = ("request", request.index), "single"
        owner = self._owners.get(key)
        if owner is None:
            owner = self._owners[key] = _Owner(key, queue, "unknown", request.time, -1)
        return owner

    def _make_shared(self, key: Key, entry: _Entry, evictable: bool) -> None:
        old = self._owners[entry.owner]
        old.entries.discard(key)
        old.n_entries -= 1
        self._requeue(old)
        if old.n_entries == 0 and old.queue != "session":
            self._drop_owner(old)
        owner = self._owners[("entry", key)] = _Owner(("entry", key), "shared", entry.token_type,
                                                      entry.t_last, -1)
        entry.owner = owner.key
        owner.n_entries = 1
        if evictable:
            owner.entries.set(key, (entry.t_last, -entry.start))

    def _drop_owner(self, owner: _Owner) -> None:
        if owner.klass is not None:
            self._oldest[owner.klass].discard(owner.key)
            self._youngest[owner.klass].discard(owner.key)
        self._owners.pop(owner.key, None)

    def _place(self, key: Key, entry: _Entry) -> None:
        owner = self._owners[entry.owner]
        owner.entries.set(key, (entry.t_last, -entry.start))
        self._lru.set(key, entry.t_last)
        self._requeue(owner)

    def _requeue(self, owner: _Owner) -> None:
        head = owner.entries.peek_entry()
        if head is None:
            klass = None
        else:
            klass = (owner.queue, owner.state, self._entries[head[2]].cost_bucket, owner.pace)
        if owner.klass is not None and owner.klass != klass:
            self._oldest[owner.klass].discard(owner.key)
            self._youngest[owner.klass].discard(owner.key)
        owner.klass = klass
        if klass is None:
            return
        oldest = self._oldest.get(klass)
        if oldest is None:
            oldest = self._oldest[klass] = LazyMinHeap()
            self._youngest[klass] = LazyMinHeap()
        t_head = head[0][0]
        oldest.set(owner.key, t_head)
        self._youngest[klass].set(owner.key, -t_head)

    def _request_event(self, owner: _Owner, token_type: str, request: RequestInfo,
                       admitted: int = 0) -> None:
        """A session/request owner saw part of ``request``; its state becomes the type of
        the deepest entry the request reached (events come root to leaf), with the size
        class of the output it cached (generating a long output takes long)."""
        if request.index != owner.request:
            if owner.queue == "session" and owner.request >= 0:
                self._session_returned(owner, request.time)
            owner.request, owner.t_request = request.index, request.time
            owner.out_blocks = 0
        if token_type in OUTPUT_TYPES and self.config.output_size_classes:
            owner.out_blocks += admitted
            token_type = (token_type, min(owner.out_blocks.bit_length(), MAX_SIZE_CLASS))
        if owner.state != token_type:
            self._close(owner)
            owner.state = token_type
            self._requeue(owner)
        self._open_session(owner)

    # ----- learning -------------------------------------------------------------
    def _session_returned(self, owner: _Owner, now: float) -> None:
        """Exact, uncensored sample: the gap between a session's requests."""
        klass = (owner.queue, owner.state)
        late = owner.ended and self.config.late_returns
        owner.ended = False
        if owner.open or late:
            self._close(owner)
            if self.config.learning:
                self._version += 1
                gap = max(now - owner.t_request, 1e-3)
                rate = self.config.session_rate
                if rate > 0:
                    mu = self.reuse_model(klass).mu
                    owner.log_pace += rate * (math.log(gap) - mu - owner.log_pace)
                    owner.pace = max(-3, min(3, round(owner.log_pace / PACE_STEP)))
                if late:
                    self._revoke_ended(klass)
                self._observe_gap(klass, gap, True)
        self._expire_sessions(now)

    def _observe_gap(self, klass: tuple, gap: float | None, returned: bool) -> None:
        """A session of ``klass`` returned after ``gap`` s (or ended: ``returned`` False)."""
        rate = self.config.min_stat_rate
        queue, state = klass
        fine = self.stats(klass)
        if isinstance(state, tuple):
            base = self.stats((queue, state[0]))
            if returned:
                x = math.log(gap)
                base.reuse_time.observe_log(x, rate)
                fine.reuse_time.observe_log(x - base.reuse_time.mu, rate)
            base.observe_outcome(returned, rate)
        elif returned:
            fine.reuse_time.observe(gap, rate)
        fine.observe_outcome(returned, rate)

    def _revoke_ended(self, klass: tuple) -> None:
        """A session declared ended came back: its 0 outcome was wrong. Without this, the
        gaps beyond the silence quantile are never observed (they are censored by the
        verdict itself), so the fit keeps a too-thin tail and a too-low rho, and the
        sessions that take longest (a long tool run, a sub-agent) are evicted as "ended".
        The 0 is taken back by the step it moved rho; ``_observe_gap`` then counts the 1."""
        rate = self.config.min_stat_rate
        queue, state = klass
        revoked = [self.stats(klass)]
        if isinstance(state, tuple):
            revoked.append(self.stats((queue, state[0])))
        for stats in revoked:
            step = max(1.0 / (stats.outcomes + 1), rate)
            stats.reuse_prob = min(stats.reuse_prob / (1.0 - step), 1.0) if step < 1.0 else 1.0
            stats.outcomes = max(stats.outcomes - 1, 0)

    def _open_session(self, owner: _Owner) -> None:
        if owner.queue != "session" or owner.open:
            return
        owner.open = True
        self._open.setdefault((owner.queue, owner.state), OrderedDict())[owner.key] = owner

    def _close(self, owner: _Owner) -> None:
        if owner.open:
            owner.open = False
            self._open[(owner.queue, owner.state)].pop(owner.key, None)

    def _expire_sessions(self, now: float) -> None:
        """Sessions silent beyond their class's high quantile count as ended (rho -> 0)."""
        for klass, waiting in self._open.items():
            limit = self.reuse_model(klass).quantile(self.config.silence_quantile_z)
            while waiting:
                key, owner = next(iter(waiting.items()))
                if now - owner.t_request <= limit:
                    break
                waiting.popitem(last=False)
                owner.open = False
                owner.ended = True
                if self.config.learning:
                    self._version += 1
                    self._observe_gap(klass, None, False)

    def _learn_reference(self, klass: tuple[str, str], elapsed: float) -> None:
        if not self.config.learning:
            return
        self._version += 1
        stats = self.stats(klass)
        stats.reuse_time.observe(elapsed, self.config.min_stat_rate)
        stats.observe_outcome(True, self.config.min_stat_rate)

    def _learn_eviction(self, entry: _Entry, remaining: EntryInfo | None, now: float) -> None:
        blocks = entry.n_blocks - (remaining.n_blocks if remaining is not None else 0)
        self._cached_blocks -= blocks
        state = self.state
        if self._last_evict_t is None:
            self._last_evict_t = now
        dt, self._last_evict_t = now - self._last_evict_t, now
        if not self.config.learning:
            return
        state.evictions += 1
        keep = 1.0 - max(1.0 / state.evictions, self.config.horizon_rate)
        state.evict_dt_ew = keep * state.evict_dt_ew + dt
        state.evict_blocks_ew = keep * state.evict_blocks_ew + blocks
        if state.evict_dt_ew > 0 and state.evict_blocks_ew > 0:
            per_block = state.evict_dt_ew / state.evict_blocks_ew
            state.horizon_s = max(self._cached_blocks + blocks, 1) * per_block

    def _ghost_feedback(self, key: Key, t_return: float) -> None:
        ghost = self._ghosts.pop(key, None)
        if ghost is None or not self.config.learning or ghost.klass[0] == "session":
            return  # session gaps are observed exactly at every request
        self._learn_reference(ghost.klass, t_return - ghost.t_last)

    def _trim_ghosts(self) -> None:
        limit = max(self.config.min_ghosts, int(self.config.ghost_factor * len(self._entries)))
        while len(self._ghosts) > limit:
            _, ghost = self._ghosts.popitem(last=False)
            if self.config.learning and ghost.klass[0] != "session":
                self._version += 1
                self.stats(ghost.klass).observe_outcome(False, self.config.min_stat_rate)
        self._expire_duels(limit)

    def _expire_duels(self, limit: int) -> None:
        """Unresolved duels (neither candidate back) are dropped as ties once older than
        ``duel_window`` residence times H; a short window would only resolve the duels
        won by whichever candidate returns quickly and bias the judge towards LRU."""
        if not self._duels:
            return
        window = self.config.duel_window * self.state.horizon_s
        cap = limit * self.config.duel_cap_factor
        now = self._last_evict_t
        while self._duels:
            duel_id, duel = next(iter(self._duels.items()))
            if len(self._duels) <= cap and now - duel[4] <= window:
                break
            self._duels.popitem(last=False)
            self._unlink_duel(duel_id, duel[0], duel[1])

    # ----- the LRU expert: disagreements judged by Belady's rule on the pair ----
    def _note_duel(self, key: Key, now: float) -> None:
        """Called before ``key`` is trimmed: if the model and LRU disagreed, remember the
        pair; whichever is referenced first should have stayed."""
        if not self.config.use_lru_expert:
            return
        model, lru = self._proposals
        self._proposals = (None, None)
        if lru is None or model is None or lru == model or key not in (lru, model):
            return
        other = model if key == lru else lru
        self._duel_ids += 1
        ek, eo = self._entries[key], self._entries[other]
        if self.config.duel_stake_blocks:
            buckets = (ek.cost_bucket, eo.cost_bucket, ek.n_blocks, eo.n_blocks)
        else:
            buckets = (ek.cost_bucket, eo.cost_bucket, 1, 1)
        self._duels[self._duel_ids] = (key, other, key == model, buckets, now)
        for k in (key, other):
            self._duels_of.setdefault(k, []).append(self._duel_ids)

    def _referenced(self, key: Key, now: float) -> None:
        ids = self._duels_of.pop(key, None)
        if not ids:
            return
        for duel_id in ids:
            duel = self._duels.pop(duel_id, None)
            if duel is None:
                continue
            evicted, kept, model_evicted, buckets, _ = duel
            other = kept if key == evicted else evicted
            self._unlink_duel(duel_id, other, other)
            # the one referenced first should have been kept; what was at stake is its
            # recompute cost (the model's own objective: cost per block ** cost_power)
            model_right = (key == kept) == model_evicted
            first = int(key == kept)
            power = self.config.duel_cost_power
            power = self.config.cost_power if power is None else power
            stake = buckets[2 + first] * 2.0 ** (buckets[first] * power)
            self._score_model(model_right, stake)

    def _unlink_duel(self, duel_id: int, a: Key, b: Key) -> None:
        for k in {a, b}:
            ids = self._duels_of.get(k)
            if ids and duel_id in ids:
                ids.remove(duel_id)
                if not ids:
                    del self._duels_of[k]

    def _score_model(self, right: bool, stake: float = 1.0) -> None:
        if not self.config.learning:
            return
        state = self.state
        state.duels += 1
        keep = 1.0 - max(1.0 / state.duels, self.config.expert_rate)
        state.duel_win_ew = keep * state.duel_win_ew + stake * float(right)
        state.duel_weight_ew = keep * state.duel_weight_ew + stake
        state.model_win_rate = state.duel_win_ew / state.duel_weight_ew


def _requester(request: RequestInfo):
    """Known sessions are ints; unknown ones become per-request tokens."""
    return request.session if request.session is not None else ("request", request.index)


@register
class SAEModelPolicy(SAEPolicy):
    """SAE's model alone, without the LRU expert (ablation, ``sae-model`` in the CLI)."""

    name = "sae-model"

    def __init__(self, config: SAEConfig | None = None, state: SAEState | None = None) -> None:
        super().__init__(config or replace(SAEConfig(), use_lru_expert=False), state)
