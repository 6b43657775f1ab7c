"""`python -m eval.replay`: replay a real trace through live patched servers, side by side.

The trace's block hashes become synthetic token ids (`eval.replay.tokens`); every server gets
the same token sequences in the same order, greedy, `--new-tokens` output tokens each. Servers
replay one after another, each booted only for its own replay (`--boot each`, the default: one
server in memory, nothing else of ours running while it is timed; `--boot together` boots all at
once and lets the idle ones sleep, faster to start). Each server's cache is warmed with one
unrelated request and flushed before its replay. Reuse comes from
`meta_info.cached_tokens` and is deterministic for one-at-a-time replays; latency is not.

TTFT is measured with streaming: POST to the first streamed chunk (the first output token).
Machine load is sampled before each replay (`eval.machine.sample_load`, excluding this process
and every server) and measured over the replay itself; timings of a server whose replay ran on a
busy machine are withheld unless `--allow-busy`, and then labelled "(busy)".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests
from tqdm import tqdm

from eval.machine import BusyMachineError, CpuWindow, require_quiet, sample_load
from eval.replay.bound import ideal_curve, lru_curve
from eval.replay.profile import (
    ProfileError,
    Sampler,
    cpu_per_request,
    process_cpu_seconds,
    profile_lines,
    py_spy,
    scheduler_pid,
    summarize_profile,
)
from eval.replay.report import compare_to_baseline, comparison_table, markdown_table, plot, same_outputs, summarize
from eval.replay.router import RouterCounters, one_decision, prediction_line, prediction_summary
from eval.replay.servers import ServerSpec, ServerSpecError, flush_cache, parse_server_specs, stream_generate
from eval.replay.tokens import TOKEN_HI, ScaledRequest, block_tokens, scale_trace
from eval.trace_sim.loaders import DEFAULT_TRACE_ROOT, KvLoadOptions, load_kv_cache_tester, load_mooncake
from sglang_ext.tail_replay import BACKEND_NAME, META_KEY

TRACE_NAMES = {
    "mooncake-conversation": ("mooncake", "mooncake/conversation_trace.jsonl.gz"),
    "mooncake-synthetic": ("mooncake", "mooncake/synthetic_trace.jsonl.gz"),
    "kv-cache-tester": ("kv-cache-tester", "kv-cache-tester"),
}
#: --mem-fraction-static 0.5: SGLang refuses to start when free memory drops by more than
#: (1 - fraction) while it loads the weights, which other jobs on a shared machine cause; the pools
#: are sized by --max-total-tokens / --max-mamba-cache-size anyway
DEFAULT_SERVER_ARGS = "--dtype float32 --log-level warning --mem-fraction-static 0.5"
THREAD_ENV = re.compile(r"^(OMP_|KMP_|MKL_|GOMP_|SGLANG_EXT_CPU|TORCH_NUM)")
WARMUP_BLOCK = 1 << 40  # a block id no trace reaches


class ReplayError(ValueError):
    """Bad replay input (trace, model, option); the message names it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.replay", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="mooncake-conversation",
                   help=f"{', '.join(TRACE_NAMES)}; or a Mooncake *.jsonl(.gz) file; or a directory of "
                        "kv-cache-tester trace_*.json.gz files")
    p.add_argument("--traces-root", type=Path, default=DEFAULT_TRACE_ROOT,
                   help="where the named traces live (default: the committed sample eval/traces, or "
                        "$SGLANG_EXT_TRACES; eval/traces/README.md)")
    p.add_argument("--requests", type=int, default=600, help="replay the first N requests in time order")
    p.add_argument("--sessions", type=int, default=48,
                   help="kv-cache-tester: conversations loaded (the first N files), interleaved by arrival time")
    p.add_argument("--skip-sessions", type=int, default=0,
                   help="kv-cache-tester: leave out the first N conversations (files in name order), e.g. to replay "
                        "sessions held out from the ones the defaults use")
    p.add_argument("--session-gap-s", type=float, default=KvLoadOptions.arrival_gap_s,
                   help="kv-cache-tester: mean gap between conversation starts (seeded Poisson)")
    p.add_argument("--tokens-per-block", type=int, default=None,
                   help="synthetic tokens per trace block (default: 16 for Mooncake, 1 for kv-cache-tester)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic token ids")
    p.add_argument("--max-total-tokens", type=int, default=262144, help="KV pool of every server (tokens)")
    p.add_argument("--max-mamba-cache-size", type=int, default=32, help="recurrent-state slots of every server")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (1: one at a time)")
    p.add_argument("--new-tokens", type=int, default=1, help="greedy output tokens per request")
    p.add_argument("--typed", action="store_true",
                   help="send each request's token-type spans and session (custom_params token_types / "
                        "session, read by --radix-eviction-policy sae; docs/saecache.md section 7)")
    p.add_argument("--session-ids", action="store_true",
                   help="send each request's conversation as SGLang's top-level session_id (read by "
                        "--enable-session-radix-cache)")
    p.add_argument("--servers", nargs="+", default=["stock", BACKEND_NAME],
                   help="server specs: [LABEL=]KIND[:JSON] [SGLANG ARGS...], KIND stock or tail_replay; "
                        "e.g. stock 'tail_replay:{\"keep_checkpoints\": false}' "
                        "'lfu=stock --radix-eviction-policy lfu'")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help="sglang serve arguments for every server (shell-quoted)")
    p.add_argument("--baseline", default=None,
                   help="label of the server every other one is compared with per request (reuse on its hits, "
                        "exact hits lost, TTFT p50 on its hits); e.g. stock SGLang with extra_buffer")
    p.add_argument("--reference", default=None,
                   help="label of a server without cache (`stock --disable-radix-cache`): each server's share of "
                        "requests whose greedy output equals it")
    p.add_argument("--workers", type=int, default=1,
                   help="workers per server spec: above 1, each spec runs as `sglang-ext cluster` (SGLang's "
                        "router, pip smg, in front of N workers with the spec's arguments; each worker gets the "
                        "whole --max-total-tokens / --max-mamba-cache-size) and requests go through the router")
    p.add_argument("--router-policy", default="cache_aware",
                   help="the router's policy with --workers > 1 (cache_aware, round_robin, ...)")
    p.add_argument("--boot", choices=("together", "each"), default="each",
                   help="each: boot each server only for its own replay; together: boot all at once, "
                        "replay one after another (idle servers sleep)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: build the tiny Qwen3-Next fixture under --out)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--allow-busy", action="store_true",
                   help="report timings taken on a busy machine (labelled busy) instead of withholding them")
    p.add_argument("--max-other-cpu", type=float, default=25.0,
                   help="busy threshold: %% of all CPUs used by other processes")
    p.add_argument("--load-sample-s", type=float, default=2.0, help="seconds of each machine-load sample")
    p.add_argument("--profile", action="store_true",
                   help="sample each server's scheduler with py-spy during its replay: scheduler time per "
                        "request in and outside the forward, the functions that take it, and the differences "
                        "from --baseline (eval/replay/profile.py); raw stacks as pyspy-<server>.txt")
    return p


