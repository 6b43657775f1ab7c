"""The reuse-time model of one class: a log-normal fit of the time T to the next
reference, the chance rho that there is one at all, and the two scores built on them
(``soon``: g(a), ``hit_density``: g(a) per expected time held). Pure math on floats;
nothing here knows about entries, owners or caches."""

from __future__ import annotations

import math
from dataclasses import dataclass

SQRT2 = math.sqrt(2.0)


@dataclass
class ReuseTimeModel:
    """Running mean/variance of log re-reference time: a log-normal fit."""

    mu: float
    var: float
    n: int = 0
    min_sigma: float = 0.5

    def observe(self, seconds: float, min_rate: float) -> None:
        """One sample of T in seconds (floored at 1 ms). Mutates: mu, var, n."""
        self.observe_log(math.log(max(seconds, 1e-3)), min_rate)

    def observe_log(self, x: float, min_rate: float) -> None:
        """One sample of log T, at rate max(1/n, min_rate). Mutates: mu, var, n."""
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
        """The time at z standard deviations of log T."""
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
    """What is learned per class: the reuse-time fit and rho, the chance of any reuse."""

    reuse_time: ReuseTimeModel
    reuse_prob: float
    outcomes: int = 0

    def observe_outcome(self, reused: bool, min_rate: float) -> None:
        """One outcome (referenced again or not), at rate max(1/(n+1), min_rate).
        Mutates: reuse_prob, outcomes."""
        self.outcomes += 1
        rate = max(1.0 / (self.outcomes + 1), min_rate)
        self.reuse_prob += rate * (float(reused) - self.reuse_prob)

    def revoke_miss(self, min_rate: float) -> None:
        """Take back the last 0 outcome by the step it moved rho (the caller then
        observes the 1). Mutates: reuse_prob, outcomes."""
        step = max(1.0 / (self.outcomes + 1), min_rate)
        self.reuse_prob = min(self.reuse_prob / (1.0 - step), 1.0) if step < 1.0 else 1.0
        self.outcomes = max(self.outcomes - 1, 0)

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
