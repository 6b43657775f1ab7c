"""TTFT through the server: full prefill vs stock SGLang cache vs Tail-Replay at 5% and 10%.

For each matched prefix length L (a random-token document) plus an n-token new suffix
(default 128), with max_new_tokens=1, four configurations are timed side by side, interleaved
within each repetition:

  (a) full prefill: a never-seen document + suffix (a fresh document per repetition), on the
      stock server; the Tail-Replay server's own miss on its fresh document is timed too.
  (b) stock SGLang cache (default radix cache, second server): the same document seen before
      with another suffix. No state checkpoint exists at the branch point, so SGLang's hybrid
      cache can only reuse up to its deepest state; what it reuses is read from meta_info.
  (c) Tail-Replay at budget 5% and (d) at 10% (one tail_replay server, per-request override
      `custom_params["tail_replay"]["budget"]`): the document was warmed with another suffix;
      meta_info must report an approximate hit of L tokens replaying W = ceil(budget * L).

Besides the matched lengths (with n new tokens each), `--prefix-rows L:n` adds shapes with a
long new part (default 6000:2064, an 8,064-token prompt): a request with a cached prefix must never
be slower than the same prompt fully prefilled; the table's last column says whether it was.

TTFT is the client's wall time from POST to response (one output token, no streaming); SGLang's
own `meta_info` timing (e2e_latency, and scheduler stats where present) is recorded beside it.
Medians over repetitions, speedups vs (a), and two ceilings, W the matched tokens the request
recomputes (L - cached for stock): the linear-cost one (L + n) / (W + n), and the attention-aware
FLOP ceiling of `benchmarks/flops.py` for the served checkpoint's shape (full prefill of L + n
tokens vs W + n tokens attending to the whole cached context), printed as a markdown table.
The replay window comes from `sglang_ext.tail_replay.replay_window` (the server's own planner).

Machine load is sampled at the start (and recorded at the end); on a busy machine the script
stops unless `--allow-busy` is given.

    .venv/bin/python benchmarks/ttft_tail_replay.py --lengths 8192,16384,32768 --reps 3 --out runs/ttft
    .venv/bin/python benchmarks/ttft_tail_replay.py --layout proportioned --out runs/ttft_prop
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import psutil
import requests
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.flops import PrefillCost, cost_of_checkpoint  # noqa: E402
from eval.harness import ServerProcess, servers_running  # noqa: E402
from sglang_ext.env import THREAD_VARS  # noqa: E402
from sglang_ext.tail_replay import DEFAULTS, parse_config, replay_window, with_overrides  # noqa: E402

TOKEN_LO, TOKEN_HI = 10, 500          # random prompt ids (the tiny model's vocabulary is 512)
SERVER_BUDGET = DEFAULTS.knobs.budget      # the server's config: Tail-Replay's default budget
CONFIGS = ("full_prefill", "full_prefill_tr_server", "stock_cache", "tail_replay_5", "tail_replay_10")
LABELS = {
    "full_prefill": "(a) full prefill (never-seen prompt)",
    "full_prefill_tr_server": "(a') full prefill, tail_replay server miss",
    "stock_cache": "(b) stock SGLang cache",
    "tail_replay_5": "(c) Tail-Replay 5%",
    "tail_replay_10": "(d) Tail-Replay 10%",
}
TR_BUDGETS = {"tail_replay_5": 0.05, "tail_replay_10": 0.10}


# ---------------------------------------------------------------------------- prompts

class Prompts:
    """Random token ids; every document and suffix is distinct, and the suffixes sent after one
    document start with distinct tokens so that a match ends exactly at the document's end."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(TOKEN_LO, TOKEN_HI, (n,), generator=self.gen).tolist()

    def suffixes(self, n: int, count: int) -> list[list[int]]:
        out, firsts = [], set()
        while len(out) < count:
            s = self.tokens(n)
            if s[0] not in firsts:
                firsts.add(s[0])
                out.append(s)
        return out


# ---------------------------------------------------------------------------- requests