# ---------------------------------------------------------------------------- trace

def load_trace(args) -> tuple[dict, list[ScaledRequest]]:
    """(trace description, scaled requests) for the options."""
    kind, path = _resolve_trace(args.trace, args.traces_root)
    tokens_per_block = args.tokens_per_block or (16 if kind == "mooncake" else 1)
    if kind == "mooncake":
        trace = load_mooncake(path, limit=args.requests)
        sessions_loaded = None
    else:
        trace = load_kv_cache_tester(path, KvLoadOptions(arrival_gap_s=args.session_gap_s,
                                                         limit_files=args.sessions, skip_files=args.skip_sessions))
        available = len(list(path.glob("trace_*.json.gz"))) - args.skip_sessions
        if available < 1:
            raise ReplayError(f"--skip-sessions {args.skip_sessions}: {path} has no conversation after those")
        sessions_loaded = min(args.sessions, available)
    scaled = scale_trace(trace, tokens_per_block, args.requests, seed=args.seed)
    if not scaled:
        raise ReplayError(f"--trace {args.trace}: no request with at least one block")
    info = {"name": trace.name, "path": str(path), "format": kind, "block_tokens": trace.block_tokens,
            "tokens_per_block": tokens_per_block, "requests": len(scaled),
            "sessions_loaded": sessions_loaded,
            "sessions_in_replay": len({r.session for r in scaled}) if kind != "mooncake" else None,
            "prompt_tokens": sum(len(r.tokens) for r in scaled),
            "max_prompt_tokens": max(len(r.tokens) for r in scaled), "notes": list(trace.notes)}
    return info, scaled


