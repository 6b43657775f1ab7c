"""A model's decay profile, and the replay window it certifies (`budget: "auto"`). Pure.

Replaying the tail [L - W, L) from a zero state instead of the exact state S(L - W) leaves an
error of exactly the tail's transition applied to S(L - W). Per head, its size is at most the
product of the tail's per-token decays times ||S(L - W)|| (GDN: ||exp(g_t)(I - beta_t k_t k_t^T)||
<= exp(g_t); Mamba-2: the factor is exp(A dt_t) exactly; `hybrid_kernels.replay_bound` and its
tests). If every token of every head decays by at most d, a window of
W = ceil(ln(tolerance) / ln(d)) tokens keeps that factor below `tolerance`.

The profile gives d: the per-token decay distribution of every linear layer and head, measured
offline on held-out text (`python -m eval.training.decay --model DIR` writes `DIR/decay.json`;
per head the percentiles `decay_p10`, `decay_p50`, `decay_p90` of exp(log-decay)). The window is
certified for the slowest head at the chosen percentile: with p90, 90 % of that head's tokens
decay at least that fast, so the bound is a statement about the profile's text, not a proof for
every request (the replay's own gates would give that; not measured at run time yet).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

#: the percentiles a profile gives per head (`decay_p<N>`)
PERCENTILES = (10, 50, 90)
#: the file a model folder carries (`python -m eval.training.decay` writes it)
PROFILE_FILE = "decay.json"


class DecayProfileError(ValueError):
    """A decay profile that cannot be used; names the file and the field."""


@dataclass(frozen=True)
class DecayProfile:
    source: str                    # the file it was read from
    #: percentile -> the largest per-token decay over every linear layer and head (in [0, 1])
    slowest: dict[int, float]
    heads: int                     # linear-layer heads the profile covers

    def decay(self, percentile: int) -> float:
        if percentile not in self.slowest:
            raise DecayProfileError(f"{self.source}: no decay_p{percentile} (has {sorted(self.slowest)})")
        return self.slowest[percentile]


def certified_window(decay: float, tolerance: float) -> int | None:
    """Fewest tokens W with decay**W <= tolerance; None if `decay` >= 1 (a head that does not
    forget: no window certifies it)."""
    if decay <= 0.0:
        return 0
    if decay >= 1.0:
        return None
    return max(0, math.ceil(math.log(tolerance) / math.log(decay)))


def window_bound(decay: float, window: int) -> float:
    """The bound a window of `window` tokens gives: decay**window (the relative state error)."""
    return decay ** window


def profile_from_dict(raw: object, source: str) -> DecayProfile:
    """Validate a decay.json document; DecayProfileError naming `source` and the field."""
    layers = raw.get("layers") if isinstance(raw, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise DecayProfileError(f"{source}: field 'layers' must be a non-empty object of layer -> heads")
    slowest = {p: 0.0 for p in PERCENTILES}
    heads = 0
    for layer, per_head in layers.items():
        if not isinstance(per_head, list) or not per_head:
            raise DecayProfileError(f"{source}: field 'layers.{layer}' must be a non-empty list of heads")
        for index, head in enumerate(per_head):
            for p in PERCENTILES:
                value = head.get(f"decay_p{p}") if isinstance(head, dict) else None
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                    raise DecayProfileError(f"{source}: field 'layers.{layer}[{index}].decay_p{p}' must be a "
                                            f"number in [0, 1], got {value!r}")
                slowest[p] = max(slowest[p], float(value))
            heads += 1
    return DecayProfile(source=source, slowest=slowest, heads=heads)


@functools.lru_cache(maxsize=8)
def load_profile(path: str) -> DecayProfile:
    """Read and validate a profile file (cached per path: read once per process)."""
    file = Path(path)
    if not file.is_file():
        raise DecayProfileError(f"decay profile {path} not found (write one with "
                                f"`python -m eval.training.decay --model MODEL_DIR`)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise DecayProfileError(f"decay profile {path} is not valid JSON: {exc}") from None
    return profile_from_dict(raw, path)


def default_profile_path(model_path: str) -> str | None:
    """`<model_path>/decay.json` when the model is a local folder that has one, else None."""
    candidate = Path(model_path) / PROFILE_FILE
    return str(candidate) if candidate.is_file() else None
