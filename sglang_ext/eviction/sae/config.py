"""SAE's settings: ``SAEConfig`` (what a deployment may tune) and ``SAEAblation`` (switches
that turn design parts off or change them, for the experiments of docs/saecache.md
section 5). Both are frozen; a bad value raises ``SAEConfigError`` naming the key."""

from __future__ import annotations

import math
from dataclasses import dataclass


class SAEConfigError(ValueError):
    """A setting of ``SAEConfig`` / ``SAEAblation`` is out of range."""


def _check(ok: bool, owner: str, key: str, message: str) -> None:
    if not ok:
        raise SAEConfigError(f"{owner} key {key!r}: {message}")


@dataclass(frozen=True)
class SAEConfig:
    """User settings. The defaults are the design (docs/saecache.md, "Meta-parameters")."""

    #: False: learned parameters stay as initialised / warm-started (fixed-parameter variant)
    learning: bool = True
    #: median time to the next reference before any observation (seconds)
    prior_reuse_s: float = 30.0
    #: log-normal sigma before any observation
    prior_log_sigma: float = 1.5
    #: chance that an owner is referenced again at all, before any observation
    prior_reuse_prob: float = 0.5
    #: the log-normal fit is never more certain than this
    min_sigma: float = 0.5
    #: floor of the 1/n rate of the running moments
    min_stat_rate: float = 0.01
    #: floor of the 1/n rate of the eviction-rate estimate (residence time H)
    horizon_rate: float = 1e-3
    #: floor of the 1/n rate of the model's win rate against the LRU expert
    expert_rate: float = 0.01
    #: value *= (recompute cost per block) ** cost_power; 1: TTFT-optimal weighting
    #: (attention: deeper blocks cost more), 0: hit ratio
    cost_power: float = 0.5
    #: a session silent past this quantile (z-score) of its class's gap has ended
    silence_quantile_z: float = 2.33
    #: ghost / pending-duel capacity relative to cached entries
    ghost_factor: float = 1.0
    #: ... and at least this many
    min_ghosts: int = 256

    def __post_init__(self) -> None:
        name = "SAEConfig"
        _check(self.prior_reuse_s > 0 and math.isfinite(self.prior_reuse_s), name, "prior_reuse_s",
               f"must be a finite number > 0, got {self.prior_reuse_s}")
        _check(self.prior_log_sigma > 0, name, "prior_log_sigma", f"must be > 0, got {self.prior_log_sigma}")
        _check(0.0 <= self.prior_reuse_prob <= 1.0, name, "prior_reuse_prob",
               f"must be in [0, 1], got {self.prior_reuse_prob}")
        _check(self.min_sigma > 0, name, "min_sigma", f"must be > 0, got {self.min_sigma}")
        for key in ("min_stat_rate", "horizon_rate", "expert_rate"):
            value = getattr(self, key)
            _check(0.0 < value <= 1.0, name, key, f"must be in (0, 1], got {value}")
        _check(self.cost_power >= 0 and math.isfinite(self.cost_power), name, "cost_power",
               f"must be a finite number >= 0, got {self.cost_power}")
        _check(math.isfinite(self.silence_quantile_z), name, "silence_quantile_z",
               f"must be finite, got {self.silence_quantile_z}")
        _check(self.ghost_factor >= 0, name, "ghost_factor", f"must be >= 0, got {self.ghost_factor}")
        _check(self.min_ghosts >= 0, name, "min_ghosts", f"must be >= 0, got {self.min_ghosts}")


@dataclass(frozen=True)
class SAEAblation:
    """Design switches for experiments; the defaults are the design (version 3)."""

    #: follow LRU while the model loses the pairwise duels (False: policy ``sae-model``)
    use_lru_expert: bool = True
    #: weigh a duel by the blocks of the entry referenced first (False: 1 per duel)
    duel_stake_blocks: bool = True
    #: ... times (cost per block) ** this; None: ``SAEConfig.cost_power``
    duel_cost_power: float | None = None
    #: unresolved duels expire after this many residence times H
    duel_window: float = math.inf
    #: ... or beyond this many per ghost slot (FIFO)
    duel_cap_factor: int = 1
    #: H multiplier (1 = Little's law residence time)
    horizon_scale: float = 1.0
    #: > 0: per-session shift of the class's log gap (the session's pace)
    session_rate: float = 0.0
    #: split output states by log2 of the cached output size
    output_size_classes: bool = True
    #: a session that returns after being declared ended is learned: its gap enters the
    #: fit and its "ended" outcome is revoked
    late_returns: bool = True
    #: value per block-second held: g / expected time held (LHD-style); False: g alone (version 2)
    hit_density: bool = True

    def __post_init__(self) -> None:
        name = "SAEAblation"
        _check(self.duel_cost_power is None or self.duel_cost_power >= 0, name, "duel_cost_power",
               f"must be None or >= 0, got {self.duel_cost_power}")
        _check(self.duel_window > 0, name, "duel_window", f"must be > 0, got {self.duel_window}")
        _check(self.duel_cap_factor >= 0, name, "duel_cap_factor", f"must be >= 0, got {self.duel_cap_factor}")
        _check(self.horizon_scale > 0 and math.isfinite(self.horizon_scale), name, "horizon_scale",
               f"must be a finite number > 0, got {self.horizon_scale}")
        _check(0.0 <= self.session_rate <= 1.0, name, "session_rate",
               f"must be in [0, 1], got {self.session_rate}")