def _resolve_trace(name: str, root: Path) -> tuple[str, Path]:
    if name in TRACE_NAMES:
        kind, rel = TRACE_NAMES[name]
        path = Path(root) / rel
        if not path.exists():
            raise ReplayError(f"--trace {name}: {path} does not exist (set --traces-root)")
        return kind, path
    path = Path(name)
    if path.is_dir():
        return "kv-cache-tester", path
    if path.is_file() and (path.name.endswith(".jsonl.gz") or path.name.endswith(".jsonl")):
        return "mooncake", path
    raise ReplayError(f"--trace {name!r}: not a known trace ({', '.join(TRACE_NAMES)}), a Mooncake "
                      ".jsonl(.gz) file or a kv-cache-tester directory")


# ---------------------------------------------------------------------------- model

def resolve_model(args) -> Path:
    if args.model is None:
        from eval.fixtures.tiny import build_tiny_model

        model = args.out / "model-qwen3-next"
        if not (model / "config.json").exists():
            build_tiny_model("qwen3-next", model, seed=0)
    else:
        model = Path(args.model)
    config = model / "config.json"
    if not config.exists():
        raise ReplayError(f"--model {model}: no config.json there")
    vocab = json.loads(config.read_text()).get("vocab_size")
    if vocab is not None and vocab < TOKEN_HI:
        raise ReplayError(f"--model {model}: vocab_size {vocab} < {TOKEN_HI}, the synthetic ids' range")
    return model


# ---------------------------------------------------------------------------- replay

def request_custom_params(req: ScaledRequest) -> dict:
    """`--typed`: the request's spans and (for traces with sessions) its session."""
    out: dict = {"token_types": [list(s) for s in req.spans]}
    if req.session is not None and req.session >= 0:
        out["session"] = int(req.session)
    return out


def replay_requests(url: str, requests: list[ScaledRequest], new_tokens: int, concurrency: int,
                    desc: str, typed: bool = False, session_ids: bool = False,
                    router_metrics: str | None = None) -> tuple[list[dict], float]:
    """Send every request (at most `concurrency` in flight, submitted in order); records in
    request order and the wall time from the first send to the last answer. `router_metrics`:
    the router's Prometheus URL; one request at a time, each record gets the router's decision
    for it (`router`: its predicted match ratio and branch, eval/replay/router.py)."""
    per_request = router_metrics is not None and concurrency == 1

    def one(req: ScaledRequest) -> dict:
        before = _router_counters(router_metrics) if per_request else None
        resp = stream_generate(url, list(req.tokens), new_tokens,
                               custom_params=request_custom_params(req) if typed else None,
                               session_id=f"conversation-{req.session}" if session_ids and req.session >= 0 else None)
        details = (resp.meta_info.get("cached_tokens_details") or {}) if resp.ok else {}
        rec = {"index": req.index, "session": req.session, "prompt_tokens": len(req.tokens),
               "ok": resp.ok, "error": resp.error,
               "cached_tokens": int(resp.meta_info.get("cached_tokens") or 0) if resp.ok else 0,
               "tail_replay": details.get(META_KEY), "ttft_s": resp.ttft_s,
               "latency_s": resp.latency_s, "output_ids": list(resp.output_ids)}
        if before is not None:
            rec["router"] = one_decision(_router_counters(router_metrics).since(before))
        return rec

    records: list[dict] = [None] * len(requests)  # type: ignore[list-item]
    bar = tqdm(total=len(requests), desc=desc, unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, req) for req in requests]
        for i, future in enumerate(futures):
            records[i] = future.result()
            bar.update(1)
    wall = time.perf_counter() - t0
    bar.close()
    return records, wall


