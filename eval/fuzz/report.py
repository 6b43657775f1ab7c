"""The fuzzer's report: report.json (everything) and report.md (counts per configuration, every
violation with its reproduction)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

#: the request paths the report counts (`eval.fuzz.workload.paths_of`)
PATHS = ("plain", "continuation", "chunked", "input_logprobs", "n_gt_1", "long_decode", "sampled", "batch", "abort",
         "session", "foreign_session", "retraction", "pressure", "l3")


def _violation_line(name: str, v: dict) -> str:
    detail = dict(v.get("detail") or {})
    detail.pop("excerpt", None)
    detail.pop("details", None)
    repro = v.get("reproduction") or {}
    if repro.get("reproduced"):
        how = f"shrunk to ops {[op['index'] for op in repro['ops']]} (sequential, {repro['runs']} runs)"
    elif "ops" in repro and repro.get("reproduced") is False:
        how = f"did not reproduce sequentially ({repro['runs']} runs): seed {repro['seed']}, round {repro['round']}"
    else:
        how = repro.get("note", "")
    return (f"| {name} | {v['oracle']} | {v.get('seed')} | {v.get('op')} | {v.get('kind')} | "
            f"`{json.dumps(detail)[:300]}` | {how} |")


def markdown(report: dict) -> str:
    lines = ["# Exactness fuzzer: long run", "",
             f"Commit {report['commit']}, {report['started_utc']} to {report.get('finished_utc', '?')} (UTC); "
             f"{report['ops_per_seed']} ops per seed, {report['concurrency']} side by side; command in "
             "`benchmarks/README.md` (section Exactness fuzzer). Every count below is from `report.json`.", "",
             *([f"The servers ran the working tree, with {len(report['modified_files'])} tracked files modified "
                "beyond the commit (listed in `report.json`, `modified_files`).", ""]
               if report.get("modified_files") else []),
             *([report["note"], ""] if report.get("note") else []),
             "## Tolerance (a server without cache against itself)", ""]
    for arch, n in report["noise"].items():
        lines.append(f"- {arch}: {n['prompts']} prompts x {n['new_tokens']} tokens, alone vs side by side: largest "
                     f"output-logprob difference {n['max_logprob_diff']:.2e}, same greedy tokens: {n['same_tokens']}; "
                     f"tolerance {n['tolerance']:.1e}")
    lines += ["", "## Per configuration", "",
              "| config | arch | seeds | ops | requests | HTTP statuses | meta claim (kv_exact / exact) | violations by oracle | wall s |",
              "|---|---|---:|---:|---:|---|---|---|---:|"]
    for name, c in report["configs"].items():
        if "did_not_start" in c:
            lines.append(f"| {name} | {c['arch']} | did not start: `{c['did_not_start']}` | | | | | | |")
            continue
        by_oracle = Counter(v["oracle"] for v in c["violations"])
        lines.append(f"| {name} | {c['arch']} | {len(c['seeds'])} | {c['ops']} | {c['requests']} | "
                     f"{json.dumps(c['statuses'])} | {json.dumps(c['claims'])} | "
                     f"{json.dumps(dict(by_oracle)) if by_oracle else 0} | {c['wall_s']} |")
    lines += ["", "## Per request path (requests / violations)", "",
              "| config | " + " | ".join(PATHS) + " |", "|---|" + "---:|" * len(PATHS)]
    for name, c in report["configs"].items():
        paths = c.get("paths") or {}
        lines.append(f"| {name} | " + " | ".join(
            f"{paths[p]['requests']} / {paths[p]['violations']}" if p in paths else "-" for p in PATHS) + " |")
    tp2 = report.get("tp2")
    lines += ["", "## `--tp 2` on the CPU path", ""]
    if tp2 is None:
        lines.append("Not tried in this run (`--skip-tp2`).")
    else:
        for a in tp2["attempts"]:
            lines.append(f"- env {json.dumps(a['env'])}: " + ("started" if a["started"] else f"no: `{a['error']}`"))
    lines += ["", "## Violations", "",
              "Each with its seed (`eval.fuzz.workload.generate_workload(seed, ops_per_seed, concurrency, "
              "config.shape())`) and its reproduction; the reproductions' op lists are in `report.json` "
              "(`configs.<name>.violations[].reproduction.ops`), runnable with `eval.fuzz.client.run_ops(url, "
              "[[op] for op in ops])` on the configuration's server.", "",
              "| config | oracle | seed | op | kind | detail | reproduction |", "|---|---|---:|---:|---|---|---|"]
    total = 0
    for name, c in report["configs"].items():
        for v in c["violations"]:
            lines.append(_violation_line(name, v))
            total += 1
    if not total:
        lines.append("| - | none | | | | | |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
