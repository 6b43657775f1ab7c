"""Markdown tables and matplotlib plots of sweep results."""

from __future__ import annotations

from pathlib import Path

COLUMNS = (("policy", "policy", "{}"), ("block_hit_ratio", "block hit", "{:.4f}"),
           ("token_hit_ratio", "token hit", "{:.4f}"),
           ("prefill_tokens", "prefill tokens", "{:,}"), ("mean_ttft_s", "mean TTFT s", "{:.4f}"),
           ("p90_ttft_s", "p90 TTFT s", "{:.4f}"), ("ttft_speedup_vs_lru", "TTFT x vs LRU", "{:.2f}"),
           ("gap_closed", "LRU->Belady gap closed", "{}"),
           ("us_per_decision", "us/decision", "{:.1f}"))


MIN_GAP = 0.005  # below half a point of hit ratio the "gap closed" ratio is noise


def annotate(rows: list[dict]) -> list[dict]:
    """Add TTFT speed-up vs LRU and the fraction of the LRU-to-Belady hit gap closed."""
    by_key = {(r["trace"], r["capacity_fraction"], r["policy"]): r for r in rows}
    for row in rows:
        lru = by_key.get((row["trace"], row["capacity_fraction"], "lru"))
        opt = by_key.get((row["trace"], row["capacity_fraction"], "belady"))
        row["ttft_speedup_vs_lru"] = lru["mean_ttft_s"] / row["mean_ttft_s"] if lru else float("nan")
        row["gap_closed"] = _gap_closed(row, lru, opt)
    return rows


def _gap_closed(row, lru, opt) -> str:
    if not lru or not opt:
        return "n/a"
    gap = opt["block_hit_ratio"] - lru["block_hit_ratio"]
    if gap < MIN_GAP:
        return "gap < 0.5 pt"
    return f"{(row['block_hit_ratio'] - lru['block_hit_ratio']) / gap:+.0%}"


def markdown(rows: list[dict], header: dict) -> str:
    lines = ["# Trace-driven prefix-cache simulation", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    for trace in dict.fromkeys(r["trace"] for r in rows):
        lines += ["", f"## {trace}", ""]
        meta = next(r for r in rows if r["trace"] == trace)
        lines.append(f"distinct blocks: {meta['distinct_blocks']:,}; requests: {meta['requests']:,}; "
                     f"infinite-cache block hit ratio: {meta['infinite_hit_ratio']:.4f}")
        for cap in dict.fromkeys(r["capacity_fraction"] for r in rows if r["trace"] == trace):
            sub = [r for r in rows if r["trace"] == trace and r["capacity_fraction"] == cap]
            lines += ["", f"### capacity {cap:g} of distinct blocks ({sub[0]['capacity_blocks']:,} blocks)", ""]
            lines += _table(sub)
    return "\n".join(lines) + "\n"


def _table(rows: list[dict]) -> list[str]:
    out = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
           "|" + "---|" * len(COLUMNS)]
    for row in rows:
        out.append("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |")
    return out


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for policy in dict.fromkeys(r["policy"] for r in rows):
            sub = sorted((r for r in rows if r["trace"] == trace and r["policy"] == policy),
                         key=lambda r: r["capacity_fraction"])
            caps = [r["capacity_fraction"] for r in sub]
            axes[0].plot(caps, [r["block_hit_ratio"] for r in sub], marker="o", label=policy)
            axes[1].plot(caps, [r["mean_ttft_s"] for r in sub], marker="o", label=policy)
        for ax, label in zip(axes, ("block hit ratio", "modeled mean TTFT (s)")):
            ax.set_xscale("log")
            ax.set_xlabel("capacity (fraction of distinct blocks)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(trace)
        fig.tight_layout()
        path = out_dir / f"{trace.replace(':', '_').replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
