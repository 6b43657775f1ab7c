"""SAECache: semantic-adaptive eviction (design and math: docs/saecache.md).

Entries are routed to queues (``shared``: reused across sessions or requests, i.e.
structural reuse; ``session``: private multi-turn context; ``single``: seen by one
request of unknown session) and typed by token type. Each (queue, type) class is an LRU
list with an online log-normal model of its leaves' re-reference time and a reuse
probability. To free space SAE looks at the oldest entry of every class and evicts the
one least likely to be re-referenced within the cache's horizon ``H``:

    value = W[queue] * U[type] * (1 + start/P0) ** -gamma * rho * P(T <= a + H | T > a)

with ``a`` the entry's age, ``T`` its class's log-normal re-reference time and ``H`` the
running mean age at eviction. A ghost list of evicted keys turns re-references into
feedback: queue/type weights equalise ghost-hit rates across classes, reuse times
observed after eviction correct the censoring of the fit, and ``gamma`` is fitted to
reuse vs position. Deterministic: no randomness, insertion-ordered containers only.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from .base import NEVER, EntryInfo, EvictionPolicy, Key, LazyMinHeap, RequestInfo, register

QUEUES = ("shared", "session", "single")


@dataclass(frozen=True)
class SAEConfig:
    learning: bool = True  # False: parameters stay as initialised (fixed-parameter variant)
    prior_reuse_s: float = 30.0  # median re-reference time before any observation
    prior_log_sigma: float = 1.5
    prior_reuse_prob: float = 0.5
    min_stat_rate: float = 0.01  # floor of the 1/n rate of all running moments
    weight_rate: float = 0.02  # eta of the multiplicative weight updates
    weight_bounds: tuple[float, float] = (0.8, 1.25)  # a bounded correction on top of rho
    position_scale_tokens: float = 1024.0
    gamma_bounds: tuple[float, float] = (0.0, 0.25)
    ghost_factor: float = 1.0  # ghost capacity relative to the number of cached entries
    min_ghosts: int = 256


@dataclass
class ReuseTimeModel:
    """Running mean/variance of log re-reference time: a log-normal fit."""

    mu: float
    var: float
    n: int = 0
    min_sigma: float = 0.5  # regularises the fit: never more certain than this

    def observe(self, seconds: float, min_rate: float) -> None:
        self.n += 1
        rate = max(1.0 / self.n, min_rate)
        x = math.log(max(seconds, 1e-3))
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
        return 0.5 * math.erfc((math.log(seconds) - self.mu) / (self.sigma * math.sqrt(2.0)))

    def hazard(self, age: float, horizon: float) -> float:
        """P(T <= age + horizon | T > age): chance of a re-reference within the horizon."""
        alive = self.survival(age)
        if alive <= 1e-300:
            return 0.0
        return max(alive - self.survival(age + horizon), 0.0) / alive


@dataclass
class ClassStats:
    reuse_time: ReuseTimeModel
    reuse_prob: float
    outcomes: int = 0

    def observe_outcome(self, reused: bool, min_rate: float) -> None:
        self.outcomes += 1
        rate = max(1.0 / (self.outcomes + 1), min_rate)
        self.reuse_prob += rate * (float(reused) - self.reuse_prob)


@dataclass
class PositionModel:
    """Running moments of (x = log(1 + start/P0), reused) -> decay power gamma."""

    mean_x: float = 0.0
    mean_y: float = 0.0
    cov_xy: float = 0.0
    var_x: float = 0.0
    n: int = 0

    def observe(self, x: float, y: float, min_rate: float) -> None:
        self.n += 1
        rate = max(1.0 / self.n, min_rate)
        dx, dy = x - self.mean_x, y - self.mean_y
        self.mean_x += rate * dx
        self.mean_y += rate * dy
        self.cov_xy = (1.0 - rate) * (self.cov_xy + rate * dx * dy)
        self.var_x = (1.0 - rate) * (self.var_x + rate * dx * dx)

    def gamma(self, bounds: tuple[float, float]) -> float:
        """Slope of log reuse rate vs x, linearised around the mean: -cov/(mean_y*var)."""
        if self.var_x < 1e-6 or self.mean_y < 1e-6:
            return bounds[0]
        return min(max(-self.cov_xy / (self.mean_y * self.var_x), bounds[0]), bounds[1])


@dataclass
class SAEState:
    """Everything SAE learns; ``snapshot`` copies it to warm-start another instance."""

    classes: dict[tuple[str, str], ClassStats] = field(default_factory=dict)
    queue_weight: dict[str, float] = field(default_factory=dict)
    type_weight: dict[str, float] = field(default_factory=dict)
    position: PositionModel = field(default_factory=PositionModel)
    horizon_s: float = 30.0  # running mean age of evicted entries
    evictions: int = 0
    ghost_hit_ew: float = 0.0
    eviction_ew: float = 0.0

    @property
    def ghost_hit_rate(self) -> float:
        return self.ghost_hit_ew / self.eviction_ew if self.eviction_ew else 0.0

    def snapshot(self) -> "SAEState":
        classes = {k: ClassStats(replace(v.reuse_time), v.reuse_prob, v.outcomes)
                   for k, v in self.classes.items()}
        return replace(self, classes=classes, queue_weight=dict(self.queue_weight),
                       type_weight=dict(self.type_weight), position=replace(self.position))


class _Entry:
    __slots__ = ("token_type", "start", "n_blocks", "t_last", "session", "shared", "klass")

    def __init__(self, info: EntryInfo, session, now: float) -> None:
        self.token_type, self.start, self.n_blocks = info.token_type, info.start_token, info.n_blocks
        self.t_last, self.session, self.shared = now, session, False
        self.klass = ("session" if isinstance(session, int) else "single", info.token_type)


@dataclass(frozen=True)
class _Ghost:
    klass: tuple[str, str]
    t_last: float
    start: int


@register
class SAEPolicy(EvictionPolicy):
    name = "sae"

    def __init__(self, config: SAEConfig = SAEConfig(), state: SAEState | None = None) -> None:
        self.config = config
        self.state = state.snapshot() if state is not None else SAEState(horizon_s=config.prior_reuse_s)
        self._entries: dict[Key, _Entry] = {}
        self._queues: dict[tuple[str, str], LazyMinHeap] = {}  # per class, by last access
        self._ghosts: OrderedDict[Key, _Ghost] = OrderedDict()

    # ----- events ---------------------------------------------------------------
    def admit(self, key: Key, info: EntryInfo, request: RequestInfo, next_use=NEVER) -> None:
        self._entries[key] = _Entry(info, _session_of(request), request.time)
        self._ghost_feedback(key)

    def touch(self, key: Key, info: EntryInfo, request: RequestInfo, next_use=NEVER) -> None:
        entry = self._entries[key]
        if self._is_candidate(key, entry):
            self._learn_reference(entry, request.time - entry.t_last)
        self._route(key, entry, _session_of(request))
        entry.t_last = request.time
        self._requeue(key, entry)

    def resize(self, key: Key, info: EntryInfo) -> None:
        entry = self._entries[key]
        if info.n_blocks > entry.n_blocks:
            self._ghost_feedback(key)
        entry.n_blocks = info.n_blocks

    def set_evictable(self, key: Key, evictable: bool) -> None:
        entry = self._entries[key]
        if evictable:
            self._queue(entry.klass).set(key, self.queue_key(entry))
        else:
            self._queue(entry.klass).discard(key)

    def victim(self, now: float) -> Key | None:
        best, best_score = None, None
        for klass, queue in self._queues.items():
            head = queue.peek_entry()
            if head is None:
                continue
            score = head[0] + self.state.horizon_s * math.log(self.class_value(klass))
            if best_score is None or score < best_score:
                best, best_score = head[2], score
        return best

    def evicted(self, key: Key, remaining: EntryInfo | None, now: float) -> None:
        entry = self._entries[key]
        self._remember_ghost(key, entry)
        self._learn_eviction(entry, now)
        if remaining is None:
            self._queue(entry.klass).discard(key)
            del self._entries[key]
        else:
            entry.n_blocks = remaining.n_blocks
        self._trim_ghosts()

    # ----- scoring --------------------------------------------------------------
    def stats(self, klass: tuple[str, str]) -> ClassStats:
        found = self.state.classes.get(klass)
        if found is None:
            cfg = self.config
            model = ReuseTimeModel(mu=math.log(cfg.prior_reuse_s), var=cfg.prior_log_sigma ** 2)
            found = self.state.classes[klass] = ClassStats(model, cfg.prior_reuse_prob)
        return found

    def weight(self, klass: tuple[str, str]) -> float:
        queue, token_type = klass
        return self.state.queue_weight.get(queue, 1.0) * self.state.type_weight.get(token_type, 1.0)

    def class_value(self, klass: tuple[str, str]) -> float:
        """Weighted chance that a fresh entry of ``klass`` is re-referenced within the
        horizon: rho * P(T <= H) * W[queue] * U[type]. Floored to keep logs finite."""
        stats = self.stats(klass)
        soon = 1.0 - stats.reuse_time.survival(self.state.horizon_s)
        return max(self.weight(klass) * stats.reuse_prob * soon, 1e-9)

    def queue_key(self, entry: _Entry) -> float:
        """Per-class LRU key: last access, aged by the learned position decay."""
        return entry.t_last + self.state.horizon_s * math.log(self._position_factor(entry.start))

    def _position_factor(self, start: int) -> float:
        gamma = self.state.position.gamma(self.config.gamma_bounds)
        return (1.0 + start / self.config.position_scale_tokens) ** -gamma

    # ----- queues ---------------------------------------------------------------
    def _queue(self, klass: tuple[str, str]) -> LazyMinHeap:
        queue = self._queues.get(klass)
        if queue is None:
            queue = self._queues[klass] = LazyMinHeap()
        return queue

    def _is_candidate(self, key: Key, entry: _Entry) -> bool:
        return key in self._queue(entry.klass)

    def _requeue(self, key: Key, entry: _Entry) -> None:
        if self._is_candidate(key, entry):
            self._queue(entry.klass).set(key, self.queue_key(entry))

    def _route(self, key: Key, entry: _Entry, session) -> None:
        """Entries reused by a second session (or request) move to the shared queue."""
        if session == entry.session or entry.shared:
            return
        candidate = self._is_candidate(key, entry)
        self._queue(entry.klass).discard(key)
        entry.shared, entry.klass = True, ("shared", entry.token_type)
        if candidate:
            self._queue(entry.klass).set(key, self.queue_key(entry))

    # ----- learning -------------------------------------------------------------
    def _learn_reference(self, entry: _Entry, elapsed: float) -> None:
        if not self.config.learning:
            return
        stats = self.stats(entry.klass)
        stats.reuse_time.observe(elapsed, self.config.min_stat_rate)
        stats.observe_outcome(True, self.config.min_stat_rate)
        self._observe_position(entry.start, 1.0)

    def _learn_eviction(self, entry: _Entry, now: float) -> None:
        state, cfg = self.state, self.config
        state.eviction_ew = state.eviction_ew * (1 - cfg.min_stat_rate) + 1.0
        state.ghost_hit_ew *= 1 - cfg.min_stat_rate
        if not cfg.learning:
            return
        state.evictions += 1
        rate = max(1.0 / state.evictions, cfg.min_stat_rate)
        state.horizon_s += rate * (max(now - entry.t_last, 1e-3) - state.horizon_s)
        self._scale_weights(entry.klass, -state.ghost_hit_rate)

    def _ghost_feedback(self, key: Key) -> None:
        ghost = self._ghosts.pop(key, None)
        if ghost is None or not self.config.learning:
            return
        cfg = self.config
        self.state.ghost_hit_ew += 1.0
        self._scale_weights(ghost.klass, 1.0)
        stats = self.stats(ghost.klass)
        stats.reuse_time.observe(self._entries[key].t_last - ghost.t_last, cfg.min_stat_rate)
        stats.observe_outcome(True, cfg.min_stat_rate)
        self._observe_position(ghost.start, 1.0)

    def _scale_weights(self, klass: tuple[str, str], direction: float) -> None:
        factor = math.exp(self.config.weight_rate * direction)
        low, high = self.config.weight_bounds
        queue, token_type = klass
        for table, name in ((self.state.queue_weight, queue), (self.state.type_weight, token_type)):
            table[name] = table.get(name, 1.0) * factor
            _normalise(table, low, high)

    def _observe_position(self, start: int, reused: float) -> None:
        x = math.log1p(start / self.config.position_scale_tokens)
        self.state.position.observe(x, reused, self.config.min_stat_rate)

    def _remember_ghost(self, key: Key, entry: _Entry) -> None:
        self._ghosts.pop(key, None)
        self._ghosts[key] = _Ghost(entry.klass, entry.t_last, entry.start)

    def _trim_ghosts(self) -> None:
        limit = max(self.config.min_ghosts, int(self.config.ghost_factor * len(self._entries)))
        while len(self._ghosts) > limit:
            _, ghost = self._ghosts.popitem(last=False)
            if self.config.learning:
                self.stats(ghost.klass).observe_outcome(False, self.config.min_stat_rate)
                self._observe_position(ghost.start, 0.0)


def _normalise(weights: dict[str, float], low: float, high: float) -> None:
    """Keep the geometric mean at 1: weights are relative, the horizon sets the scale."""
    log_mean = sum(math.log(w) for w in weights.values()) / len(weights)
    for name, weight in weights.items():
        weights[name] = min(max(weight / math.exp(log_mean), low), high)


def _session_of(request: RequestInfo):
    """Known sessions are ints; unknown ones become per-request tokens."""
    return request.session if request.session is not None else ("request", request.index)
