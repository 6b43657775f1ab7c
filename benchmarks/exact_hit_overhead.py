"""What an exact hit costs on Tail-Replay against the same hit on stock SGLang.

Two servers side by side on one model (tiny Qwen3-Next fixture unless `--model`), both
`--mamba-radix-cache-strategy extra_buffer` (SGLang's GPU default): stock SGLang and Tail-Replay
with its defaults. Each repetition sends, on fresh random tokens, to both servers in a random order
(one request in flight at a time, greedy, one output token, TTFT timed by the client):

  miss   a never-seen prompt of D + q tokens: computes D + q, nothing cached
  exact  a document of D tokens sent alone first (its end state kept), then the document + q new
         tokens: both servers resume exactly from the state at D and compute q

Both servers run the same tokens through the same model, so a TTFT difference on `exact` is the
price of what Tail-Replay does around a hit (the match, the plan, provenance, the state copy,
the response's details). The report gives per kind each server's median and the median of the
per-repetition ratio Tail-Replay / stock, and each server's CPU per request by process (HTTP /
tokenizer manager, scheduler, detokenizer; psutil, over all repetitions). For a function-level
split on real traffic, `python -m eval.replay --profile` samples each scheduler with py-spy.

    .venv/bin/python benchmarks/exact_hit_overhead.py --reps 60 --out runs/exact-hit-overhead
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.fixtures.tiny import build_tiny_model  # noqa: E402
from eval.harness import ServerProcess, start_servers, stop_servers  # noqa: E402
from eval.replay.profile import cpu_per_request, process_cpu_seconds  # noqa: E402

KINDS = ("miss", "exact")
SERVERS = {"stock": [], "tail_replay": ["--radix-cache-backend", "tail_replay"]}
COMMON = ["--mamba-radix-cache-strategy", "extra_buffer"]


class Client:
    def __init__(self, name: str, server: ServerProcess):
        self.name, self.server = name, server

    def post(self, ids: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        response = requests.post(f"{self.server.url}/generate", timeout=120, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        elapsed = time.perf_counter() - start
        response.raise_for_status()
        return elapsed, int(response.json()["meta_info"]["cached_tokens"])


def one(client: Client, kind: str, doc: list[int], new: list[int]) -> dict:
    if kind == "miss":
        ttft, cached = client.post(doc + new)
        wanted = 0
    else:
        client.post(doc)
        ttft, cached = client.post(doc + new)
        wanted = len(doc)
    if cached != wanted:
        raise RuntimeError(f"{client.name} {kind}: expected {wanted} cached tokens, the server reported {cached}")
    return {"server": client.name, "kind": kind, "ttft_s": ttft}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_tiny_model("qwen3-next", out / "model-qwen3-next", seed=0)
    servers = {name: ServerProcess(str(model), COMMON + extra, log_path=out / f"server-{name}.log")
               for name, extra in SERVERS.items()}
    load = psutil.cpu_percent(interval=1.0)
    start_servers(list(servers.values()))
    rng = random.Random(args.seed)
    try:
        clients = [Client(name, server) for name, server in servers.items()]
        for client in clients:   # warm every path once
            for kind in KINDS:
                one(client, kind, [rng.randrange(10, 500) for _ in range(args.document)],
                    [rng.randrange(10, 500) for _ in range(args.q)])
        records = []
        cpu_before = {c.name: process_cpu_seconds(c.server.proc.pid) for c in clients}
        for rep in range(args.reps):
            for kind in KINDS:
                doc = [rng.randrange(10, 500) for _ in range(args.document)]
                new = [rng.randrange(10, 500) for _ in range(args.q)]
                for client in rng.sample(clients, len(clients)):
                    records.append({"rep": rep, **one(client, kind, doc, new)})
        load_after = psutil.cpu_percent(interval=None)
        # three requests per repetition: the miss, the exact hit's document, the hit
        cpu = {c.name: cpu_per_request(cpu_before[c.name], process_cpu_seconds(c.server.proc.pid), args.reps * 3)
               for c in clients}
    finally:
        stop_servers(list(servers.values()))
    rows = {}
    for kind in KINDS:
        by = {name: {r["rep"]: r["ttft_s"] for r in records if r["kind"] == kind and r["server"] == name}
              for name in SERVERS}
        ratios = sorted(by["tail_replay"][i] / by["stock"][i] for i in by["stock"])
        rows[kind] = {**{f"{name}_median_ms": 1e3 * statistics.median(by[name].values()) for name in SERVERS},
                      "ratio_median": statistics.median(ratios),
                      "ratio_p25": ratios[len(ratios) // 4], "ratio_p75": ratios[3 * len(ratios) // 4]}
    report = {"command": " ".join(sys.argv), "document": args.document, "q": args.q, "reps": args.reps,
              "machine_cpu_percent_before": load, "machine_cpu_percent_during": load_after,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "ttft": rows, "cpu_ms_per_request": cpu}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    with open(out / "records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    lines = [f"# Exact hit: Tail-Replay against stock SGLang (`extra_buffer`; D = {args.document}, q = {args.q}, "
             f"{args.reps} reps)", "", f"`{report['command']}`; other CPU before: {load:.0f} %", "",
             "| request | stock median ms | Tail-Replay median ms | ratio TR / stock, median (p25-p75) |",
             "|---|---:|---:|---:|"]
    for kind in KINDS:
        r = rows[kind]
        lines.append(f"| {kind} | {r['stock_median_ms']:.1f} | {r['tail_replay_median_ms']:.1f} | "
                     f"{r['ratio_median']:.3f} ({r['ratio_p25']:.3f}-{r['ratio_p75']:.3f}) |")
    roles = sorted({role for per in cpu.values() for role in per})
    lines += ["", "CPU per request by process (ms, user + system, all threads; a miss, a document, an exact hit "
              "per repetition):", "", "| server | " + " | ".join(roles) + " |", "|---|" + "---:|" * len(roles)]
    lines += [f"| {name} | " + " | ".join(f"{per.get(role, 0.0):.1f}" for role in roles) + " |"
              for name, per in cpu.items()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--document", type=int, default=512, help="D: matched document tokens")
    ap.add_argument("--q", type=int, default=32, help="new tokens after the document")
    ap.add_argument("--model", help="a Qwen3-Next checkpoint folder (default: build the tiny fixture)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/exact-hit-overhead")
    sys.exit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