def server_cpu_seconds(server: ServerProcess) -> float:
    """User + system CPU seconds used so far by the server's processes (launcher, scheduler,
    detokenizer). Unlike wall time this hardly moves when other jobs share the cores."""
    root = psutil.Process(server.proc.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def timed_post(server: ServerProcess, ids: list[int], custom_params: dict | None = None) -> tuple[float, float, dict]:
    """One greedy 1-token `/generate` of `ids`: client wall time (TTFT), the server processes' CPU
    seconds over it, and the response's `meta_info`."""
    sampling: dict = {"max_new_tokens": 1, "temperature": 0}
    if custom_params:
        sampling["custom_params"] = custom_params
    cpu0 = server_cpu_seconds(server)
    t0 = time.perf_counter()
    resp = requests.post(f"{server.url}/generate", json={"input_ids": ids, "sampling_params": sampling},
                         timeout=3600)
    ttft = time.perf_counter() - t0
    cpu = server_cpu_seconds(server) - cpu0
    resp.raise_for_status()
    return ttft, cpu, resp.json()["meta_info"]


def timed_generate(server: ServerProcess, ids: list[int], overrides: dict | None = None) -> dict:
    ttft, cpu, meta = timed_post(server, ids, {"tail_replay": overrides} if overrides else None)
    details = meta.get("cached_tokens_details") or {}
    server_timing = {k: v for k, v in meta.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and any(w in k for w in ("latency", "time", "duration", "delay"))}
    return {"ttft_s": ttft, "server_cpu_s": cpu, "prompt_tokens": meta.get("prompt_tokens"),
            "cached_tokens": meta.get("cached_tokens"), "tail_replay": details.get("tail_replay"),
            "server_timing": server_timing}


def expected_window(L: int, budget: float, server_config: dict) -> int:
    """The W the server's planner picks for a match of L tokens under a per-request budget."""
    config = with_overrides(parse_config(json.dumps(server_config)), {"budget": budget})
    return replay_window(L, config)


def check_tail_replay(rec: dict, L: int, window: int) -> list[str]:
    """Problems with a Tail-Replay measurement (empty when the hit is what we expect; fields the
    summary carries beside these, such as `state_bound`, are not checked)."""
    want = {"kind": "approximate", "matched_tokens": L, "reused_tokens": L - window, "replayed_tokens": window}
    got = rec.get("tail_replay") or {}
    return [] if {key: got.get(key) for key in want} == want else [f"L={L}: expected tail_replay {want}, got {got} (cached_tokens "
                                   f"{rec.get('cached_tokens')})"]


# ---------------------------------------------------------------------------- servers

def server_args(max_len: int, n: int) -> list[str]:
    longest = max_len + n
    context = int(math.ceil((longest + 1024) / 1024) * 1024)
    # one chunk for the longest prompt: no chunk boundary (and no state SGLang might keep there)
    return ["--dtype", "float32",
            "--context-length", str(context),
            "--chunked-prefill-size", str(context),
            "--max-prefill-tokens", str(context),
            "--max-total-tokens", str(4 * context),   # tiny model: ~256 B of KV per token
            "--max-running-requests", "4",
            # a large static fraction leaves less slack to lose to other processes during start-up
            "--mem-fraction-static", "0.5",
            "--log-level", "warning"]


def build_model(out: Path, layout: str) -> Path:
    from eval.fixtures.tiny import build_tiny_model

    model_dir = out / ("model-qwen3-next" if layout == "moe" else f"model-qwen3-next-{layout}")
    if not (model_dir / "config.json").exists():
        build_tiny_model("qwen3-next", model_dir, seed=0, layout=layout)
    return model_dir


def sample_load(exclude_pids: list[int], allow_busy: bool) -> dict:
    """Machine load now (`eval.machine`); refuses a busy machine unless `allow_busy`."""
    from eval.machine import require_quiet
    from eval.machine import sample_load as machine_sample_load

    load = machine_sample_load(exclude_pids=tuple(exclude_pids), seconds=1.0)
    require_quiet(load, allow_busy)
    return {**load.as_dict(), "source": "eval.machine"}


def server_thread_env() -> dict[str, str]:
    """Thread settings the servers run with: this process's own (inherited) plus what the CPU
    launcher adds (`sglang_ext.launcher.cpu_thread_env`)."""
    from sglang_ext.launcher import cpu_thread_env

    inherited = {v: os.environ[v] for v in THREAD_VARS if os.environ.get(v)}
    return {**inherited, **cpu_thread_env(os.environ, len(os.sched_getaffinity(0)))}


def process_tree(server: ServerProcess) -> list[int]:
    root = psutil.Process(server.proc.pid)
    return [root.pid, *(p.pid for p in root.children(recursive=True))]


def parse_shapes(lengths: str, suffix: int, prefix_rows: str) -> list[tuple[int, int]]:
    """(matched L, new n) pairs: each length with `suffix` new tokens, then each `L:n` row."""
    shapes = [(int(x), suffix) for x in lengths.split(",") if x]
    for item in filter(None, prefix_rows.split(",")):
        L, sep, n = item.partition(":")
        if not sep:
            raise SystemExit(f"--prefix-rows {item!r}: expected L:n")
        shapes.append((int(L), int(n)))
    return sorted(set(shapes), key=lambda s: (s[0] + s[1], s))


# ---------------------------------------------------------------------------- summary

def baseline_config(configs) -> str:
    """(a) when the stock server was timed, else (a'): the tail_replay server's own full prefill."""
    return "full_prefill" if "full_prefill" in configs else "full_prefill_tr_server"


def summarize(records: list[dict], shapes: list[tuple[int, int]], cost: PrefillCost) -> list[dict]:
    rows = []
    for L, n in shapes:
        mine = [r for r in records if (r["L"], r["n"]) == (L, n)]
        baseline = baseline_config({r["config"] for r in mine})
        base = [r["ttft_s"] for r in mine if r["config"] == baseline]
        base_med = statistics.median(base) if base else float("nan")
        base_cpu = [r["server_cpu_s"] for r in mine if r["config"] == baseline]
        base_cpu_med = statistics.median(base_cpu) if base_cpu else float("nan")
        for config in CONFIGS:
            rs = [r for r in mine if r["config"] == config]
            if not rs:
                continue
            med = statistics.median(r["ttft_s"] for r in rs)
            cpu_med = statistics.median(r["server_cpu_s"] for r in rs)
            cached = statistics.median(r["cached_tokens"] or 0 for r in rs)
            if config.startswith("full_prefill"):
                recomputed = L
            elif config == "stock_cache":
                recomputed = L - cached
            else:
                recomputed = statistics.median(r["tail_replay"]["replayed_tokens"] for r in rs)
            e2e = [r["server_timing"].get("e2e_latency") for r in rs]
            e2e = [x for x in e2e if x is not None]
            rows.append({
                "L": L, "n": n, "config": config, "reps": len(rs),
                "median_ttft_s": med, "ttft_s": [r["ttft_s"] for r in rs],
                "median_server_e2e_s": statistics.median(e2e) if e2e else None,
                "cached_tokens": cached, "recomputed_matched_tokens": recomputed,
                "median_server_cpu_s": cpu_med, "server_cpu_s": [r["server_cpu_s"] for r in rs],
                "speedup": base_med / med, "cpu_speedup": base_cpu_med / cpu_med,
                "ceiling": (L + n) / (recomputed + n),
                "flop_ceiling": cost.ceiling(L, n, int(recomputed)),
                "not_slower_than_full_prefill": med <= base_med,
                "kinds": sorted({(r["tail_replay"] or {}).get("kind", "-") for r in rs}),
            })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| matched L | new n | configuration | cached (reused) | recomputed W | median TTFT s | median "
             "server e2e s | TTFT speedup vs full prefill | FLOP ceiling | linear ceiling (L+n)/(W+n) | server CPU s | "
             "CPU-time speedup | hit kind | not slower than full prefill |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        e2e = f"{r['median_server_e2e_s']:.3f}" if r["median_server_e2e_s"] is not None else "-"
        lines.append(f"| {r['L']:,} | {r['n']:,} | {LABELS[r['config']]} | {r['cached_tokens']:,.0f} | "
                     f"{r['recomputed_matched_tokens']:,.0f} | {r['median_ttft_s']:.3f} | {e2e} | "
                     f"{r['speedup']:.2f}x | {r['flop_ceiling']:.2f}x | {r['ceiling']:.2f}x | "
                     f"{r['median_server_cpu_s']:.2f} | {r['cpu_speedup']:.2f}x | {', '.join(r['kinds'])} | "
                     f"{'yes' if r['not_slower_than_full_prefill'] else '**no**'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main

def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = parse_shapes(args.lengths, args.suffix, args.prefix_rows)
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown or not configs:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {','.join(CONFIGS)}")
    # without (a) and (b) the stock server is not started and (a') is the baseline
    use_stock = "full_prefill" in configs or "stock_cache" in configs
    configs = list(dict.fromkeys([*configs, baseline_config(configs)]))
    model = build_model(out, args.layout)
    cost = cost_of_checkpoint(model)
    longest = max(L + n for L, n in shapes)
    common = server_args(longest, 0)
    tr_config = {"budget": SERVER_BUDGET}
    stock = ServerProcess(str(model), common, log_path=out / "server_stock.log")
    tail = ServerProcess(str(model), common + ["--radix-cache-backend", "tail_replay",
                                               "--tail-replay-config", json.dumps(tr_config)],
                         log_path=out / "server_tail_replay.log")
    prompts = Prompts(args.seed)
    records, problems = [], []
    started = time.time()
    print(f"starting servers ({' '.join(common)}) ...", flush=True)
    servers = [stock, tail] if use_stock else [tail]
    with servers_running(servers):
        own = [pid for server in servers for pid in process_tree(server)]
        load_start = sample_load(own, args.allow_busy)
        # warm-up: first-call costs (allocator, kernels, code paths of a hit) outside the timings
        doc = prompts.tokens(1024)
        for server in servers:
            for s in prompts.suffixes(128, 2):
                timed_generate(server, doc + s)
        total = len(shapes) * args.reps * len(configs)
        with tqdm(total=total, desc="requests", unit="req") as bar:
            for L, n in shapes:
                for rep in range(args.reps):
                    doc_stock, doc_tail = prompts.tokens(L), prompts.tokens(L)
                    warm, q_stock, q5, q10 = prompts.suffixes(n, 4)

                    def measure(config, server, ids, overrides=None, L=L, n=n, rep=rep):
                        rec = timed_generate(server, ids, overrides)
                        rec.update(config=config, L=L, n=n, rep=rep)
                        if config in configs:
                            records.append(rec)
                            bar.update()
                        bar.set_postfix_str(f"L={L} n={n} rep={rep} {config} {rec['ttft_s']:.2f}s")
                        return rec

                    # (a) the stock server sees a fresh document: a full prefill; it is also (b)'s warm-up
                    if use_stock:
                        a = measure("full_prefill", stock, doc_stock + warm)
                        if a["cached_tokens"]:
                            problems.append(f"L={L} rep={rep}: full prefill reported {a['cached_tokens']} "
                                            "cached tokens")
                    # the tail_replay server's fresh document (its warm-up for (c), (d)), timed as (a')
                    a2 = measure("full_prefill_tr_server", tail, doc_tail + warm)
                    if a2["cached_tokens"]:
                        problems.append(f"L={L} rep={rep}: tail_replay server's full prefill reported "
                                        f"{a2['cached_tokens']} cached tokens")
                    # (b) same document, another suffix, stock cache
                    if use_stock and "stock_cache" in configs:
                        measure("stock_cache", stock, doc_stock + q_stock)
                    # (c), (d): per-request budget; alternate the order between repetitions
                    order = [(c, q) for c, q in (("tail_replay_5", q5), ("tail_replay_10", q10)) if c in configs]
                    for config, q in (order if rep % 2 == 0 else order[::-1]):
                        budget = TR_BUDGETS[config]
                        rec = measure(config, tail, doc_tail + q, {"budget": budget})
                        problems += check_tail_replay(rec, L, expected_window(L, budget, tr_config))
        load_end = sample_load(own, True)
    rows = summarize(records, shapes, cost)
    table = markdown_table(rows)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    cost_text = (f"FLOP model ({args.layout}): {cost.per_token / 1e6:.1f} MFLOP per token, "
                 f"{cost.per_pair:,.0f} FLOP per attention (query, key) pair, {cost.linear_layers} linear + "
                 f"{cost.attention_layers} attention layers; attention share of a full prefill: "
                 + ", ".join(f"{L + n:,} tokens {100 * cost.attention_share(L + n):.0f}%" for L, n in shapes))
    result = {
        "command": command, "layout": args.layout, "shapes": shapes, "reps": args.reps, "configs": configs,
        "server_args": common, "tail_replay_server_config": tr_config,
        "flop_model": {"per_token": cost.per_token, "per_pair": cost.per_pair,
                       "linear_layers": cost.linear_layers, "attention_layers": cost.attention_layers},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "server_thread_env": server_thread_env(),
        "load_start": load_start, "load_end": load_end,
        "wall_s": time.time() - started, "problems": problems, "summary": rows, "records": records,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "table.md").write_text(f"`{command}`\n\nserver threads {result['server_thread_env']}\n\n"
                                  f"load at start {load_start}\n\nat end {load_end}\n\n"
                                  f"{cost_text}\n\n{table}\n")
    print(cost_text)
    print(table)
    for p in problems:
        print("PROBLEM:", p)
    print(f"load at start {load_start}; at end {load_end}")
    print(f"wrote {out / 'results.json'} and {out / 'table.md'} ({result['wall_s']:.0f}s)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384,32768", help="matched prefix lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--suffix", type=int, default=128, help="new tokens after the matched prefix")
    ap.add_argument("--prefix-rows", default="6000:2064",
                    help="extra L:n shapes (matched L, n new tokens), comma-separated; '' for none")
    ap.add_argument("--layout", default="moe", help="qwen3-next fixture layout: moe (default) or proportioned")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"configurations to time, comma-separated, from {','.join(CONFIGS)}")
    ap.add_argument("--allow-busy", action="store_true", help="measure even if the machine is busy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/ttft_tail_replay")
    raise SystemExit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