def _warm_and_flush(url: str, tokens_per_block: int, seed: int) -> None:
    """One unrelated request (first-call costs out of the timings), then an empty cache."""
    warm = block_tokens([WARMUP_BLOCK + i for i in range(max(1, 64 // tokens_per_block))], tokens_per_block, seed)
    resp = stream_generate(url, [int(t) for t in warm], 1)
    if not resp.ok:
        raise RuntimeError(f"warm-up request failed on {url}: {resp.error}")
    flush_cache(url)


def _server_threads(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.num_threads() for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def _slug(label: str, i: int) -> str:
    return f"{i}-{re.sub(r'[^A-Za-z0-9_.+-]+', '_', label).strip('_')[:60]}"


def run_server(spec: ServerSpec, i: int, server, all_pids: list[int], scaled, refs, args, trace_info) -> tuple[dict, list[dict]]:
    """Warm, flush, sample the load, replay; the server's summary row and its request records
    (with the timings removed when they are withheld). `server`: a ServerProcess, or a
    ClusterProcess whose router takes the requests (every worker is warmed and flushed)."""
    url = server.url
    for worker_url in _worker_urls(server):
        _warm_and_flush(worker_url, trace_info["tokens_per_block"], args.seed)
    load = sample_load(exclude_pids=all_pids, seconds=args.load_sample_s)
    threads = sum(_server_threads(pid) for pid in _pids(server))
    router_metrics = server.router_metrics_url if isinstance(server, ClusterProcess) else None
    router_before = _router_counters(router_metrics) if router_metrics else None
    sampler = (Sampler(scheduler_pid(server.proc.pid), args.out / f"pyspy-{_slug(spec.label, i)}.txt").start()
               if getattr(args, "profile", False) else None)
    single = not isinstance(server, ClusterProcess)
    cpu_before = process_cpu_seconds(server.proc.pid) if single else None
    window = CpuWindow(all_pids + ([sampler.proc.pid] if sampler else [])).start()
    try:
        records, wall = replay_requests(url, scaled, args.new_tokens, args.concurrency, spec.label,
                                       typed=args.typed, session_ids=args.session_ids, router_metrics=router_metrics)
        other_during = window.stop()   # while py-spy still runs: its CPU is counted as ours, not as other load
        process_cpu = cpu_per_request(cpu_before, process_cpu_seconds(server.proc.pid), len(scaled)) if single else None
    finally:
        if sampler is not None:
            sampler.stop()
    prediction = (prediction_summary(records, _router_counters(router_metrics).since(router_before))
                  if router_metrics else None)
    worker_tokens = [_prompt_tokens_served(u) for u in _worker_urls(server)] if isinstance(server, ClusterProcess) else None
    background = background_runs([requests.get(f"{u}/metrics", timeout=60).text for u in _worker_urls(server)])
    busy = max(load.other_cpu_percent, other_during) > args.max_other_cpu
    withheld = None
    if busy and not args.allow_busy:
        withheld = (f"machine busy: other processes used {load.other_cpu_percent:.0f}% of the CPUs before "
                    f"and {other_during:.0f}% during the replay (limit {args.max_other_cpu:g}%); "
                    f"rerun on a quiet machine or pass --allow-busy")
    for rec, ideal, lru in zip(records, refs["ideal"].per_request, refs["lru"].per_request):
        rec["ideal_tokens"], rec["lru_bound_tokens"] = ideal, lru
        if withheld:
            rec["ttft_s"] = rec["latency_s"] = None
    timing = {"wall_s": wall, "machine_load": load.as_dict(), "other_cpu_percent_during": other_during,
              "busy": busy, "timings_withheld": withheld, "server_threads": threads,
              "server_env": {k: v for k, v in os.environ.items() if THREAD_ENV.match(k)},
              "launch_args": spec.launch_args(_common_args(args)),
              "workers": args.workers, "router_policy": args.router_policy if args.workers > 1 else None,
              "worker_prompt_tokens": worker_tokens, "background_runs": background,
              "router_prediction": prediction, "process_cpu_ms_per_request": process_cpu}
    row = summarize(spec.label, records, refs["ideal"].total, refs["lru"].total, timing)
    if sampler is not None:
        row["profile"] = summarize_profile(sampler.raw, len(records), sampler.rate)
    slug = _slug(spec.label, i)
    with open(args.out / f"requests-{slug}.jsonl", "w") as handle:
        for rec in records:
            handle.write(json.dumps(rec) + "\n")
    return row, records


class ClusterProcess:
    """One server spec as `sglang-ext cluster` (router + `workers` workers), with the
    ServerProcess interface the replay uses (`url`, `launch`, `wait_ready`, `stop`)."""

    def __init__(self, model: str, worker_args: list[str], workers: int, policy: str, log_dir: Path) -> None:
        from sglang_ext.cluster import Cluster, parse_cluster_args

        argv = ["--workers", str(workers), "--policy", policy, "--port", "0", "--log-dir", str(log_dir),
                "--", "--model-path", model, *worker_args]
        self.cluster = Cluster(parse_cluster_args(argv))
        self.url = self.cluster.spec.url

    @property
    def worker_urls(self) -> list[str]:
        """The workers' URLs as started (a worker whose port was taken gets a fresh one)."""
        return self.cluster.spec.worker_urls()

    @property
    def router_metrics_url(self) -> str:
        """The router's Prometheus endpoint (`sglang-ext cluster` starts it with one)."""
        return f"http://{self.cluster.spec.host}:{self.cluster.spec.metrics_port}/metrics"

    def launch(self) -> ClusterProcess:
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> ClusterProcess:
        self.cluster.start(timeout_s)
        return self

    def pids(self) -> list[int]:
        return [p.pid for p in self.cluster.processes()]

    def signal_stop(self) -> None:
        """`stop_servers`' first step: the cluster stops whole here (router first, then every
        worker and the store, each its own process group); `finish_stop` has nothing left."""
        self.cluster.stop()

    def finish_stop(self, grace_s: float = 20.0) -> None:
        return None

    def stop(self) -> None:
        self.cluster.stop()


_PROMPT_TOKENS = re.compile(r"^sglang:prompt_tokens_total\{[^}]*\} (\S+)$", re.M)
_REPAIRS = re.compile(r'^sglang_ext:tail_replay_repairs_total\{[^}]*kind="([^"]+)"[^}]*\} (\S+)$', re.M)


def background_runs(metrics_texts: list[str]) -> dict[str, int]:
    """Exact repair runs the servers sent themselves and finished by now, by kind, summed over
    workers (`sglang_ext:tail_replay_repairs_total`; none on stock SGLang): work beside the
    replayed traffic that its TTFTs pay for."""
    runs: dict[str, int] = {}
    for text in metrics_texts:
        for kind, value in _REPAIRS.findall(text):
            runs[f"repair {kind}"] = runs.get(f"repair {kind}", 0) + int(float(value))
    return {k: v for k, v in sorted(runs.items()) if v}


def _router_counters(url: str) -> RouterCounters:
    resp = requests.get(url, timeout=60)
    resp.raise_for_status()
    return RouterCounters.parse(resp.text)


def _prompt_tokens_served(url: str) -> int:
    """Prompt tokens a worker has served (its `/metrics`; the CPU launcher turns metrics on),
    warm-up included: how the router spread the replay."""
    resp = requests.get(f"{url}/metrics", timeout=60)
    resp.raise_for_status()
    return int(sum(float(v) for v in _PROMPT_TOKENS.findall(resp.text)))


def _pids(server) -> list[int]:
    return server.pids() if isinstance(server, ClusterProcess) else [server.proc.pid]


def _worker_urls(server) -> list[str]:
    return server.worker_urls if isinstance(server, ClusterProcess) else [server.url]


def _common_args(args) -> list[str]:
    return shlex.split(args.server_args) + ["--max-total-tokens", str(args.max_total_tokens),
                                            "--max-mamba-cache-size", str(args.max_mamba_cache_size)]


def run(args) -> dict:
    """The whole replay; writes report.json, report.md, replay.png and per-request JSONL."""
    from eval.harness import ServerProcess, servers_running

    for flag in ("requests", "concurrency", "new_tokens", "max_total_tokens", "max_mamba_cache_size", "sessions",
                 "workers"):
        if getattr(args, flag) < 1:
            raise ReplayError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.skip_sessions < 0:
        raise ReplayError(f"--skip-sessions must be >= 0, got {args.skip_sessions}")
    specs = parse_server_specs(args.servers)
    if getattr(args, "profile", False):
        if args.workers > 1:
            raise ReplayError("--profile samples one server's scheduler; it does not combine with --workers > 1")
        try:
            py_spy()
        except ProfileError as err:
            raise ReplayError(str(err)) from None
    args.out.mkdir(parents=True, exist_ok=True)
    start_load = sample_load(seconds=args.load_sample_s)
    require_quiet(start_load, args.allow_busy, args.max_other_cpu)
    trace_info, scaled = load_trace(args)
    sequences = [r.tokens for r in scaled]
    refs = {"ideal": ideal_curve(sequences), "lru": lru_curve(sequences, args.max_total_tokens)}
    model = resolve_model(args)
    if args.workers > 1:
        from sglang_ext.cluster import ROUTER_POLICIES, router_available

        if args.router_policy not in ROUTER_POLICIES:
            raise ReplayError(f"--router-policy {args.router_policy!r}: use one of {ROUTER_POLICIES}")
        if not router_available():
            raise ReplayError("--workers > 1 needs SGLang's router: pip install 'sglang-hybrid-cache[scale]'")
        procs: list = [ClusterProcess(str(model), spec.launch_args(_common_args(args)), args.workers,
                                      args.router_policy, args.out / f"cluster-{_slug(spec.label, i)}")
                       for i, spec in enumerate(specs)]
    else:
        procs = [ServerProcess(str(model), spec.launch_args(_common_args(args)),
                               log_path=args.out / f"server-{_slug(spec.label, i)}.log")
                 for i, spec in enumerate(specs)]
    rows, per_server = [], {}
    groups = [list(range(len(specs)))] if args.boot == "together" else [[i] for i in range(len(specs))]
    for group in groups:
        with servers_running([procs[i] for i in group]):
            pids = [pid for i in group for pid in _pids(procs[i])]
            for i in group:
                row, records = run_server(specs[i], i, procs[i], pids, scaled, refs, args, trace_info)
                rows.append(row)
                per_server[specs[i].label] = records
    for label in (args.baseline, args.reference):
        if label is not None and label not in per_server:
            raise ReplayError(f"--baseline/--reference {label!r} is not a --servers label ({sorted(per_server)})")
    for row in rows:
        if args.baseline is not None:
            row["vs_baseline"] = compare_to_baseline(per_server[row["server"]], per_server[args.baseline])
        if args.reference is not None:
            row["same_output"] = same_outputs(per_server[row["server"]], per_server[args.reference])
    argv = getattr(args, "argv", None)
    command = "python -m eval.replay " + shlex.join(argv) if argv is not None else shlex.join(sys.argv)
    report = {"command": command, "trace": trace_info,
              "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                          if k != "argv"},
              "model": str(model), "start_load": start_load.as_dict(),
              "references": {"ideal_tokens": refs["ideal"].total, "lru_bound_tokens": refs["lru"].total,
                             "lru_capacity_tokens": args.max_total_tokens},
              "servers": rows}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(_markdown(report))
    ttfts = {r["server"]: [x["ttft_s"] for x in per_server[r["server"]] if x["ok"]]
             for r in rows if r["ttft_s"] is not None}
    plot(args.out / "replay.png", per_server, ttfts, refs["ideal"].per_request, refs["lru"].per_request,
         _title(trace_info, args))
    return report


def _title(info: dict, args) -> str:
    workers = getattr(args, "workers", 1)
    cluster = f", {workers} workers behind the router ({args.router_policy})" if workers > 1 else ""
    return (f"{info['name']}: {info['requests']} requests, {info['tokens_per_block']} tokens/block, "
            f"KV pool {args.max_total_tokens:,}, {args.max_mamba_cache_size} state slots, "
            f"concurrency {args.concurrency}, {args.new_tokens} new token(s){cluster}")


def _markdown(report: dict) -> str:
    info, refs = report["trace"], report["references"]
    load = report["start_load"]
    lines = [f"# Trace replay: {_title(info, argparse.Namespace(**report['options']))}", "",
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
    options = report["options"]
    if options.get("baseline") or options.get("reference"):
        lines += [comparison_table(report["servers"], options.get("baseline"), options.get("reference")), ""]
    for row in report["servers"]:
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        report = run(args)
    except (ReplayError, ServerSpecError, BusyMachineError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print((args.out / "report.md").read_text())
    print(f"wrote {args.out}/report.json, report.md, replay.png")
    return 0 if all(r["errors"] == 0 for r in report["servers"]) else 1
