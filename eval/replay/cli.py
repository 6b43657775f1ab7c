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
import sys
from pathlib import Path

from eval.machine import BusyMachineError
from eval.replay.inputs import TRACE_NAMES, ReplayError
from eval.replay.real_models import GPUS, MODELS
from eval.replay.runner import run
from eval.replay.servers import ServerSpecError
from eval.trace_sim.loaders import DEFAULT_TRACE_ROOT, KvLoadOptions
from sglang_ext.tail_replay import BACKEND_NAME

#: --mem-fraction-static 0.5: SGLang refuses to start when free memory drops by more than
#: (1 - fraction) while it loads the weights, which other jobs on a shared machine cause; the pools
#: are sized by --max-total-tokens / --max-mamba-cache-size anyway
DEFAULT_SERVER_ARGS = "--dtype float32 --log-level warning --mem-fraction-static 0.5"


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
    p.add_argument("--real-tokens-per-token", type=float, default=None,
                   help="real tokens one replayed token stands for, in --equal-bytes-gib's KV bytes and the modeled "
                        "GPU TTFT (default: the trace's block size / --tokens-per-block, e.g. 64 for kv-cache-tester)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic token ids")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool of every server (tokens; default 262144; not with --equal-bytes-gib)")
    p.add_argument("--max-mamba-cache-size", type=int, default=None,
                   help="recurrent-state slots of every server (default 32; not with --equal-bytes-gib)")
    p.add_argument("--equal-bytes-gib", type=float, default=None,
                   help="give every server the same memory, this many GiB of --bytes-model's KV and state, "
                        "split its own way: stock by SGLang's sizing, tail_replay by its running batch's slots "
                        "plus --tail-replay-checkpoint-slots (eval/replay/budget.py); the report says each split")
    p.add_argument("--bytes-model", default="qwen3-next-80b-a3b",
                   help=f"the real model whose bytes price the budget ({', '.join(MODELS)})")
    p.add_argument("--tail-replay-checkpoint-slots", type=int, nargs="+", default=[8],
                   help="--equal-bytes-gib: state slots each tail_replay server keeps for checkpoints beyond its "
                        "running batch's; several values sweep the split (one server per value, LABEL@Nckpt)")
    p.add_argument("--gpu", default="h100-sxm", help=f"modeled GPU TTFT: the GPU ({', '.join(GPUS)})")
    p.add_argument("--gpu-model", default="qwen3-next-80b-a3b",
                   help="modeled GPU TTFT: the model (docs/gpu_ttft_model.md)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (1: one at a time)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="open loop instead of --concurrency: requests per second, Poisson arrivals seeded by --seed "
                        "(the same for every server); each server's report row gets its CPU goodput at --slo-s "
                        "(--concurrency then only sizes Tail-Replay's running batch in an --equal-bytes-gib split)")
    p.add_argument("--slo-s", type=float, default=1.0,
                   help="the TTFT SLO of the CPU goodput of an open-loop replay (default 1 s)")
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
    p.add_argument("--server-env", nargs=2, action="append", default=[], metavar=("LABEL", "NAME=VALUE"),
                   help="an environment variable for one server spec only (repeatable), e.g. "
                        "--server-env stock_py SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python: stock on SGLang's "
                        "Python tree core, the one Tail-Replay's components run on")
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
