"""The exactness fuzzer's long run: seeds against every server configuration in
`eval.fuzz.configs.CONFIGS` until a wall-clock deadline, then a report.

    python -m benchmarks.exactness_fuzz --until 02:50 --out docs/results/exactness-fuzz

Starts one server without cache per model (the reference), measures its run-to-run noise (the
exactness tolerance follows from it), then runs the configurations one after the other, each for an
equal share of the time left, seed after seed (`--ops` ops per seed, `--concurrency` side by side).
Also tries `--tp 2` on the CPU path once and records whether the server starts (and if not, the
error). Writes report.json (every count and violation, each with its reproduction) and report.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import time
from pathlib import Path

from eval.fixtures.tiny import build_tiny_model
from eval.fuzz.configs import CONFIGS, no_cache_server
from eval.fuzz.reference import NoCacheReference, measure_noise
from eval.fuzz.report import write_report
from eval.fuzz.runner import fuzz_server
from eval.fuzz.workload import generate_workload
from eval.harness import ServerProcess, servers_running

TP2_TIMEOUT_S = 300.0


def _deadline(until: str) -> float:
    """Monotonic time of the next UTC `HH:MM`."""
    now = dt.datetime.now(dt.timezone.utc)
    hh, mm = map(int, until.split(":"))
    end = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    if end <= now:
        end += dt.timedelta(days=1)
    return time.monotonic() + (end - now).total_seconds()


def try_tp2(model: Path, logs: Path) -> dict:
    """Whether the CPU path serves `--tp 2` (without and with SGLang's CPU thread binding)."""
    attempts = []
    for env in ({}, {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}):
        server = ServerProcess(str(model), ["--dtype", "float32", "--radix-cache-backend", "tail_replay", "--tp", "2"],
                               log_path=logs / f"tp2-{len(attempts)}.log", env=env)
        try:
            server.start(TP2_TIMEOUT_S)
            server.stop()
            attempts.append({"env": env, "started": True})
            break
        except (RuntimeError, TimeoutError) as err:
            log = server.log_text()
            errors = [line for line in log.splitlines() if "Error" in line and ":" in line]
            attempts.append({"env": env, "started": False, "error": errors[-1][:600] if errors else str(err)[:300]})
    return {"started": any(a["started"] for a in attempts), "attempts": attempts}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--until", required=True, help="UTC HH:MM by which the run ends")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from eval.fuzz.configs")
    ap.add_argument("--ops", type=int, default=48, help="ops per seed")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--work", default="runs/exactness-fuzz", help="models and server logs")
    ap.add_argument("--out", default="docs/results/exactness-fuzz")
    ap.add_argument("--skip-tp2", action="store_true")
    args = ap.parse_args(argv)
    deadline = _deadline(args.until)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    work = Path(args.work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    archs = sorted({CONFIGS[n].arch for n in names})
    models = {a: build_tiny_model(a, work / "models" / a, seed=0) for a in archs}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.split("\n")
    report: dict = {"started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                    "modified_files": [line[3:] for line in dirty if line.strip()],
                    "ops_per_seed": args.ops, "concurrency": args.concurrency, "configs": {}, "noise": {}}
    report["tp2"] = None if args.skip_tp2 else try_tp2(models["qwen3-next"] if "qwen3-next" in models
                                                         else models[archs[0]], logs)
    refs = {a: no_cache_server(str(models[a]), logs / f"no-cache-{a}.log") for a in archs}
    with servers_running(list(refs.values())):
        references = {a: NoCacheReference(refs[a].url) for a in archs}
        for a in archs:
            probe = generate_workload(0, 24)
            prompts = [op["ids"] for op in probe.ops() if op["op"] == "generate" and "continue_of" not in op][:6]
            report["noise"][a] = measure_noise(references[a], prompts)
        seed = args.first_seed
        for i, name in enumerate(names):
            config = CONFIGS[name]
            share = (deadline - time.monotonic()) / (len(names) - i)
            server = config.server(str(models[config.arch]), logs / f"{name}.log")

            def restart(server=server, base=server.log_path) -> None:
                """A new log file; the port (and a storage configuration's files) kept."""
                server.stop()
                server.log_path = base.with_suffix(f".{time.time_ns()}.log")
                server.start()

            try:
                with servers_running([server]):
                    result = fuzz_server(server, references[config.arch], list(range(seed, seed + 10_000)), args.ops,
                                         config.shape(), report["noise"][config.arch]["tolerance"], args.concurrency,
                                         deadline=time.monotonic() + share, restart=restart,
                                         all_exact=config.backend == "stock",
                                         pressure_tolerance=config.pressure_tolerance, storage=config.storage)
            except (RuntimeError, TimeoutError) as err:   # the configuration does not start
                errors = [line for line in server.log_text().splitlines() if "error" in line.lower() and ":" in line
                          and "Ignore import error" not in line]
                result = {"seeds": [], "ops": 0, "requests": 0, "statuses": {}, "claims": {}, "wall_s": 0.0,
                          "violations": [], "did_not_start": errors[-1][:600] if errors else str(err)[:300]}
            seed = max(result["seeds"], default=seed - 1) + 1
            report["configs"][name] = {"args": config.args(), "arch": config.arch, **result}
            report["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            write_report(report, Path(args.out))   # after each configuration: a cut-short run keeps its part
    print(f"report: {args.out}/report.md")


if __name__ == "__main__":
    main()
