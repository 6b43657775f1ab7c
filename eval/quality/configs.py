"""The configurations a sample is run under: which server, whether the cache is warmed first,
and the Tail-Replay per-request overrides.

Tail-Replay at a fixed budget: `tr-<percent>[-recompute]` (W = percent x the matched prefix).
Decay-certified budget: `tr-auto-<tolerance>[-p<percentile>][-recompute]` (per-request
`budget: "auto"`: W = the window the model's decay profile certifies for `tolerance` at the
slowest head's `percentile`, default 90; the server needs the model's decay.json).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sglang_ext.tail_replay import AUTO, BACKEND_NAME, KV_MODES, PERCENTILES

STOCK, TAIL_REPLAY = "stock", BACKEND_NAME
BUDGETS = (0.025, 0.05, 0.1, 0.2)


@dataclass(frozen=True)
class EvalConfig:
    name: str
    server: str                      # STOCK or TAIL_REPLAY
    warm: bool                       # send the document with another question first
    overrides: dict | None = field(default=None, hash=False)  # custom_params.tail_replay
    budget: float | str | None = None    # a fraction of the matched prefix, or AUTO
    kv_mode: str | None = None
    tolerance: float | None = None       # AUTO: the certified relative state-error bound
    decay_percentile: int | None = None  # AUTO: the slowest head's decay percentile the bound uses

    @property
    def auto(self) -> bool:
        """A decay-certified budget (`budget: "auto"`)."""
        return self.budget == AUTO

    @property
    def must_hit(self) -> bool:
        """Tail-Replay configurations are only meaningful when the request reused the cache."""
        return self.server == TAIL_REPLAY

    @property
    def must_miss(self) -> bool:
        return not self.warm


def _tail_replay(budget: float, kv_mode: str) -> EvalConfig:
    suffix = "" if kv_mode == "exact" else "-recompute"
    overrides = {"budget": budget, "kv_mode": kv_mode, "min_replay_tokens": 0}
    return EvalConfig(f"tr-{budget * 100:g}{suffix}", TAIL_REPLAY, True, overrides, budget, kv_mode)


def _auto(tolerance: float, percentile: int, kv_mode: str) -> EvalConfig:
    """Decay-certified budget; the name leaves out the default percentile (90)."""
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"tr-auto tolerance must be in (0, 1), got {tolerance:g}")
    if percentile not in PERCENTILES:
        raise ValueError(f"tr-auto percentile must be one of {', '.join(f'p{p}' for p in PERCENTILES)}, got p{percentile}")
    name = f"tr-auto-{tolerance:g}" + ("" if percentile == AUTO_PERCENTILE else f"-p{percentile}")
    name += "" if kv_mode == "exact" else "-recompute"
    overrides = {"budget": AUTO, "tolerance": tolerance, "decay_percentile": percentile, "kv_mode": kv_mode,
                 "min_replay_tokens": 0}
    return EvalConfig(name, TAIL_REPLAY, True, overrides, AUTO, kv_mode, tolerance, percentile)


CONFIGS: dict[str, EvalConfig] = {
    "full": EvalConfig("full", STOCK, warm=False),
    "stock": EvalConfig("stock", STOCK, warm=True),
    **{c.name: c for c in (_tail_replay(b, m) for m in KV_MODES for b in BUDGETS)},
}
DEFAULT_CONFIGS = tuple(CONFIGS)
BASELINE = "full"
#: the percentile a tr-auto name without -p<N> uses (the server's default)
AUTO_PERCENTILE = 90
#: any Tail-Replay budget by name: tr-<percent of the matched prefix>[-recompute], e.g. tr-0.5, tr-0
_TAIL_REPLAY_NAME = re.compile(r"tr-(\d+(?:\.\d+)?)(-recompute)?")
_AUTO_NAME = re.compile(r"tr-auto-(\d*\.?\d+(?:e-?\d+)?)(?:-p(\d+))?(-recompute)?")
NAME_HELP = ("full, stock, tr-<percent>[-recompute] (percent in [0, 100]; tr-0 replays nothing), "
             "tr-auto-<tolerance>[-p<10|50|90>][-recompute] (decay-certified window; needs the model's decay.json)")


def config_named(name: str) -> EvalConfig:
    """`full`, `stock`, Tail-Replay at any budget: `tr-0.5` (0.5 %), `tr-10-recompute`, ..., or
    decay-certified: `tr-auto-0.01` (tolerance 0.01 at p90), `tr-auto-0.5-p10-recompute`, ..."""
    if name in CONFIGS:
        return CONFIGS[name]
    auto = _AUTO_NAME.fullmatch(name)
    if auto is not None:
        percentile = int(auto[2]) if auto[2] else AUTO_PERCENTILE
        return _auto(float(auto[1]), percentile, "recompute" if auto[3] else "exact")
    match = _TAIL_REPLAY_NAME.fullmatch(name)
    if match is None or float(match[1]) > 100:
        raise ValueError(f"unknown --configs name {name!r}; use {NAME_HELP}")
    return _tail_replay(float(match[1]) / 100, "recompute" if match[2] else "exact")


def report_order(config: EvalConfig) -> tuple:
    """full, stock, then Tail-Replay with exact KV by budget then decay-certified (by percentile,
    loosest tolerance first), then the same with recomputed KV."""
    if config.server == STOCK:
        return (0, config.warm, 0.0, 0.0)
    if config.auto:
        return (1 + KV_MODES.index(config.kv_mode), 1, config.decay_percentile, -config.tolerance)
    return (1 + KV_MODES.index(config.kv_mode), 0, config.budget, 0.0)


def parse_configs(text: str) -> list[EvalConfig]:
    """Comma-separated names -> configs; `full` is always included (it is the 100% reference)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    configs = [config_named(n) for n in [BASELINE, *names]]
    return list({c.name: c for c in configs}.values())
