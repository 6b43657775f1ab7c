"""What SAE learns and how: the per-class fits (``SAEState.classes``), the residence time
H from the eviction rate (Little's law) and the ghost list that turns re-references of
evicted entries into samples. ``Learner`` owns ``SAEState``; every method states what it
mutates. ``version`` counts changes of the fits (the scorer's memo key)."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from ..base import Key
from .config import SAEConfig
from .keys import ReuseClass
from .reuse_model import ClassStats, ReuseTimeModel


@dataclass
class SAEState:
    """Everything SAE learns; ``snapshot`` copies it to warm-start another instance."""

    classes: dict[ReuseClass, ClassStats] = field(default_factory=dict)
    horizon_s: float = 30.0  # mean block residence time (Little's law)
    evict_dt_ew: float = 0.0  # running sums: seconds between evictions / blocks evicted
    evict_blocks_ew: float = 0.0
    evictions: int = 0
    model_win_rate: float = 0.5  # cost-weighted share of resolved disagreements the model won
    duels: int = 0
    duel_win_ew: float = 0.0  # running sums behind model_win_rate
    duel_weight_ew: float = 0.0

    def snapshot(self) -> SAEState:
        classes = {k: ClassStats(replace(v.reuse_time), v.reuse_prob, v.outcomes)
                   for k, v in self.classes.items()}
        return replace(self, classes=classes)


@dataclass(frozen=True)
class Ghost:
    """An evicted entry remembered: the class it was evicted from and its last access."""

    klass: ReuseClass
    t_last: float


class Learner:
    """The fits per class, H, and the ghost list."""

    def __init__(self, config: SAEConfig, state: SAEState) -> None:
        self.config, self.state = config, state
        self.version = 0  # bumped whenever a fit may have changed
        self.cached_blocks = 0  # blocks cached now (kept up to date by the policy)
        self.last_evict_t: float | None = None
        self._ghosts: OrderedDict[Key, Ghost] = OrderedDict()

    # ----- the fits -------------------------------------------------------------
    def stats(self, klass: ReuseClass) -> ClassStats:
        """The learned stats of ``klass``, created from the priors on first use (a class
        split by output size starts at offset 0). Mutates: ``state.classes`` (insert only)."""
        found = self.state.classes.get(klass)
        if found is None:
            cfg = self.config
            mu = 0.0 if isinstance(klass[1], tuple) else math.log(cfg.prior_reuse_s)
            model = ReuseTimeModel(mu=mu, var=cfg.prior_log_sigma ** 2, min_sigma=cfg.min_sigma)
            found = self.state.classes[klass] = ClassStats(model, cfg.prior_reuse_prob)
        return found

    def reuse_model(self, klass: ReuseClass) -> ReuseTimeModel:
        """Reuse-time model of ``klass``. A state split by output size stores only its
        offset from the type's model, so it follows when the type's model moves. Returns
        a fresh object for split classes (do not mutate it). Mutates: as ``stats``."""
        queue, state = klass
        if not isinstance(state, tuple):
            return self.stats(klass).reuse_time
        base, offset = self.stats(ReuseClass(queue, state[0])).reuse_time, self.stats(klass).reuse_time
        return ReuseTimeModel(mu=base.mu + offset.mu, var=offset.var, n=offset.n,
                              min_sigma=offset.min_sigma)

    def observe_gap(self, klass: ReuseClass, gap: float | None, returned: bool) -> None:
        """A session of ``klass`` returned after ``gap`` s (or ended: ``returned`` False).
        A split class learns its offset from the type's model, which learns the gap too.
        Mutates: the stats of ``klass`` and its base class."""
        rate = self.config.min_stat_rate
        queue, state = klass
        fine = self.stats(klass)
        if isinstance(state, tuple):
            base = self.stats(ReuseClass(queue, state[0]))
            if returned:
                assert gap is not None, "a returned session has a gap"
                x = math.log(gap)
                base.reuse_time.observe_log(x, rate)
                fine.reuse_time.observe_log(x - base.reuse_time.mu, rate)
            base.observe_outcome(returned, rate)
        elif returned:
            assert gap is not None, "a returned session has a gap"
            fine.reuse_time.observe(gap, rate)
        fine.observe_outcome(returned, rate)

    def revoke_ended(self, klass: ReuseClass) -> None:
        """A session declared ended came back: its 0 outcome was wrong. Without this, the
        gaps beyond the silence quantile are never observed (they are censored by the
        verdict itself), so the fit keeps a too-thin tail and a too-low rho, and the
        sessions that take longest (a long tool run, a sub-agent) are evicted as "ended".
        The 0 is taken back by the step it moved rho; ``observe_gap`` then counts the 1.
        Mutates: the stats of ``klass`` and its base class."""
        rate = self.config.min_stat_rate
        queue, state = klass
        revoked = [self.stats(klass)]
        if isinstance(state, tuple):
            revoked.append(self.stats(ReuseClass(queue, state[0])))
        for stats in revoked:
            stats.revoke_miss(rate)

    def learn_reference(self, klass: ReuseClass, elapsed: float) -> None:
        """An entry of ``klass`` was referenced ``elapsed`` s after its last access.
        Mutates (when learning): the stats of ``klass``, ``version``."""
        if not self.config.learning:
            return
        self.version += 1
        stats = self.stats(klass)
        stats.reuse_time.observe(elapsed, self.config.min_stat_rate)
        stats.observe_outcome(True, self.config.min_stat_rate)

    # ----- the residence time H -------------------------------------------------
    def learn_eviction(self, blocks: int, now: float) -> None:
        """``blocks`` were evicted at ``now``: H = cached blocks * seconds per evicted
        block (running sums). Mutates: ``cached_blocks``, ``last_evict_t`` and (when
        learning) the eviction sums and ``horizon_s`` of the state."""
        self.cached_blocks -= blocks
        state = self.state
        if self.last_evict_t is None:
            self.last_evict_t = now
        dt, self.last_evict_t = now - self.last_evict_t, now
        if not self.config.learning:
            return
        state.evictions += 1
        keep = 1.0 - max(1.0 / state.evictions, self.config.horizon_rate)
        state.evict_dt_ew = keep * state.evict_dt_ew + dt
        state.evict_blocks_ew = keep * state.evict_blocks_ew + blocks
        if state.evict_dt_ew > 0 and state.evict_blocks_ew > 0:
            per_block = state.evict_dt_ew / state.evict_blocks_ew
            state.horizon_s = max(self.cached_blocks + blocks, 1) * per_block

    # ----- ghosts ---------------------------------------------------------------
    def remember(self, key: Key, klass: ReuseClass, t_last: float) -> None:
        """``key`` was evicted from ``klass``; remember it (newest last). Mutates: ghosts."""
        self._ghosts.pop(key, None)
        self._ghosts[key] = Ghost(klass, t_last)

    def ghost_feedback(self, key: Key, t_return: float) -> None:
        """``key`` is cached again at ``t_return``: if it was a ghost of a non-session
        class, its reuse time is a sample (session gaps are observed exactly at every
        request). Mutates: ghosts, and as ``learn_reference``."""
        ghost = self._ghosts.pop(key, None)
        if ghost is None or not self.config.learning or ghost.klass[0] == "session":
            return
        self.learn_reference(ghost.klass, t_return - ghost.t_last)

    def trim_ghosts(self, cached_entries: int) -> int:
        """Forget the oldest ghosts beyond the ghost capacity; each is a "not reused"
        outcome of its class. Returns the capacity. Mutates: ghosts, class stats, ``version``."""
        limit = max(self.config.min_ghosts, int(self.config.ghost_factor * cached_entries))
        while len(self._ghosts) > limit:
            _, ghost = self._ghosts.popitem(last=False)
            if self.config.learning and ghost.klass[0] != "session":
                self.version += 1
                self.stats(ghost.klass).observe_outcome(False, self.config.min_stat_rate)
        return limit
