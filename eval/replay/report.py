"""Per-server summaries of a replay, report.md and the plot (no SGLang, no HTTP).

A request record (one JSON line per request in `requests-<server>.jsonl`) has: `index`,
`session`, `prompt_tokens` (tokens sent), `ok`, `error`, `cached_tokens` (meta_info),
`tail_replay` (meta_info.cached_tokens_details.tail_replay or None), `ttft_s`, `latency_s`,
`output_ids` (the greedy output), `ideal_tokens`, `lru_bound_tokens`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from eval.replay.budget import GIB, split_table
from eval.replay.gpu_model import modeled_lines
from eval.replay.profile import profile_lines
from eval.replay.router import prediction_line


def read_requests(run: Path, index: int) -> list[dict]:
    """The per-request records of a run folder's `index`-th server (`requests-<index>-*.jsonl`,
    gzipped or not, as committed), in request order; ValueError unless exactly one file matches."""
    found = sorted(Path(run).glob(f"requests-{index}-*.jsonl*"))
    if len(found) != 1:
        raise ValueError(f"{run}: expected one per-request file of server {index}, found {[f.name for f in found]}")
    with (gzip.open if found[0].suffix == ".gz" else open)(found[0], "rt") as handle:
        return sorted((json.loads(line) for line in handle), key=lambda r: r["index"])


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def hit_kinds(records: Sequence[dict]) -> dict[str, int]:
    """Tail-Replay's own kind per request where the server reports one; otherwise `hit`
    (cached_tokens > 0) or `miss`. Failed requests count as `error`."""
    kinds: Counter[str] = Counter()
    for r in records:
        if not r["ok"]:
            kinds["error"] += 1
        elif r.get("tail_replay"):
            kinds[r["tail_replay"]["kind"]] += 1
        else:
            kinds["hit" if r["cached_tokens"] else "miss"] += 1
    return dict(sorted(kinds.items()))


def served_exactly(record: dict) -> bool:
    """Whether a request was served exactly: Tail-Replay's own `exact` where it reports one, else
    (a stock server, or a Tail-Replay miss before the field existed) True: stock SGLang reuses only
    exact states."""
    details = record.get("tail_replay")
    return bool(details.get("exact", details.get("kind") != "approximate")) if details else True


def exact_split(records: Sequence[dict]) -> dict[str, int]:
    ok = [r for r in records if r["ok"]]
    exact = sum(served_exactly(r) for r in ok)
    return {"exact": exact, "approximate": len(ok) - exact}


def compare_to_baseline(records: Sequence[dict], baseline: Sequence[dict]) -> dict:
    """Per request against a baseline server's records of the same requests (same order): of the
    requests the baseline hit (reused > 0), how many this server reused fewer tokens on, and how
    many it served approximately where the baseline served exactly (every stock hit is exact);
    TTFT p50 of both on those requests; replayed tokens per request."""
    hits = [(r, b) for r, b in zip(records, baseline) if r["ok"] and b["ok"] and b["cached_tokens"] > 0]
    ours = [r["ttft_s"] for r, _ in hits if r["ttft_s"] is not None]
    theirs = [b["ttft_s"] for _, b in hits if b["ttft_s"] is not None]
    return {
        "baseline_hits": len(hits),
        "reuse_below_baseline": sum(r["cached_tokens"] < b["cached_tokens"] for r, b in hits),
        "exact_hits_lost": sum(served_exactly(b) and not served_exactly(r) for r, b in hits),
        "ttft_p50_on_baseline_hits": percentile(ours, 50),
        "baseline_ttft_p50_on_its_hits": percentile(theirs, 50),
    }


def same_outputs(records: Sequence[dict], reference: Sequence[dict]) -> float | None:
    """Share of requests whose greedy output equals the reference server's (a server without a
    cache), over the requests both answered."""
    pairs = [(r, x) for r, x in zip(records, reference) if r["ok"] and x["ok"]]
    if not pairs:
        return None
    return sum(list(r.get("output_ids") or []) == list(x.get("output_ids") or []) for r, x in pairs) / len(pairs)


def summarize(label: str, records: Sequence[dict], ideal_total: int, lru_total: int,
              timing: dict) -> dict:
    """One server's row. `timing` carries `wall_s`, `machine_load`, `busy`, `timings_withheld`
    (a reason, or None) and the thread settings; TTFT statistics are left out when withheld."""
    ok = [r for r in records if r["ok"]]
    reused = sum(r["cached_tokens"] for r in ok)
    details = [r["tail_replay"] for r in ok if r.get("tail_replay")]
    ttfts = [r["ttft_s"] for r in ok]
    withheld = timing.get("timings_withheld")
    row = {
        "server": label,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "reused_tokens": reused,
        "ideal_tokens": ideal_total,
        "reuse_of_ideal": reused / ideal_total if ideal_total else None,
        "lru_bound_tokens": lru_total,
        "lru_bound_of_ideal": lru_total / ideal_total if ideal_total else None,
        "hit_kinds": hit_kinds(records),
        "matched_tokens": sum(d["matched_tokens"] for d in details) if details else None,
        "replayed_tokens": sum(d["replayed_tokens"] for d in details) if details else None,
        "exact_split": exact_split(records),
        **{k: v for k, v in timing.items() if k != "timings_withheld"},
        "timings_withheld": withheld,
    }
    if withheld is None and ttfts:
        row["ttft_s"] = {"mean": sum(ttfts) / len(ttfts), "p50": percentile(ttfts, 50),
                         "p95": percentile(ttfts, 95)}
    else:
        row["ttft_s"] = None
        row["wall_s"] = None
    return row


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _kinds(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in kinds.items())


def _background(row: dict) -> str:
    """The server's own background runs (exact repairs), after its hit kinds."""
    runs = row.get("background_runs") or {}
    return "; background: " + _kinds(runs) if runs else ""


