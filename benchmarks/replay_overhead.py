"""Where a short replay hit's time goes: the replay itself, or what surrounds it.

One Tail-Replay server (the defaults, tiny Qwen3-Next fixture). Per repetition, interleaved, four
requests whose TTFT is timed by the client (one output token, greedy), each on fresh random tokens:

  miss         a never-seen prompt of 64 + q tokens: computes 64 + q, nothing cached
  exact        a document of D tokens sent alone first (its end state stored), then the document +
               64 + q new tokens: exact_checkpoint at D, computes 64 + q
  exact_short  the same with q new tokens: exact_checkpoint at D, computes q
  approximate  the document sent with another 32-token suffix first (no state at D), then the
               document + q new tokens: an approximate hit of D that replays the last 64 matched
               tokens from a zero state (their KV gathered from the tree, the bound accumulated
               from their gates) and computes q: 64 + q tokens through the model

`exact` and `approximate` run the same number of tokens through the model with the same context,
so their difference is everything that is not the replay's forward (the KV gather, the bound's
host sync, provenance, scheduling); `exact` minus `exact_short` is what 64 tokens of forward cost.
With `--profile`, py-spy samples the scheduler process over a run of `exact` and of `approximate`
requests, and the share of its samples inside the forward and inside Tail-Replay's own bookkeeping
(functions under `sglang_ext/tail_replay/` and the Tail-Replay patches outside the model forward)
is reported per request kind.

    .venv/bin/python benchmarks/replay_overhead.py --reps 40 --profile --out runs/replay-overhead
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.fixtures.tiny import build_tiny_model  # noqa: E402
from eval.harness import ServerProcess, start_servers, stop_servers  # noqa: E402
from eval.replay.profile import Sampler, scheduler_pid  # noqa: E402

KINDS = ("miss", "exact", "exact_short", "approximate")
EXPECTED = {"miss": "miss", "exact": "exact_checkpoint", "exact_short": "exact_checkpoint",
            "approximate": "approximate"}
#: frames counted as the model forward / as Tail-Replay's bookkeeping in a py-spy sample
FORWARD = re.compile(r"forward_batch_generation \(")
BOOKKEEPING = re.compile(r"sglang_ext/tail_replay/|tail_replay/batch\.py|tail_replay/meta\.py|"
                         r"tail_replay/linear_bound\.py:\d+\)$|accumulate_bound|substitute_")


class Bench:
    def __init__(self, server: ServerProcess, document: int, q: int, seed: int):
        self.server, self.document, self.q = server, document, q
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 500) for _ in range(n)]

    def post(self, ids: list[int]) -> tuple[float, dict]:
        start = time.perf_counter()
        response = requests.post(f"{self.server.url}/generate", timeout=120, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        response.raise_for_status()
        return time.perf_counter() - start, response.json()["meta_info"]["cached_tokens_details"]["tail_replay"]

    def one(self, kind: str) -> dict:
        D, q = self.document, self.q
        if kind == "miss":
            ttft, summary = self.post(self.tokens(64 + q))
        elif kind in ("exact", "exact_short"):
            doc = self.tokens(D)
            self.post(doc)
            ttft, summary = self.post(doc + self.tokens(64 + q if kind == "exact" else q))
        else:
            doc = self.tokens(D)
            self.post(doc + self.tokens(32))
            ttft, summary = self.post(doc + self.tokens(q))
        if summary["kind"] != EXPECTED[kind]:
            raise RuntimeError(f"{kind}: expected a {EXPECTED[kind]} hit, the server reported {summary}")
        return {"kind": kind, "ttft_s": ttft, "summary": summary}


def profile(bench: Bench, kind: str, reps: int, out: Path) -> dict:
    """py-spy over `reps` requests of `kind` (each with its warm-up): shares of the scheduler's
    samples in the forward and in Tail-Replay's bookkeeping."""
    raw = out / f"pyspy-{kind}.txt"
    sampler = Sampler(scheduler_pid(bench.server.proc.pid), raw, rate=500).start()
    for _ in range(reps):
        bench.one(kind)
    sampler.stop()
    total = forward = book = 0
    functions: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        in_forward = any(FORWARD.search(f) for f in frames)
        forward += n if in_forward else 0
        mine = [f for f in frames if BOOKKEEPING.search(f)]
        if mine and not (in_forward and all("tail_replay/linear_bound" in f and ".seam (" in f for f in mine)):
            book += n
            functions[mine[-1].split(" (")[0]] += n
    return {"samples": total, "forward_share": forward / max(total, 1), "bookkeeping_share": book / max(total, 1),
            "bookkeeping_ms_per_request": book / sampler.rate * 1e3 / reps,
            "top_bookkeeping": functions.most_common(8), "raw": raw.name}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_tiny_model("qwen3-next", out / "model-qwen3-next", seed=0)
    server = ServerProcess(str(model), ["--radix-cache-backend", "tail_replay"], log_path=out / "server.log")
    load = psutil.cpu_percent(interval=1.0)
    start_servers([server])
    try:
        bench = Bench(server, args.document, args.q, args.seed)
        for kind in KINDS:   # warm every path once
            bench.one(kind)
        records = [bench.one(kind) for _ in range(args.reps) for kind in KINDS]
        profiles = {kind: profile(bench, kind, args.reps, out) for kind in ("exact", "approximate")} \
            if args.profile else {}
    finally:
        stop_servers([server])
    rows = {}
    for kind in KINDS:
        ttfts = sorted(r["ttft_s"] for r in records if r["kind"] == kind)
        rows[kind] = {"median_ms": 1e3 * statistics.median(ttfts), "p25_ms": 1e3 * ttfts[len(ttfts) // 4],
                      "n": len(ttfts)}
    report = {"command": " ".join(sys.argv), "document": args.document, "q": args.q, "reps": args.reps,
              "machine_cpu_percent_before": load, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "ttft": rows, "profiles": profiles,
              "not_the_replay_ms": rows["approximate"]["median_ms"] - rows["exact"]["median_ms"],
              "forward_of_64_tokens_ms": rows["exact"]["median_ms"] - rows["exact_short"]["median_ms"]}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    with open(out / "records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    lines = [f"# Short replay: where the time goes (D = {args.document}, q = {args.q}, {args.reps} reps)", "",
             f"`{report['command']}`; other CPU before: {load:.0f} %", "",
             "| request | computes | TTFT median / p25 ms |", "|---|---|---:|"]
    computes = {"miss": f"{64 + args.q} (no cache)", "exact": f"{64 + args.q} after an exact checkpoint",
                "exact_short": f"{args.q} after an exact checkpoint",
                "approximate": f"64 replayed + {args.q} after an approximate hit"}
    for kind in KINDS:
        lines.append(f"| {kind} | {computes[kind]} | {rows[kind]['median_ms']:.1f} / {rows[kind]['p25_ms']:.1f} |")
    lines += ["", f"approximate - exact (not the replay's forward): {report['not_the_replay_ms']:+.1f} ms; "
              f"exact - exact_short (64 tokens of forward): {report['forward_of_64_tokens_ms']:+.1f} ms"]
    for kind, p in profiles.items():
        lines.append(f"\npy-spy, {kind}: {p['samples']} scheduler samples, forward {100 * p['forward_share']:.1f} %, "
                     f"Tail-Replay bookkeeping {100 * p['bookkeeping_share']:.1f} % "
                     f"({p['bookkeeping_ms_per_request']:.2f} ms per request pair); top: {p['top_bookkeeping'][:5]}")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--document", type=int, default=512, help="D: matched document tokens")
    ap.add_argument("--q", type=int, default=32, help="new tokens after the document")
    ap.add_argument("--profile", action="store_true", help="also sample the scheduler with py-spy")
    ap.add_argument("--model", help="a Qwen3-Next checkpoint folder (default: build the tiny fixture)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/replay-overhead")
    sys.exit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
