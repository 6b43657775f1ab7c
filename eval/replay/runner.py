"""The whole replay (`run`): every server spec booted (alone or all together), warmed, flushed and
replayed in turn with the machine load sampled around it (`run_server`), then compared with the
baseline and the reference and written out (report.json, report.md, replay.png, per-request
JSONL)."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import psutil
import requests

from eval.machine import CpuWindow, require_quiet, sample_load
from eval.replay.bound import ideal_curve, lru_curve
from eval.replay.budget import GIB, Split, equal_bytes_specs
from eval.replay.client import replay_requests, warm_and_flush
from eval.replay.cluster import ClusterProcess, server_pids, server_worker_urls
from eval.replay.goodput import add_modeled_goodput
from eval.replay.gpu_model import add_modeled_ttft
from eval.replay.inputs import ReplayError, load_trace, resolve_model
from eval.replay.metrics import background_runs, prompt_tokens_served, router_counters, server_pools
from eval.replay.profile import (
    ProfileError,
    Sampler,
    cpu_per_request,
    process_cpu_seconds,
    py_spy,
    scheduler_pid,
    summarize_profile,
)
from eval.replay.real_models import gpu, real_model
from eval.replay.report import compare_to_baseline, plot, replay_title, report_markdown, same_outputs, summarize
from eval.replay.router import prediction_summary
from eval.replay.servers import ServerSpec, parse_server_specs

THREAD_ENV = re.compile(r"^(OMP_|KMP_|MKL_|GOMP_|SGLANG_EXT_CPU|TORCH_NUM)")


def _server_threads(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.num_threads() for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def _slug(label: str, i: int) -> str:
    return f"{i}-{re.sub(r'[^A-Za-z0-9_.+-]+', '_', label).strip('_')[:60]}"


def open_loop_goodput(records: list[dict], rate: float | None, slo_s: float) -> dict | None:
    """An open-loop replay's CPU goodput: the rate x the share of requests whose TTFT (from their
    scheduled arrival) is within the SLO, as aiperf's `--goodput time_to_first_token:<ms>`; a failed
    request or withheld timings count as missed. None for a closed-loop replay."""
    if rate is None:
        return None
    within = sum(1 for r in records if r.get("ok") and r.get("ttft_s") is not None and r["ttft_s"] <= slo_s)
    lags = [r.get("send_lag_s") or 0.0 for r in records]
    share = within / len(records) if records else 0.0
    return {"rate_per_s": rate, "slo_s": slo_s, "share_within_slo": share, "goodput_per_s": rate * share,
            "max_send_lag_s": max(lags, default=0.0)}


def server_envs(pairs: list[list[str]], specs: list[ServerSpec]) -> dict[str, dict[str, str]]:
    """`--server-env LABEL NAME=VALUE` pairs -> {label: {name: value}}; a label no spec has, or a
    pair without `NAME=`, is a ReplayError naming it."""
    labels, envs = {spec.label for spec in specs}, {}
    for label, assignment in pairs:
        name, eq, value = assignment.partition("=")
        if label not in labels:
            raise ReplayError(f"--server-env {label} {assignment}: no server spec is labelled {label!r} "
                              f"(labels: {', '.join(sorted(labels))})")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ReplayError(f"--server-env {label} {assignment}: expected NAME=VALUE")
        envs.setdefault(label, {})[name] = value
    return envs


def run_server(spec: ServerSpec, i: int, server, all_pids: list[int], scaled, refs, args, trace_info,
               split: Split | None = None) -> tuple[dict, list[dict]]:
    """Warm, flush, sample the load, replay; the server's summary row and its request records
    (with the timings removed when they are withheld). `server`: a ServerProcess, or a
    ClusterProcess whose router takes the requests (every worker is warmed and flushed)."""
    url = server.url
    pools = []
    for worker_url in server_worker_urls(server):
        warm_and_flush(worker_url, trace_info["tokens_per_block"], args.seed)
        pools.append(server_pools(worker_url))
        if split is not None and pools[-1]["kv_tokens"] is not None and pools[-1]["kv_tokens"] < split.kv_tokens:
            raise ReplayError(f"{spec.label}: the server holds {pools[-1]['kv_tokens']:,} KV tokens, fewer than its "
                              f"split's {split.kv_tokens:,} (memory on this machine); lower --equal-bytes-gib or "
                              "raise --mem-fraction-static in --server-args")
    load = sample_load(exclude_pids=all_pids, seconds=args.load_sample_s)
    threads = sum(_server_threads(pid) for pid in server_pids(server))
    router_metrics = server.router_metrics_url if isinstance(server, ClusterProcess) else None
    router_before = router_counters(router_metrics) if router_metrics else None
    sampler = (Sampler(scheduler_pid(server.proc.pid), args.out / f"pyspy-{_slug(spec.label, i)}.txt").start()
               if getattr(args, "profile", False) else None)
    single = not isinstance(server, ClusterProcess)
    cpu_before = process_cpu_seconds(server.proc.pid) if single else None
    window = CpuWindow(all_pids + ([sampler.proc.pid] if sampler else [])).start()
    try:
        records, wall = replay_requests(url, scaled, args.new_tokens, args.concurrency, spec.label,
                                       typed=args.typed, session_ids=args.session_ids, router_metrics=router_metrics,
                                       rate=getattr(args, "request_rate", None), seed=args.seed)
        other_during = window.stop()   # while py-spy still runs: its CPU is counted as ours, not as other load
        process_cpu = cpu_per_request(cpu_before, process_cpu_seconds(server.proc.pid), len(scaled)) if single else None
    finally:
        if sampler is not None:
            sampler.stop()
    prediction = (prediction_summary(records, router_counters(router_metrics).since(router_before))
                  if router_metrics else None)
    worker_tokens = [prompt_tokens_served(u) for u in server_worker_urls(server)] if isinstance(server, ClusterProcess) else None
    background = background_runs([requests.get(f"{u}/metrics", timeout=60).text for u in server_worker_urls(server)])
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
              "server_env": {**{k: v for k, v in os.environ.items() if THREAD_ENV.match(k)},
                             **server_envs([p for p in getattr(args, "server_env", []) if p[0] == spec.label],
                                           [spec]).get(spec.label, {})},
              "launch_args": spec.launch_args(_common_args(args, split)),
              "workers": args.workers, "router_policy": args.router_policy if args.workers > 1 else None,
              "worker_prompt_tokens": worker_tokens, "background_runs": background,
              "router_prediction": prediction, "process_cpu_ms_per_request": process_cpu, "server_pools": pools,
              "open_loop": open_loop_goodput(records, getattr(args, "request_rate", None), args.slo_s)}
    row = summarize(spec.label, records, refs["ideal"].total, refs["lru"].total, timing)
    if split is not None:
        row["memory_split"] = split.as_dict()
    if sampler is not None:
        row["profile"] = summarize_profile(sampler.raw, len(records), sampler.rate)
    slug = _slug(spec.label, i)
    with open(args.out / f"requests-{slug}.jsonl", "w") as handle:
        for rec in records:
            handle.write(json.dumps(rec) + "\n")
    return row, records


def _common_args(args, split: Split | None = None) -> list[str]:
    """Every server's arguments: --server-args, then the pools (the server's split under
    --equal-bytes-gib, else --max-total-tokens / --max-mamba-cache-size)."""
    if split is not None:
        return shlex.split(args.server_args) + split.flags()
    return shlex.split(args.server_args) + ["--max-total-tokens", str(args.max_total_tokens),
                                            "--max-mamba-cache-size", str(args.max_mamba_cache_size)]


def token_scale(args, trace_info: dict) -> float:
    """Real tokens each replayed token stands for: --real-tokens-per-token, else the trace's block
    size over --tokens-per-block (64 for kv-cache-tester at 1 per block, 32 for Mooncake at 16)."""
    given = getattr(args, "real_tokens_per_token", None)
    if given is not None:
        if not given > 0:
            raise ReplayError(f"--real-tokens-per-token must be > 0, got {given}")
        return float(given)
    return trace_info["block_tokens"] / trace_info["tokens_per_block"]


def _plan(args, scale: float = 1.0) -> tuple[list[ServerSpec], list[Split | None], int]:
    """The servers to replay, each with its split of the equal-bytes budget (None without one),
    and the LRU bound's capacity in tokens (the whole budget as KV under --equal-bytes-gib);
    `scale`: real tokens per replayed token."""
    specs = parse_server_specs(args.servers)
    try:   # checked before any server starts: add_modeled_ttft prices the replay with them at the end
        real_model(args.gpu_model), gpu(args.gpu)
    except ValueError as err:
        raise ReplayError(f"--gpu / --gpu-model: {err}") from None
    if getattr(args, "equal_bytes_gib", None) is None:
        for flag, default in (("max_total_tokens", 262144), ("max_mamba_cache_size", 32)):
            if getattr(args, flag, None) is None:
                setattr(args, flag, default)
        return specs, [None] * len(specs), args.max_total_tokens
    if args.max_total_tokens is not None or args.max_mamba_cache_size is not None:
        raise ReplayError("--equal-bytes-gib sets every server's pools: leave out --max-total-tokens and "
                          "--max-mamba-cache-size")
    if args.equal_bytes_gib <= 0:
        raise ReplayError(f"--equal-bytes-gib must be > 0, got {args.equal_bytes_gib}")
    try:
        model = real_model(args.bytes_model)
        budget = int(args.equal_bytes_gib * GIB)
        planned = equal_bytes_specs(specs, shlex.split(args.server_args), model, budget, args.concurrency,
                                    list(args.tail_replay_checkpoint_slots), scale)
    except ValueError as err:   # BudgetError, an unknown model
        raise ReplayError(f"--equal-bytes-gib: {err}") from None
    return [s for s, _ in planned], [sp for _, sp in planned], int(budget // (model.kv_bytes_per_token * scale))


def run(args) -> dict:
    """The whole replay; writes report.json, report.md, replay.png and per-request JSONL."""
    from eval.harness import ServerProcess, servers_running

    for flag in ("requests", "concurrency", "new_tokens", "max_total_tokens", "max_mamba_cache_size", "sessions",
                 "workers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ReplayError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.skip_sessions < 0:
        raise ReplayError(f"--skip-sessions must be >= 0, got {args.skip_sessions}")
    rate = getattr(args, "request_rate", None)
    if rate is not None and not (rate > 0 and rate < float("inf")):
        raise ReplayError(f"--request-rate must be a number of requests per second > 0, got {rate}")
    if not getattr(args, "slo_s", 1.0) > 0:
        raise ReplayError(f"--slo-s must be > 0, got {args.slo_s}")
    trace_info, scaled = load_trace(args)
    scale = token_scale(args, trace_info)
    trace_info["real_tokens_per_token"] = scale
    specs, splits, lru_capacity = _plan(args, scale)
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
    sequences = [r.tokens for r in scaled]
    refs = {"ideal": ideal_curve(sequences), "lru": lru_curve(sequences, lru_capacity)}
    model = resolve_model(args)
    envs = server_envs(args.server_env, specs)
    if args.workers > 1:
        if envs:
            raise ReplayError("--server-env applies to single servers; with --workers > 1 set the variable for "
                              "the whole replay")
        from sglang_ext.cluster import ROUTER_POLICIES, router_available

        if args.router_policy not in ROUTER_POLICIES:
            raise ReplayError(f"--router-policy {args.router_policy!r}: use one of {ROUTER_POLICIES}")
        if not router_available():
            raise ReplayError("--workers > 1 needs SGLang's router: pip install 'sglang-hybrid-cache[scale]'")
        procs: list = [ClusterProcess(str(model), spec.launch_args(_common_args(args, splits[i])), args.workers,
                                      args.router_policy, args.out / f"cluster-{_slug(spec.label, i)}")
                       for i, spec in enumerate(specs)]
    else:
        procs = [ServerProcess(str(model), spec.launch_args(_common_args(args, splits[i])),
                               log_path=args.out / f"server-{_slug(spec.label, i)}.log", env=envs.get(spec.label, {}))
                 for i, spec in enumerate(specs)]
    rows, per_server = [], {}
    groups = [list(range(len(specs)))] if args.boot == "together" else [[i] for i in range(len(specs))]
    for group in groups:
        with servers_running([procs[i] for i in group]):
            pids = [pid for i in group for pid in server_pids(procs[i])]
            for i in group:
                row, records = run_server(specs[i], i, procs[i], pids, scaled, refs, args, trace_info, splits[i])
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
    cpu_baseline = args.baseline or next((s.label for s in specs if s.kind == "stock"), None)
    gpu_model = add_modeled_ttft(rows, per_server, cpu_baseline, args.gpu_model, args.gpu, scale)
    goodput = add_modeled_goodput(rows, per_server, gpu_model, cpu_baseline)
    argv = getattr(args, "argv", None)
    command = "python -m eval.replay " + shlex.join(argv) if argv is not None else shlex.join(sys.argv)
    report = {"command": command, "trace": trace_info,
              "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                          if k != "argv"},
              "model": str(model), "start_load": start_load.as_dict(),
              "references": {"ideal_tokens": refs["ideal"].total, "lru_bound_tokens": refs["lru"].total,
                             "lru_capacity_tokens": lru_capacity},
              "gpu_model": gpu_model, "modeled_gpu_goodput": goodput, "servers": rows}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(report_markdown(report))
    ttfts = {r["server"]: [x["ttft_s"] for x in per_server[r["server"]] if x["ok"]]
             for r in rows if r["ttft_s"] is not None}
    plot(args.out / "replay.png", per_server, ttfts, refs["ideal"].per_request, refs["lru"].per_request,
         replay_title(trace_info, args))
    return report
