"""Summary of a run: score per configuration / length group / dataset, "% of full-prefill
quality" per configuration, and a plot of retention vs replay budget.

Retention of a configuration = its mean score / the full-prefill mean score on the same
samples, x100 (means over datasets of per-dataset means, as LongBench / RULER average). A warm
configuration whose requests reused nothing has no retention ("n/a: no reuse").
Agreement = % of samples whose greedy output is identical to the full-prefill output: stricter
than retention, and meaningful even where the model scores poorly on the task.
Drift = mean |log p(token) - log p_full(token)| over the generated tokens a sample shares with
its full-prefill output (up to the first different token): how far the reused state moved the
model's distribution, also when the greedy output did not change.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

from eval.quality.configs import BASELINE, config_named, report_order


def _mean_over_datasets(rows: list[dict]) -> float:
    by_dataset = defaultdict(list)
    for r in rows:
        by_dataset[r["dataset"]].append(r["score"])
    return mean(mean(v) for v in by_dataset.values())


def summarize(rows: list[dict]) -> dict:
    """{group: {config: {dataset: score, "mean": .., "retention": .., "reused": .., "replayed": ..}}}"""
    table: dict = {}
    groups = sorted({r["group"] for r in rows}, key=lambda g: (len(g), g))
    for group in groups:
        in_group = [r for r in rows if r["group"] == group]
        keys = {r["key"] for r in in_group if r["config"] == BASELINE}
        base = [r for r in in_group if r["config"] == BASELINE]
        base_mean = _mean_over_datasets(base) if base else None
        table[group] = {}
        for name in sorted({r["config"] for r in in_group}, key=lambda n: report_order(config_named(n))):
            rows_c = [r for r in in_group if r["config"] == name and r["key"] in keys]
            if not rows_c:
                continue
            entry = {d: round(mean(r["score"] for r in rows_c if r["dataset"] == d), 2)
                     for d in sorted({r["dataset"] for r in rows_c})}
            entry["mean"] = round(_mean_over_datasets(rows_c), 2)
            entry["samples"] = len(rows_c)
            entry["reused"] = round(mean(r["cached_tokens"] for r in rows_c), 1)
            entry["replayed"] = round(mean(r["replayed_tokens"] or 0 for r in rows_c), 1)
            entry["retention"] = _retention(name, entry, base_mean)
            entry["agreement"] = _agreement(rows_c, base)
            entry["drift"] = _drift(rows_c, base)
            table[group][name] = entry
    return table


def _agreement(rows: list[dict], base: list[dict]) -> float:
    reference = {r["key"]: r["prediction"] for r in base}
    return round(100.0 * mean(r["prediction"] == reference[r["key"]] for r in rows), 1)


def logprob_drift(row: dict, reference: dict) -> float | None:
    """Mean |delta log p| over the shared leading output tokens; None if none are shared."""
    shared = 0
    for a, b in zip(row["output_ids"], reference["output_ids"]):
        if a != b:
            break
        shared += 1
    if shared == 0:
        return None
    diffs = (abs(x - y) for x, y in zip(row["output_logprobs"][:shared], reference["output_logprobs"][:shared]))
    return sum(diffs) / shared


def _drift(rows: list[dict], base: list[dict]) -> float | str:
    reference = {r["key"]: r for r in base}
    if not all("output_ids" in r for r in [*rows, *base]):
        return "n/a"   # rows written before output log-probabilities were recorded
    drifts = [d for r in rows if (d := logprob_drift(r, reference[r["key"]])) is not None]
    return round(mean(drifts), 5) if drifts else "n/a"


def _retention(name: str, entry: dict, base_mean: float | None):
    if name != BASELINE and config_named(name).warm and entry["reused"] == 0:
        return "n/a: no reuse"
    if not base_mean:
        return "n/a: full-prefill score is 0"
    return round(100.0 * entry["mean"] / base_mean, 1)


def markdown(table: dict) -> str:
    out = []
    for group, configs in table.items():
        datasets = sorted({k for e in configs.values() for k in e} - {"mean", "samples", "reused", "replayed", "retention",
                                                                     "agreement", "drift"})
        out.append(f"### {group}\n")
        out.append("| config | " + " | ".join(datasets) + " | mean | % of full | same output as full (%) | logprob drift | reused tok | replayed tok | n |")
        out.append("|---|" + "---:|" * (len(datasets) + 7))
        for name, e in configs.items():
            cells = [f"{e.get(d, float('nan')):.1f}" for d in datasets]
            ret = e["retention"] if isinstance(e["retention"], str) else f"{e['retention']:.1f}"
            drift = e["drift"] if isinstance(e["drift"], str) else f"{e['drift']:.4f}"
            out.append(f"| {name} | " + " | ".join(cells) + f" | {e['mean']:.1f} | {ret} | {e['agreement']:.1f} | {drift} "
                       f"| {e['reused']:.0f} | {e['replayed']:.0f} | {e['samples']} |")
        out.append("")
    return "\n".join(out)


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for group, configs in table.items():
        for mode, style in (("exact", "-o"), ("recompute", "--s")):
            points = sorted((config_named(n).budget * 100, e["retention"]) for n, e in configs.items()
                            if config_named(n).kv_mode == mode and not config_named(n).auto and not isinstance(e["retention"], str))
            if points:
                ax.plot(*zip(*points), style, label=f"{group} Tail-Replay, {mode} KV")
    ax.axhline(100, color="gray", lw=0.8)
    ax.set_xlabel("replay budget (% of the matched prefix)")
    ax.set_ylabel("% of full-prefill quality")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.set_title("no retention to plot (full-prefill score 0 or no reuse)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict], out_dir: Path) -> str:
    table = summarize(rows)
    (out_dir / "summary.json").write_text(json.dumps(table, indent=2))
    text = markdown(table)
    (out_dir / "summary.md").write_text(text)
    plot(table, out_dir / "retention.png")
    return text
