"""Decide, from token counts alone, how a prefix hit of L tokens is reused (pure, deterministic).

Inputs: L (tokens whose attention KV is cached), C (depth of the deepest exact recurrent-state
checkpoint on the matched path, if any), the page size, and the config. Output: a ReplayPlan.

- EXACT_CHECKPOINT: L - C <= W: start from the checkpoint's state at C, recompute [C, L) exactly.
- EXACT_REPLAY:     W >= L (in whole pages): replay all of [0, L) from the zero state, exact at 0.
- APPROXIMATE:      replay the last W tokens [L - W, L) from a zero state; older tokens are dropped
                    from the linear layers' state (their gates have mostly forgotten them).
- MISS:             L < min_match_tokens (or L = 0) and no checkpoint: compute everything.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from sglang_ext.tail_replay.config import AUTO, TailReplayConfig
from sglang_ext.tail_replay.decay_profile import certified_window


class HitKind(str, enum.Enum):
    EXACT_CHECKPOINT = "exact_checkpoint"
    EXACT_REPLAY = "exact_replay"
    APPROXIMATE = "approximate"
    MISS = "miss"


@dataclass(frozen=True)
class ReplayPlan:
    kind: HitKind
    matched_tokens: int      # L: tokens whose attention KV the tree holds
    prefix_len: int          # tokens the request skips (SGLang's prefix length)
    replay_start: int        # first token of the replayed tail (== prefix_len)

    @property
    def replayed_tokens(self) -> int:
        """Matched tokens that go through the model again."""
        return self.matched_tokens - self.prefix_len if self.kind is not HitKind.MISS else 0

    @property
    def state_is_exact(self) -> bool:
        return self.kind is not HitKind.APPROXIMATE

    @property
    def reuses_tail_kv(self) -> bool:
        """Whether there is a replayed tail [prefix_len, L) that may take its KV from the tree
        (a zero window, `budget: 0`, reuses all of L and replays nothing)."""
        return self.kind in (HitKind.APPROXIMATE, HitKind.EXACT_REPLAY) and self.replayed_tokens > 0


def replay_window(matched_len: int, config: TailReplayConfig) -> int:
    """W = clamp(ceil(budget * L), min_replay_tokens, max_replay_tokens); with budget "auto", the
    window the decay profile certifies for `tolerance` (none: max_replay_tokens), clamped alike."""
    if config.budget == AUTO:
        if config.profile is None:
            raise ValueError("budget 'auto' needs a decay profile (config.profile)")
        certified = certified_window(config.profile.decay(config.decay_percentile), config.tolerance)
        wanted = config.max_replay_tokens if certified is None else certified
    else:
        wanted = math.ceil(float(config.budget) * matched_len)
    return min(max(wanted, config.min_replay_tokens), config.max_replay_tokens)


def plan_replay(matched_len: int, checkpoint_len: int | None, page_size: int,
                config: TailReplayConfig) -> ReplayPlan:
    window = replay_window(matched_len, config)
    if checkpoint_len is not None and matched_len - checkpoint_len <= window:
        return ReplayPlan(HitKind.EXACT_CHECKPOINT, matched_len, checkpoint_len, checkpoint_len)
    if matched_len == 0 or matched_len < config.min_match_tokens:
        if checkpoint_len:
            return ReplayPlan(HitKind.EXACT_CHECKPOINT, matched_len, checkpoint_len, checkpoint_len)
        return ReplayPlan(HitKind.MISS, matched_len, 0, 0)
    start = max(matched_len - window, 0) // page_size * page_size
    if start == 0:   # the window, cut to whole pages, reaches the first token: exact
        return ReplayPlan(HitKind.EXACT_REPLAY, matched_len, 0, 0)
    return ReplayPlan(HitKind.APPROXIMATE, matched_len, start, start)
