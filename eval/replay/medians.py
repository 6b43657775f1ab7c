"""Medians over repeated replays: the same `python -m eval.replay` command run several times (one
report directory each, `goodput.json` beside each report), each server's figures per run and their
median, against the baseline of the same run.

    python -m eval.replay.medians RUN_DIR [RUN_DIR ...] --out medians.json

Per server and run: reuse of ideal, modeled GPU TTFT mean / p50 / p95 and each over the baseline's
of the same run, the modeled goodput over the baseline's at each load of `goodput.json`, the
baseline's hits it reused fewer tokens on, the baseline's exact hits it lost, exact answers, the
modeled TTFT's CPU term (ms beyond the baseline's) and scheduler CPU per request (ms). The medians are per figure, over the runs (each a ratio taken
within its run first): a median row is not one run's row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path


def run_figures(report: dict, goodput: dict | None) -> dict[str, dict]:
    """Each server's figures in one run (see the module docstring)."""
    baseline = (report.get("gpu_model") or {}).get("baseline") or report["servers"][0]["server"]
    rows = {row["server"]: row for row in report["servers"]}
    base = rows[baseline]["modeled_gpu_ttft_s"]
    out = {}
    for name, row in rows.items():
        modeled, vs = row["modeled_gpu_ttft_s"], row.get("vs_baseline") or {}
        figures = {"reuse_of_ideal": row["reuse_of_ideal"], "modeled_ttft_mean_s": modeled["mean"],
                   "modeled_ttft_x_baseline": modeled["mean"] / base["mean"],
                   "p50_x_baseline": modeled["p50"] / base["p50"], "p95_x_baseline": modeled["p95"] / base["p95"],
                   "reuse_below_baseline": vs.get("reuse_below_baseline", 0),
                   "exact_hits_lost": vs.get("exact_hits_lost", 0),
                   "exact_answers": (row.get("exact_split") or {}).get("exact"),
                   "cpu_beyond_baseline_ms": modeled.get("cpu_beyond_baseline_ms"),
                   "scheduler_cpu_ms": (row.get("process_cpu_ms_per_request") or {}).get("sglang::scheduler")}
        if goodput is not None and name in goodput["servers"]:
            figures["goodput_x_baseline"] = goodput["servers"][name]["goodput_x_baseline"]
        out[name] = figures
    return out


def medians(runs: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """Per server, the median of each figure over the runs that have it (lists: per position)."""
    out: dict[str, dict] = {}
    for name in runs[0]:
        per_run = [run[name] for run in runs if name in run]
        row = {}
        for key, value in per_run[0].items():
            values = [r[key] for r in per_run if r.get(key) is not None]
            if isinstance(value, list):
                row[key] = [statistics.median(v[i] for v in values) for i in range(len(value))]
            elif values:
                row[key] = statistics.median(values)
        out[name] = row
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.replay.medians", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="report directories of the same command")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    runs, commands = [], set()
    for directory in args.runs:
        report = json.loads((directory / "report.json").read_text())
        gp = directory / "goodput.json"
        runs.append(run_figures(report, json.loads(gp.read_text()) if gp.exists() else None))
        commands.add(" ".join(a for a in report["command"].split() if a != str(directory)))
    if len({frozenset(r) for r in runs}) != 1:
        p.error("the runs do not have the same servers")
    result = {"runs": [str(d) for d in args.runs], "commands": sorted(commands),
              "per_run": runs, "median": medians(runs)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in result["median"].items():
        print(f"{name:10s} reuse {row['reuse_of_ideal']:.1%}  TTFT x base {row['modeled_ttft_x_baseline']:.3f}  "
              f"p50/p95 {row['p50_x_baseline']:.2f}/{row['p95_x_baseline']:.2f}  goodput "
              + "/".join(f"{x:.2f}" for x in row.get("goodput_x_baseline", []))
              + f"  below {row['reuse_below_baseline']:g}  lost {row['exact_hits_lost']:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
