"""``python -m eval.trace_sim run|bound|adapt ...``: capacity sweeps, the noisy-Belady bound and the adaptation test."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .ablations import SIM_POLICIES
from .adapt import adaptation_markdown, run_adaptation
from .bound import run_bound
from .cost_model import DEFAULT_COST_MODEL, load_cost_model
from .loaders import DEFAULT_TRACE_ROOT, KvLoadOptions, load_named_trace
from .report import annotate, markdown, plot
from .simulate import prepare, run_policy
from .synthetic import default_spec, generate

TRACES = ("kv-cache-tester", "mooncake-conversation", "mooncake-synthetic", "synthetic")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [n for n in names if n not in SIM_POLICIES and n not in TRACES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown name(s) {unknown}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.trace_sim")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="capacity sweep over traces and policies")
    run.add_argument("--trace", type=_names, default=["kv-cache-tester"],
                     help=f"comma-separated, from {', '.join(TRACES)}")
    run.add_argument("--capacities", type=_floats, default=[0.05, 0.1, 0.2, 0.4],
                     help="fractions of the trace's distinct blocks")
    run.add_argument("--policies", type=_names, default=list(SIM_POLICIES),
                     help=f"comma-separated, from {', '.join(SIM_POLICIES)}")
    _common(run)
    _trace_options(run)
    bound = sub.add_parser("bound", help="Belady with noisy arrival times: how much future "
                                         "knowledge the LRU-to-Belady gap needs")
    bound.add_argument("--trace", type=_names, default=["kv-cache-tester"])
    bound.add_argument("--capacities", type=_floats, default=[0.005, 0.01, 0.02])
    bound.add_argument("--sigmas", type=_sigmas, default=[0.5, 1.0, 2.0],
                       help="log-normal errors of the arrival times, comma-separated")
    _common(bound)
    _trace_options(bound)
    adapt = sub.add_parser("adapt", help="SAE learned on one synthetic mix, run on a shifted mix")
    adapt.add_argument("--capacity", type=float, default=0.05)
    adapt.add_argument("--hours", type=float, default=1.0)
    _common(adapt)
    return parser


def _sigmas(text: str) -> list[float]:
    values = _floats(text)
    bad = [v for v in values if not 0.0 <= v < float("inf")]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"sigmas must be finite numbers >= 0, got {text!r}")
    return values


def _trace_options(parser) -> None:
    parser.add_argument("--kv-arrival-gap", type=float, default=KvLoadOptions.arrival_gap_s,
                        help="mean seconds between conversation starts (kv-cache-tester)")
    parser.add_argument("--kv-limit-files", type=int, default=None)
    parser.add_argument("--no-output-caching", action="store_true",
                        help="do not cache generated tokens at request finish (kv-cache-tester)")


def _common(parser) -> None:
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--traces-root", type=Path, default=DEFAULT_TRACE_ROOT,
                        help="folder of the named traces (default: the committed sample eval/traces, or $SGLANG_EXT_TRACES)")
    parser.add_argument("--cost-model", type=Path, default=DEFAULT_COST_MODEL)
    parser.add_argument("--seed", type=int, default=0)


def load_trace(name: str, args):
    if name == "synthetic":
        return generate(default_spec(args.seed))
    options = KvLoadOptions(arrival_gap_s=args.kv_arrival_gap, seed=args.seed,
                            cache_outputs=not args.no_output_caching,
                            limit_files=args.kv_limit_files)
    return load_named_trace(name, args.traces_root, options)


def command_run(args, command: str) -> None:
    cost = load_cost_model(args.cost_model)
    print(f"cost model source: {cost.source}", file=sys.stderr)
    rows = []
    for name in args.trace:
        started = time.perf_counter()
        prepared = prepare(load_trace(name, args))
        infinite = prepared.infinite_cache_hit_ratio()
        jobs = [(c, p) for c in args.capacities for p in args.policies]
        for cap, policy in tqdm(jobs, desc=name, unit="run"):
            result = run_policy(prepared, policy, cap, cost, progress=True)
            rows.append({"trace": name, "distinct_blocks": prepared.distinct_blocks,
                         "infinite_hit_ratio": infinite, **result})
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        _write(args.out, rows, cost, command)


def _write(out: Path, rows: list[dict], cost, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = annotate(rows)
    header = {"command": f"`{command}`", "cost model source": cost.source,
              "cost model": f"a={cost.a:g} s, b={cost.b:g} s/token, c={cost.c:g} s/token^2"}
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "report.md").write_text(markdown(rows, header))
    plot(rows, out)


def command_bound(args, command: str) -> None:
    cost = load_cost_model(args.cost_model)
    print(f"cost model source: {cost.source}", file=sys.stderr)
    rows = []
    for name in args.trace:
        prepared = prepare(load_trace(name, args))
        infinite = prepared.infinite_cache_hit_ratio()
        for cap in args.capacities:
            rows += [{"trace": name, "distinct_blocks": prepared.distinct_blocks,
                      "infinite_hit_ratio": infinite, **row}
                     for row in run_bound(prepared, cap, cost, args.sigmas, seed=args.seed)]
        _write(args.out, rows, cost, command)


def command_adapt(args, command: str) -> None:
    cost = load_cost_model(args.cost_model)
    print(f"cost model source: {cost.source}", file=sys.stderr)
    rows = run_adaptation(args.capacity, cost, seed=args.seed, hours=args.hours)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapt.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = adaptation_markdown(rows, args.capacity, command, cost.source)
    (args.out / "adapt.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = "python -m eval.trace_sim " + " ".join(shlex.quote(a) for a in argv)
    {"run": command_run, "bound": command_bound, "adapt": command_adapt}[args.command](args, command)
