"""The configurations a sample is run under: which server, whether the cache is warmed first,
and the Tail-Replay per-request overrides."""

from __future__ import annotations

from dataclasses import dataclass, field

STOCK, TAIL_REPLAY = "stock", "tail_replay"
BUDGETS = (0.025, 0.05, 0.1, 0.2)
KV_MODES = ("exact", "recompute")


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


def parse_configs(text: str) -> list[EvalConfig]:
    """Comma-separated names -> configs; `full` is always included (it is the 100% reference)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    return [CONFIGS[n] for n in dict.fromkeys(names)]
