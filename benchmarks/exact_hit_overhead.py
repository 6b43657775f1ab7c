"""What an exact hit costs on Tail-Replay against the same hit on stock SGLang (issue 25).

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
per-repetition ratio Tail-Replay / stock. With `--profile`, py-spy samples both servers'
scheduler and HTTP (tokenizer-manager) processes over `--profile-reps` exact hits each; the report
lists, per process, the functions whose inclusive samples per request differ most between the
two servers (outside the model forward).

    .venv/bin/python benchmarks/exact_hit_overhead.py --reps 60 --profile --out runs/exact-hit-overhead
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.fixtures.tiny import build_tiny_model  # noqa: E402
from eval.harness import ServerProcess, start_servers, stop_servers  # noqa: E402

KINDS = ("miss", "exact")
SERVERS = {"stock": [], "tail_replay": ["--radix-cache-backend", "tail_replay"]}
COMMON = ["--mamba-radix-cache-strategy", "extra_buffer"]
FORWARD = re.compile(r"forward_batch_generation \(")
SAMPLE_RATE = 1000


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


def processes(server: ServerProcess) -> dict[str, int]:
    """The scheduler and the HTTP (tokenizer-manager) process of a server."""
    root = psutil.Process(server.proc.pid)
    found = {}
    for proc in [root, *root.children(recursive=True)]:
        text = proc.name() + " " + " ".join(proc.cmdline())
        if "scheduler" in text:
            found.setdefault("scheduler", proc.pid)
        elif "sglang_ext" in text and "serve" in text:
            found.setdefault("http", proc.pid)
    if set(found) != {"scheduler", "http"}:
        raise RuntimeError(f"could not find the scheduler and HTTP processes of {server.url}: {found}")
    return found


def inclusive(raw: Path) -> tuple[int, collections.Counter]:
    """Total samples and inclusive samples per function outside the model forward."""
    total, counts = 0, collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        cut = next((i for i, f in enumerate(frames) if FORWARD.search(f)), len(frames))
        for name in {re.sub(r":\d+\)$", ")", f) for f in frames[:cut + 1]}:
            counts[name] += n
    return total, counts


def profile(clients: list[Client], reps: int, out: Path, seed: int, document: int, q: int) -> dict:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    rng = random.Random(seed + 1)
    result = {}
    for client in clients:
        spies = {}
        for role, pid in processes(client.server).items():
            raw = out / f"pyspy-{client.name}-{role}.txt"
            spies[role] = (raw, subprocess.Popen(
                [spy, "record", "-p", str(pid), "-r", str(SAMPLE_RATE), "-f", "raw", "-o", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(1.5)
        for _ in range(reps):
            one(client, "exact", [rng.randrange(10, 500) for _ in range(document)],
                [rng.randrange(10, 500) for _ in range(q)])
        for role, (raw, proc) in spies.items():
            proc.send_signal(2)
            _, err = proc.communicate(timeout=60)
            if not raw.exists():
                raise RuntimeError(f"py-spy wrote no profile for {client.name} {role}: {err.decode()[-500:]}")
            result[(client.name, role)] = inclusive(raw)
    per_request = 1e3 / SAMPLE_RATE / reps   # ms per request per sample
    roles = {}
    for role in ("scheduler", "http"):
        (_, stock), (_, tr) = result[("stock", role)], result[("tail_replay", role)]
        diff = {name: (tr[name] - stock[name]) * per_request for name in set(stock) | set(tr)}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:25]
        roles[role] = {
            "samples": {"stock": result[("stock", role)][0], "tail_replay": result[("tail_replay", role)][0]},
            "forward_ms_per_request": {
                name: sum(n for f, n in result[(name, role)][1].items() if FORWARD.search(f)) * per_request
                for name in ("stock", "tail_replay")},
            "largest_differences_ms_per_request": [[name, round(ms, 3)] for name, ms in top]}
    return roles


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
        for rep in range(args.reps):
            for kind in KINDS:
                doc = [rng.randrange(10, 500) for _ in range(args.document)]
                new = [rng.randrange(10, 500) for _ in range(args.q)]
                for client in rng.sample(clients, len(clients)):
                    records.append({"rep": rep, **one(client, kind, doc, new)})
        load_after = psutil.cpu_percent(interval=None)
        profiles = profile(clients, args.profile_reps, out, args.seed, args.document, args.q) if args.profile else {}
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
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "ttft": rows, "profiles": profiles}
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
    for role, p in profiles.items():
        lines += ["", f"py-spy, {role} process, {args.profile_reps} exact hits per server: forward "
                  f"{p['forward_ms_per_request']['stock']:.2f} ms (stock) / {p['forward_ms_per_request']['tail_replay']:.2f} ms "
                  "(Tail-Replay) per request; largest differences outside the forward, ms per request (TR - stock):", ""]
        lines += [f"- {ms:+.3f} {name}" for name, ms in p["largest_differences_ms_per_request"][:15]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--document", type=int, default=512, help="D: matched document tokens")
    ap.add_argument("--q", type=int, default=32, help="new tokens after the document")
    ap.add_argument("--profile", action="store_true", help="also sample both servers with py-spy")
    ap.add_argument("--profile-reps", type=int, default=40)
    ap.add_argument("--model", help="a Qwen3-Next checkpoint folder (default: build the tiny fixture)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/exact-hit-overhead")
    sys.exit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