def markdown_table(rows: Sequence[dict]) -> str:
    lines = ["| server | requests | errors | prompt tokens | reused tokens | of ideal | LRU bound (of ideal) "
             "| hit kinds | exact / approximate | replayed tokens | TTFT mean / p50 / p95 s | wall s "
             "| other CPU % before / during | threads |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["ttft_s"] is not None:
            t = r["ttft_s"]
            busy = " (busy)" if r.get("busy") else ""
            ttft = f"{t['mean']:.3f} / {t['p50']:.3f} / {t['p95']:.3f}{busy}"
            wall = f"{r['wall_s']:.1f}{busy}"
        else:
            ttft = wall = "withheld (busy)"
        load = r.get("machine_load") or {}
        replayed = "-" if r["replayed_tokens"] is None else f"{r['replayed_tokens']:,}"
        lines.append(
            f"| {r['server']} | {r['requests']} | {r['errors']} | {r['prompt_tokens']:,} | "
            f"{r['reused_tokens']:,} | {_pct(r['reuse_of_ideal'])} | {r['lru_bound_tokens']:,} "
            f"({_pct(r['lru_bound_of_ideal'])}) | {_kinds(r['hit_kinds'])}{_background(r)} | "
            f"{r['exact_split']['exact']} / {r['exact_split']['approximate']} | {replayed} | {ttft} | {wall} | "
            f"{load.get('other_cpu_percent', '-')} / {r.get('other_cpu_percent_during', '-')} | {_threads(r)} |")
    return "\n".join(lines)


def comparison_table(rows: Sequence[dict], baseline: str | None, reference: str | None) -> str:
    """Per-request comparison against the baseline server and output equality with the reference."""
    lines = [f"| server | baseline ({baseline or '-'}) hits | reused fewer tokens | exact hits lost | TTFT p50 on "
             f"those (server / baseline) s | replayed tokens per request | same output as {reference or '-'} |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r.get("vs_baseline") or {}
        p50 = c.get("ttft_p50_on_baseline_hits")
        base = c.get("baseline_ttft_p50_on_its_hits")
        ttft = "-" if p50 is None or base is None else f"{p50:.3f} / {base:.3f}"
        per_request = "-" if r["replayed_tokens"] is None else f"{r['replayed_tokens'] / max(r['requests'], 1):.1f}"
        same = r.get("same_output")
        lines.append(f"| {r['server']} | {c.get('baseline_hits', '-')} | {c.get('reuse_below_baseline', '-')} | "
                     f"{c.get('exact_hits_lost', '-')} | {ttft} | {per_request} | "
                     f"{'-' if same is None else _pct(same)} |")
    return "\n".join(lines)


def _threads(row: dict) -> str:
    load = row.get("machine_load") or {}
    omp = row.get("server_env", {}).get("OMP_NUM_THREADS")
    return f"OMP={omp or 'unset'}, server threads {row.get('server_threads', '-')}, cpus {load.get('cpu_count', '-')}"


def plot(path: Path, reuse: dict[str, Sequence[dict]], ttfts: dict[str, Sequence[float]],
         ideal: Sequence[int], lru: Sequence[int], title: str) -> Path:
    """Left: cumulative reused tokens vs request index (servers, ideal, LRU bound); right: TTFT
    CDF of the servers in `ttfts` (the caller leaves out servers whose timings were withheld)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(_cumsum(ideal), label="ideal (infinite cache)", color="black", linestyle="--")
    left.plot(_cumsum(lru), label="LRU bound (same KV pool)", color="gray", linestyle=":")
    for k, (label, records) in enumerate(reuse.items()):  # later servers thinner: overlaps stay visible
        left.plot(_cumsum([r["cached_tokens"] if r["ok"] else 0 for r in records]), label=label,
                  linewidth=max(3.5 - 1.0 * k, 1.0))
    for label, values in ttfts.items():
        xs = sorted(values)
        if xs:
            right.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    left.set(xlabel="request index", ylabel="cumulative reused tokens", title="reuse")
    right.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    left.legend(fontsize=8)
    if ttfts:
        right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def replay_title(info: dict, args) -> str:
    """One line: the trace, its scaling and the servers' pools (the plot's and report.md's title)."""
    workers = getattr(args, "workers", 1)
    cluster = f", {workers} workers behind the router ({args.router_policy})" if workers > 1 else ""
    gib = getattr(args, "equal_bytes_gib", None)
    pools = (f"equal bytes {gib:g} GiB of {args.bytes_model}" if gib is not None else
             f"KV pool {args.max_total_tokens:,}, {args.max_mamba_cache_size} state slots")
    return (f"{info['name']}: {info['requests']} requests, {info['tokens_per_block']} tokens/block, {pools}, "
            f"concurrency {args.concurrency}, {args.new_tokens} new token(s){cluster}")


def report_markdown(report: dict) -> str:
    """report.md of a replay, from its report.json."""
    info, refs = report["trace"], report["references"]
    load = report["start_load"]
    lines = [f"# Trace replay: {replay_title(info, argparse.Namespace(**report['options']))}", "",
             f"Command: `{report['command']}`", "",
             f"Trace: {info['path']} ({info['requests']} requests, {info['prompt_tokens']:,} prompt tokens, "
             f"longest {info['max_prompt_tokens']:,}"
             + (f", {info['sessions_in_replay']} of {info['sessions_loaded']} sessions present" if info["sessions_loaded"] else "")
             + f"). Ideal reuse {refs['ideal_tokens']:,} tokens; LRU bound at {refs['lru_capacity_tokens']:,} "
             f"tokens {refs['lru_bound_tokens']:,}.", "",
             f"Machine at start: load average {load['loadavg_1m']:.2f}, other processes {load['other_cpu_percent']}% "
             f"of {load['cpu_count']} CPUs, OMP_NUM_THREADS={load['omp_num_threads']}, client torch threads "
             f"{load['torch_threads']}.", "",
             markdown_table(report["servers"]), ""]
    split_rows = [r for r in report["servers"] if r.get("memory_split")]
    if split_rows:
        first = split_rows[0]["memory_split"]
        lines += [f"Memory split of each server (equal bytes: {first['budget_bytes'] / GIB:g} GiB of "
                  f"{first['model']}'s KV and state; the fixture gets the same slot and token counts):", "",
                  split_table(split_rows), ""]
    lines += modeled_lines(report)
    options = report["options"]
    if options.get("baseline") or options.get("reference"):
        lines += [comparison_table(report["servers"], options.get("baseline"), options.get("reference")), ""]
    for row in report["servers"]:
        if row.get("open_loop"):
            ol = row["open_loop"]
            lines.append(f"- {row['server']}: open loop at {ol['rate_per_s']:g} requests/s: "
                         f"{ol['share_within_slo']:.1%} within the {ol['slo_s']:g} s TTFT SLO, CPU goodput "
                         f"{ol['goodput_per_s']:.2f}/s (client send lag up to {ol['max_send_lag_s'] * 1e3:.0f} ms)")
        if row.get("worker_prompt_tokens"):
            tokens = row["worker_prompt_tokens"]
            lines.append(f"- {row['server']}: prompt tokens per worker (router {row['router_policy']}) "
                         + ", ".join(f"{t:,} ({t / max(sum(tokens), 1):.0%})" for t in tokens))
        if (row.get("router_prediction") or {}).get("decisions"):   # round-robin decides on no tree
            lines.append(prediction_line(row["server"], row["router_prediction"]))
        if row["timings_withheld"]:
            lines.append(f"- {row['server']}: timings withheld, {row['timings_withheld']}")
        elif row["busy"]:
            lines.append(f"- {row['server']}: timed on a busy machine (--allow-busy): other processes "
                         f"{row['machine_load']['other_cpu_percent']}% before, "
                         f"{row['other_cpu_percent_during']}% during the replay")
    lines += profile_lines(report["servers"], options.get("baseline"))
    return "\n".join(lines) + "\n"
