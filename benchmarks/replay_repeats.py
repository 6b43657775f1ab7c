"""Repeated `python -m eval.replay` runs of the same servers, compared with a baseline per run and
summed up as medians (every load comparison needs repetitions: the median of three interleaved
runs).

    .venv/bin/python -m benchmarks.replay_repeats --runs docs/results/replay-leisure-{1,2,3} \
        --baseline stock --out docs/results/replay-leisure-summary

Per run and server, against the baseline server of the same run, request by request:
throughput (requests / wall s) and its ratio; TTFT p50 of both on the requests where both reused
the same number of tokens, and its ratio; scheduler CPU per request and its ratio; reuse of ideal;
exact hits of the baseline's lost; answers that read only exact KV and state (`kv_exact`; stock's
answers all do); under `exact_unless_pressed`, answers pressed and approximate. Then the median of
each over the runs that have the server. Reads each run's report.json and per-request
requests-*.jsonl(.gz); writes summary.json and summary.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from eval.replay.report import percentile, read_requests

METRICS = ("throughput_rps", "throughput_x", "ttft_p50_same_reuse_s", "baseline_ttft_p50_same_reuse_s",
           "ttft_p50_same_reuse_x", "scheduler_cpu_ms", "scheduler_cpu_x", "reuse_of_ideal", "exact_hits_lost",
           "kv_exact", "approximate", "pressed", "pressed_approximate", "same_output", "modeled_gpu_ttft_mean_s",
           "modeled_gpu_ttft_mean_x")


def records(run: Path, index: int, label: str) -> list[dict]:
    """The per-request records of the run's `index`-th server (`label`)."""
    try:
        return read_requests(run, index)
    except ValueError as err:
        raise SystemExit(f"{err} ({label})") from None


def kv_exact(record: dict) -> bool:
    detail = record.get("tail_replay")
    if detail is None:
        return True
    return bool(detail.get("kv_exact", detail.get("exact") and detail.get("bound") == 0))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def compare(row: dict, recs: list[dict], base_row: dict, base: list[dict]) -> dict:
    """One server of one run against the run's baseline (the module docstring's metrics)."""
    same = [(r, b) for r, b in zip(recs, base) if r["ok"] and b["ok"] and r["cached_tokens"] == b["cached_tokens"]]
    ours, theirs = percentile([r["ttft_s"] for r, _ in same], 50), percentile([b["ttft_s"] for _, b in same], 50)
    rps = len([r for r in recs if r["ok"]]) / row["wall_s"] if row.get("wall_s") else None
    base_rps = len([b for b in base if b["ok"]]) / base_row["wall_s"] if base_row.get("wall_s") else None
    cpu = (row.get("process_cpu_ms_per_request") or {}).get("sglang::scheduler")
    base_cpu = (base_row.get("process_cpu_ms_per_request") or {}).get("sglang::scheduler")
    pressure = [(r.get("tail_replay") or {}).get("pressure") for r in recs if r["ok"]]
    details = [r.get("tail_replay") or {} for r in recs if r["ok"]]
    return {
        "throughput_rps": rps, "throughput_x": rps / base_rps if rps and base_rps else None,
        "same_reuse_requests": len(same), "ttft_p50_same_reuse_s": ours, "baseline_ttft_p50_same_reuse_s": theirs,
        "ttft_p50_same_reuse_x": ours / theirs if ours and theirs else None,
        "scheduler_cpu_ms": cpu, "scheduler_cpu_x": cpu / base_cpu if cpu and base_cpu else None,
        "reuse_of_ideal": row["reuse_of_ideal"],
        "exact_hits_lost": (row.get("vs_baseline") or {}).get("exact_hits_lost"),
        "kv_exact": sum(kv_exact(r) for r in recs if r["ok"]),
        "approximate": sum(d.get("exact") is False for d in details),
        "pressed": sum(bool(p and p.get("pressed_by")) for p in pressure),
        "pressed_approximate": sum(bool(p and p.get("pressed_by")) and d.get("exact") is False
                                   for p, d in zip(pressure, details)),
        "same_output": row.get("same_output"),
        "modeled_gpu_ttft_s": row.get("modeled_gpu_ttft_s"),
        "modeled_gpu_ttft_mean_s": (row.get("modeled_gpu_ttft_s") or {}).get("mean"),
        "modeled_gpu_ttft_mean_x": _ratio((row.get("modeled_gpu_ttft_s") or {}).get("mean"),
                                          (base_row.get("modeled_gpu_ttft_s") or {}).get("mean")),
        "memory_split": row.get("memory_split"),
    }


def summarize(runs: list[Path], baseline: str, alias: dict[str, str] | None = None,
              servers: list[str] | None = None) -> dict:
    """`alias`: a run's label -> the label it is summed up under (e.g. a sweep's `tr@16ckpt` -> `tr`);
    `servers`: only these labels (after aliasing), the baseline always."""
    alias = alias or {}
    per_run: dict[str, dict[str, dict]] = {}
    for run in runs:
        report = json.loads((run / "report.json").read_text())
        rows = report["servers"]
        labels = [r["server"] for r in rows]
        if baseline not in labels:
            raise SystemExit(f"{run}: no server labelled {baseline!r} ({labels})")
        order = {r["server"]: i for i, r in enumerate(rows)}
        base_row = rows[order[baseline]]
        base = records(run, order[baseline], baseline)
        per_run[str(run)] = {alias.get(r["server"], r["server"]): compare(r, records(run, order[r["server"]], r["server"]),
                                                                         base_row, base)
                             for r in rows if servers is None or alias.get(r["server"], r["server"]) in {*servers, baseline}}
    servers = list(dict.fromkeys(s for run in per_run.values() for s in run))
    medians = {}
    for server in servers:
        rows = [run[server] for run in per_run.values() if server in run]
        medians[server] = {"runs": len(rows)}
        for metric in METRICS:
            values = [r[metric] for r in rows if r[metric] is not None]
            medians[server][metric] = statistics.median(values) if values else None
    return {"baseline": baseline, "runs": [str(r) for r in runs], "per_run": per_run, "median": medians}


def markdown(summary: dict) -> str:
    cols = ("runs", "throughput_x", "ttft_p50_same_reuse_x", "scheduler_cpu_x", "reuse_of_ideal", "exact_hits_lost",
            "kv_exact", "approximate", "pressed", "pressed_approximate", "same_output", "modeled_gpu_ttft_mean_s",
           "modeled_gpu_ttft_mean_x")
    lines = [f"# Repeated replays against {summary['baseline']} (medians over runs)", "",
             "Runs: " + ", ".join(summary["runs"]), "", "| server | " + " | ".join(cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for server, m in summary["median"].items():
        cells = ["-" if m[c] is None else f"{m[c]:.4g}" for c in cols]
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", type=Path, required=True, help="eval.replay output folders")
    p.add_argument("--baseline", required=True, help="the server label every run has")
    p.add_argument("--alias", nargs="*", default=[], metavar="LABEL=NAME",
                   help="sum a run's server LABEL up under NAME (e.g. a sweep's tr@16ckpt=tr)")
    p.add_argument("--servers", nargs="*", default=None, help="only these servers (after --alias)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    bad = [a for a in args.alias if "=" not in a]
    if bad:
        raise SystemExit(f"--alias {bad[0]!r}: write LABEL=NAME")
    summary = summarize(args.runs, args.baseline, dict(a.split("=", 1) for a in args.alias), args.servers)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (args.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))


if __name__ == "__main__":
    main()
