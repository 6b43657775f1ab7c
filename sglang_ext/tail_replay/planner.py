"""Decide, from token counts and bounds alone, how a prefix hit of L tokens is reused (pure,
deterministic).

Inputs: L (tokens whose attention KV is cached and may be read: in `exactness: "exact"` only the
strictly exact ones), C (depth of the deepest recurrent-state checkpoint on the matched path that
counts as exact, if any), A (depth and bound of the deepest approximate checkpoint, if any), the
grid a replayed tail starts on (the page; under SGLang's extra buffer its checkpoint grid, so that
the states the request tracks land where stock's do: `MatchPlanner.start_grid`), and the config.
Output: a ReplayPlan.

- EXACT_CHECKPOINT:       L - C <= W (or, with no approximate checkpoint to take, the window's
                          start cut to the grid is at most C): start from the checkpoint's state
                          at C, recompute [C, L).
                          `exactness: "exact_first"` (and "exact"): whenever C exists and the
                          window does not reach the first token (stock SGLang's hit, exact).
- APPROXIMATE_CHECKPOINT: A deeper than C, L - A <= W, and A's bound no worse than a fresh
                          replay's (the decay profile's d^W where the server has one, else any
                          bound: a replay from zero may drop the whole state, bound 1): resume from
                          the approximate state at A (a conversation's previous turn), recompute
                          [A, L); its bound decays on. Never in the exact mode.
- EXACT_REPLAY:           W >= L (on the grid): replay all of [0, L) from the zero state.
- APPROXIMATE:            replay the last W tokens [L - W, L) from a zero state (the start rounded
                          down to the grid: at least W tokens); older tokens are
                          dropped from the linear layers' state (their gates have mostly forgotten
                          them). Never in the exact mode (there: C, else a miss).
- MISS:                   L < min_match_tokens (or L = 0) and no checkpoint: compute everything.

`exactness: "exact_unless_pressed"` (tail_replay/pressure.py): a request whose arrival stamp names
no threshold is planned as in "exact"; a pressed one as in "approximate", and an approximate plan
keeps its place only if its certified bound (`planned_bound`: a fresh replay's d^W, an approximate
checkpoint's stored bound) is within the policy's tolerance. The plan says so (`pressure`:
"approximate" within the tolerance, "beyond_tolerance": the caller plans it again as "exact",
`exact_fallback`, and keeps the mark; "exact": pressed, and the plan was exact anyway).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from sglang_ext.tail_replay.config import AUTO, TailReplayConfig
from sglang_ext.tail_replay.decay_profile import certified_window
from sglang_ext.tail_replay.pressure import read_stamp

#: `ReplayPlan.pressure` of a pressed request: an approximate plan within the tolerance; an
#: approximate plan refused for its bound (the request is planned exactly); an exact plan anyway
UNDER_PRESSURE = ("approximate", "beyond_tolerance", "exact")


class HitKind(str, enum.Enum):
    EXACT_CHECKPOINT = "exact_checkpoint"
    EXACT_REPLAY = "exact_replay"
    APPROXIMATE = "approximate"
    APPROXIMATE_CHECKPOINT = "approximate_checkpoint"
    MISS = "miss"


@dataclass(frozen=True)
class ReplayPlan:
    kind: HitKind
    matched_tokens: int      # L: tokens whose attention KV the tree holds
    prefix_len: int          # tokens the request skips (SGLang's prefix length)
    replay_start: int        # first token of the replayed tail (== prefix_len)
    #: pressed requests (`exact_unless_pressed`): one of UNDER_PRESSURE; None otherwise
    pressure: str | None = None
    #: pressed requests' approximate plans: the certified state bound the tolerance was checked on
    planned_bound: float | None = None

    @property
    def replayed_tokens(self) -> int:
        """Matched tokens that go through the model again."""
        return self.matched_tokens - self.prefix_len if self.kind is not HitKind.MISS else 0

    @property
    def state_is_exact(self) -> bool:
        """Whether the request starts from a state that counts as exact (its own bound may still
        be a checkpoint's float-noise bound, carried on)."""
        return self.kind not in (HitKind.APPROXIMATE, HitKind.APPROXIMATE_CHECKPOINT)

    @property
    def from_checkpoint(self) -> bool:
        """Whether the request's state is copied from a tree checkpoint at `prefix_len`."""
        return self.kind in (HitKind.EXACT_CHECKPOINT, HitKind.APPROXIMATE_CHECKPOINT)

    @property
    def reuses_tail_kv(self) -> bool:
        """Whether there is a replayed tail [prefix_len, L) that may take its KV from the tree
        (a zero window, `budget: 0`, reuses all of L and replays nothing)."""
        return self.kind in (HitKind.APPROXIMATE, HitKind.EXACT_REPLAY) and self.replayed_tokens > 0


def replay_window(matched_len: int, config: TailReplayConfig) -> int:
    """W = clamp(ceil(budget * L), min_replay_tokens, max_replay_tokens); with budget "auto", the
    window the decay profile certifies for `tolerance` (none: max_replay_tokens), clamped alike."""
    if config.knobs.budget == AUTO:
        if config.server.profile is None:
            raise ValueError("budget 'auto' needs a decay profile (config.server.profile)")
        certified = certified_window(config.server.profile.decay(config.knobs.decay_percentile), config.knobs.tolerance)
        wanted = config.knobs.max_replay_tokens if certified is None else certified
    else:
        wanted = math.ceil(float(config.knobs.budget) * matched_len)
    return min(max(wanted, config.knobs.min_replay_tokens), config.knobs.max_replay_tokens)


def fresh_replay_bound(config: TailReplayConfig, window: int) -> float:
    """What a fresh replay of `window` tokens is expected to bound: d^W for the decay profile's
    slowest head at `decay_percentile`, or 1 (any bound) without a profile."""
    if config.server.profile is None:
        return 1.0
    decay = config.server.profile.decay(config.knobs.decay_percentile)
    return float(decay) ** window if decay < 1.0 else 1.0


def pressure_config(config: TailReplayConfig, custom_params: object) -> TailReplayConfig:
    """A request's config with its arrival stamp read (`pressed_by`), under `exact_unless_pressed`:
    the stamp the replica's first rank wrote is read, never the local load (every rank plans the
    same). Other modes, and requests without a stamp (fail closed), are left as they are."""
    if config.knobs.exactness != "exact_unless_pressed":
        return config
    return replace(config, pressed_by=read_stamp(custom_params))


def exact_fallback(config: TailReplayConfig) -> TailReplayConfig:
    """The config a pressed request whose approximate plan was beyond the tolerance is planned
    again with: "exact"'s planning (strict)."""
    return replace(config, pressed_by=())


def refused(exact_plan: ReplayPlan, approximate_plan: ReplayPlan) -> ReplayPlan:
    """The exact plan a pressed request took because `approximate_plan` was beyond the tolerance,
    marked so (the metrics and meta_info say why it stayed exact)."""
    return replace(exact_plan, pressure="beyond_tolerance", planned_bound=approximate_plan.planned_bound)


def planned_bound(plan: ReplayPlan, config: TailReplayConfig, approximate_checkpoint: tuple[int, float] | None) -> float:
    """The certified bound of an approximate plan's starting state, before its forward: an
    approximate checkpoint's stored bound, or a fresh replay's over its replayed tokens (1 without a
    decay profile: a replay from zero may drop the whole state)."""
    if plan.kind is HitKind.APPROXIMATE_CHECKPOINT and approximate_checkpoint is not None:
        return approximate_checkpoint[1]
    return fresh_replay_bound(config, plan.replayed_tokens)


def plan_replay(matched_len: int, checkpoint_len: int | None, grid: int,
                config: TailReplayConfig, approximate_checkpoint: tuple[int, float] | None = None) -> ReplayPlan:
    plan = _plan(matched_len, checkpoint_len, grid, config, approximate_checkpoint)
    if config.knobs.exactness != "exact_unless_pressed" or not config.pressed_by:
        return plan
    if plan.state_is_exact:
        return replace(plan, pressure="exact")
    assert config.server.pressure is not None   # config validation: "exact_unless_pressed" needs `pressure`
    bound = planned_bound(plan, config, approximate_checkpoint)
    verdict = "approximate" if bound <= config.server.pressure.tolerance else "beyond_tolerance"
    return replace(plan, pressure=verdict, planned_bound=bound)


def _plan(matched_len: int, checkpoint_len: int | None, grid: int,
          config: TailReplayConfig, approximate_checkpoint: tuple[int, float] | None) -> ReplayPlan:
    window = replay_window(matched_len, config)
    if checkpoint_len is not None and matched_len - checkpoint_len <= window:
        return ReplayPlan(HitKind.EXACT_CHECKPOINT, matched_len, checkpoint_len, checkpoint_len)
    if matched_len == 0 or matched_len < config.knobs.min_match_tokens:
        if checkpoint_len:
            return ReplayPlan(HitKind.EXACT_CHECKPOINT, matched_len, checkpoint_len, checkpoint_len)
        return ReplayPlan(HitKind.MISS, matched_len, 0, 0)
    start = max(matched_len - window, 0) // grid * grid
    if start == 0:   # the window, cut to the grid, reaches the first token: exact
        return ReplayPlan(HitKind.EXACT_REPLAY, matched_len, 0, 0)
    if config.strict or (config.exact_first and checkpoint_len):
        # no approximation where an exact state is on the path (exact_first), or at all (exact):
        # the exact checkpoint, recomputing the rest, or nothing
        if checkpoint_len:
            return ReplayPlan(HitKind.EXACT_CHECKPOINT, matched_len, checkpoint_len, checkpoint_len)
        return ReplayPlan(HitKind.MISS, matched_len, 0, 0)
    if approximate_checkpoint is not None:
        depth, bound = approximate_checkpoint
        if (checkpoint_len or 0) < depth <= matched_len and matched_len - depth <= window \
                and bound <= fresh_replay_bound(config, window):
            return ReplayPlan(HitKind.APPROXIMATE_CHECKPOINT, matched_len, depth, depth)
    if checkpoint_len and start <= checkpoint_len:   # the window, cut to the grid, reaches an exact state
        return ReplayPlan(HitKind.EXACT_CHECKPOINT, matched_len, checkpoint_len, checkpoint_len)
    return ReplayPlan(HitKind.APPROXIMATE, matched_len, start, start)
