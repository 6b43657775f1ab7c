"""The retention table: fixed vs decay-certified budgets side by side, from a perplexity run and
(optionally) a RULER run of the same model (`python -m eval.quality retention`).

Per configuration, against full prefill on the same samples:
- replayed / reused tokens: mean over every perplexity sample (all document lengths pooled), and
  per length; a fixed budget replays a fraction of L, a decay-certified one the same window at any L;
- perplexity ratio per document length and pooled (exp of the mean NLL delta over every scored
  continuation token), and |delta| = mean |log p - log p_full| per continuation token (the
  perplexity path's drift: it also counts errors that cancel in the mean);
- RULER (when given): score, % of outputs identical to full prefill, logprob drift (`report`);
- LongBench-format (when given): % of outputs identical to full prefill, logprob drift, replayed
  tokens (its score is left out: the trained models score 0 on it, so only agreement reads).
"""

from __future__ import annotations

import math
from statistics import mean

from eval.quality import report
from eval.quality.configs import BASELINE, config_named, report_order


def perplexity_columns(rows: list[dict]) -> dict:
    """{config: {"replayed": .., "reused": .., "replayed_by_group": {g: ..}, "ppl_by_group": {g: ..},
    "abs_by_group": {g: ..}, "ppl_ratio": .., "abs_delta": .., "samples": n}}; configs against `full`
    on the same keys."""
    base = {r["key"]: r for r in rows if r["config"] == BASELINE}
    out: dict = {}
    for name in {r["config"] for r in rows}:
        mine = [r for r in rows if r["config"] == name and r["key"] in base]
        if not mine:
            continue
        groups = sorted({r["group"] for r in mine}, key=lambda g: float(g[:-1]))
        deltas = {r["key"]: [b - a for a, b in zip(r["logprobs"], base[r["key"]]["logprobs"], strict=True)] for r in mine}
        flat = [d for r in mine for d in deltas[r["key"]]]
        out[name] = {
            "samples": len(mine),
            "replayed": mean(r["replayed_tokens"] or 0 for r in mine),
            "reused": mean(r["cached_tokens"] for r in mine),
            "replayed_by_group": {g: mean(r["replayed_tokens"] or 0 for r in mine if r["group"] == g) for g in groups},
            "ppl_by_group": {g: math.exp(mean(d for r in mine if r["group"] == g for d in deltas[r["key"]]))
                             for g in groups},
            "abs_by_group": {g: mean(abs(d) for r in mine if r["group"] == g for d in deltas[r["key"]]) for g in groups},
            "ppl_ratio": math.exp(mean(flat)),
            "abs_delta": mean(abs(d) for d in flat),
        }
    return out


def ruler_columns(rows: list[dict]) -> dict:
    """{config: {"score": .., "agreement": .., "drift": .., "replayed": ..}} from `report.summarize` of
    a RULER or LongBench-format run: its first length group (one group expected)."""
    table = report.summarize(rows)
    if not table:
        return {}
    group = next(iter(table.values()))
    return {name: {"score": e["mean"], "agreement": e["agreement"], "drift": e["drift"], "replayed": e["replayed"]}
            for name, e in group.items()}


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def markdown(ppl_rows: list[dict], ruler_rows: list[dict] | None = None,
             longbench_rows: list[dict] | None = None) -> str:
    """The table, one row per perplexity configuration in report order; RULER / LongBench-format
    columns when their rows are given ("-" for a configuration the run lacks)."""
    ppl = perplexity_columns(ppl_rows)
    ruler = ruler_columns(ruler_rows or [])
    longbench = ruler_columns(longbench_rows or [])
    groups = sorted({g for e in ppl.values() for g in e["ppl_by_group"]}, key=lambda g: float(g[:-1]))
    head = ["config", "replayed tok (all)", *[f"replayed {g}" for g in groups], "reused tok (all)",
            *[f"ppl ratio {g}" for g in groups], "ppl ratio (all)", *[f"mean abs delta {g}" for g in groups],
            "mean abs delta (all, nats/tok)"]
    if ruler:
        head += ["RULER score", "RULER same output %", "RULER logprob drift", "RULER replayed"]
    if longbench:
        head += ["LongBench-format same output %", "LongBench-format logprob drift", "LongBench-format replayed"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name in sorted(ppl, key=lambda n: report_order(config_named(n))):
        e = ppl[name]
        cells = [name, f"{e['replayed']:.0f}", *[f"{e['replayed_by_group'].get(g, float('nan')):.0f}" for g in groups],
                 f"{e['reused']:.0f}", *[f"{e['ppl_by_group'].get(g, float('nan')):.4f}" for g in groups],
                 f"{e['ppl_ratio']:.4f}", *[f"{e['abs_by_group'].get(g, float('nan')):.2e}" for g in groups],
                 f"{e['abs_delta']:.2e}"]
        if ruler:
            r = ruler.get(name)
            cells += (["-"] * 4 if r is None else
                      [_fmt(r["score"], ".1f"), _fmt(r["agreement"], ".0f"), _fmt(r["drift"], ".4f"), _fmt(r["replayed"], ".0f")])
        if longbench:
            b = longbench.get(name)
            cells += (["-"] * 3 if b is None else
                      [_fmt(b["agreement"], ".1f"), _fmt(b["drift"], ".4f"), _fmt(b["replayed"], ".0f")])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
