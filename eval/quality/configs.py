"""The configurations a sample is run under: which server, whether the cache is warmed first,
and the Tail-Replay per-request overrides."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sglang_ext.tail_replay import BACKEND_NAME, KV_MODES

STOCK, TAIL_REPLAY = "stock", BACKEND_NAME
BUDGETS = (0.025, 0.05, 0.1, 0.2)


@dataclass(frozen=True)
class EvalConfig:
    name: str
    server: str                      # STOCK or TAIL_REPLAY
    warm: bool                       # send the document with another question first
    overrides: dict | None = field(default=None, hash=False)  # custom_params.tail_replay
    budget: float | None = None
    kv_mode: str | None = None

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


CONFIGS: dict[str, EvalConfig] = {
    "full": EvalConfig("full", STOCK, warm=False),
    "stock": EvalConfig("stock", STOCK, warm=True),
    **{c.name: c for c in (_tail_replay(b, m) for m in KV_MODES for b in BUDGETS)},
}
DEFAULT_CONFIGS = tuple(CONFIGS)
BASELINE = "full"
#: any Tail-Replay budget by name: tr-<percent of the matched prefix>[-recompute], e.g. tr-0.5, tr-0
_TAIL_REPLAY_NAME = re.compile(r"tr-(\d+(?:\.\d+)?)(-recompute)?")
NAME_HELP = "full, stock, tr-<percent>[-recompute] (percent in [0, 100]; tr-0 replays nothing)"


def config_named(name: str) -> EvalConfig:
    """`full`, `stock`, or Tail-Replay at any budget: `tr-0.5` (0.5 %), `tr-10-recompute`, ..."""
    if name in CONFIGS:
        return CONFIGS[name]
    match = _TAIL_REPLAY_NAME.fullmatch(name)
    if match is None or float(match[1]) > 100:
        raise ValueError(f"unknown --configs name {name!r}; use {NAME_HELP}")
    return _tail_replay(float(match[1]) / 100, "recompute" if match[2] else "exact")


def report_order(config: EvalConfig) -> tuple:
    """full, stock, then Tail-Replay with exact KV by budget, then recomputed KV by budget."""
    if config.server == STOCK:
        return (0, config.warm, 0.0)
    return (1 + KV_MODES.index(config.kv_mode), 0, config.budget)


def parse_configs(text: str) -> list[EvalConfig]:
    """Comma-separated names -> configs; `full` is always included (it is the 100% reference)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    configs = [config_named(n) for n in [BASELINE, *names]]
    return list({c.name: c for c in configs}.values())
