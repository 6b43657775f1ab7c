"""Adaptation experiment: SAE learned on one synthetic mix, then run on a shifted mix.

* ``warm``: SAE state learned on mix A, learning continues on mix B;
* ``fresh``: SAE with default state on mix B;
* ``fixed``: SAE state learned on mix A, learning off (fixed-parameter variant);
* ``lru`` for reference. Every run on B starts with an empty cache.
"""

from __future__ import annotations

from sglang_ext.eviction import LRUPolicy, SAEConfig, SAEPolicy

from .simulate import prepare, replay
from .synthetic import SHIFTED_MIX, SyntheticSpec, WorkloadMix, generate


def run_adaptation(capacity_fraction: float, cost, seed: int = 0, hours: float = 1.0) -> list[dict]:
    trace_a = prepare(generate(SyntheticSpec(phases=((WorkloadMix(), 3600.0 * hours),), seed=seed)))
    trace_b = prepare(generate(SyntheticSpec(phases=((SHIFTED_MIX, 3600.0 * hours),), seed=seed + 1)))
    cap_a = max(1, int(capacity_fraction * trace_a.distinct_blocks))
    cap_b = max(1, int(capacity_fraction * trace_b.distinct_blocks))
    tuned = SAEPolicy()
    replay(trace_a, tuned, cap_a, cost, progress="learn on mix A")
    variants = {
        "sae fresh on B": SAEPolicy(),
        "sae warm (learned on A, keeps learning)": SAEPolicy(state=tuned.state),
        "sae fixed (learned on A, learning off)": SAEPolicy(SAEConfig(learning=False),
                                                            state=tuned.state),
        "sae fixed (defaults, learning off)": SAEPolicy(SAEConfig(learning=False)),
        "lru": LRUPolicy(),
    }
    rows = []
    for label, policy in variants.items():
        cache = replay(trace_b, policy, cap_b, cost, progress=label)
        rows.append({"variant": label, **cache.stats.summary()})
    fresh = rows[0]
    for row in rows:
        row["hit_vs_fresh"] = row["block_hit_ratio"] / fresh["block_hit_ratio"] - 1.0
        row["ttft_vs_fresh"] = row["mean_ttft_s"] / fresh["mean_ttft_s"] - 1.0
    return rows


def adaptation_markdown(rows: list[dict], capacity_fraction: float, command: str, source: str) -> str:
    lines = ["# SAE adaptation: learned on mix A, run on shifted mix B", "",
             f"- command: `{command}`", f"- cost model source: {source}",
             f"- capacity: {capacity_fraction:g} of mix B's distinct blocks", "",
             "| variant | block hit | vs fresh | mean TTFT s | TTFT vs fresh |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['block_hit_ratio']:.4f} | {r['hit_vs_fresh']:+.1%} | "
                     f"{r['mean_ttft_s']:.4f} | {r['ttft_vs_fresh']:+.1%} |")
    return "\n".join(lines) + "\n"
