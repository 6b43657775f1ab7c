"""CPU serving latency alone vs beside two low-priority CPU jobs, old vs new launcher thread defaults.

One patched CPU server per variant (tiny Qwen3-Next fixture, `--radix-cache-backend tail_replay`),
all started at once and idle (`--sleep-on-idle`) while another is measured. Per repetition and
phase, each variant gets two requests (max_new_tokens=1):

  - "fresh": a never-seen document of D tokens + an S-token question (D + S = 8,064 by default):
    a full prefill;
  - "shared": the same document + another question: a prefix hit (Tail-Replay, 5% budget).

Phases: "alone", then "neighbours": N busy CPU jobs (`nice -n 19`, each in its own session like
another user's job, so Linux's autogroup scheduling shares the cores between sessions and the
nice value counts only inside the job's own session) run while the variants are measured; they
are bounded by `timeout` and killed after the phase, also on errors. Variant order alternates
between repetitions.

Variants: "old" = SGLANG_EXT_CPU_THREADS=keep (the launcher exports no thread settings: torch
and OpenMP defaults, every core, spinning waits), "new" = the launcher's defaults
(`sglang_ext.launcher.cpu_thread_env`); `--variant NAME:VAR=VAL,VAR=VAL` adds others. The
server environment never inherits this script's own OMP_* / MKL_* settings.

Reported per variant: median TTFT alone and with neighbours, their ratio (slowdown), the ratio to
the old defaults alone, and the server processes' user / system CPU seconds per request (spinning
OpenMP threads show up as system time). Machine load is sampled before each phase; on a busy
machine the script stops unless `--allow-busy` is given.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_neighbour.py --reps 2 --out runs/cpu_neighbour
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.harness import ServerProcess, servers_running  # noqa: E402
from sglang_ext.env import CPU_THREADS_VAR, THREAD_VARS  # noqa: E402
from sglang_ext.launcher import cpu_thread_env  # noqa: E402
from sglang_ext.tail_replay import DEFAULTS  # noqa: E402

TOKEN_LO, TOKEN_HI = 10, 500           # random prompt ids (the tiny model's vocabulary is 512)
#: this script's own thread settings, never passed to the servers
NEIGHBOURS = {
    # one busy Python thread each
    "spin": "while True: pass",
    # a matmul loop with torch's own (default: every core) OpenMP threads
    "matmul": "import torch\na = torch.randn(512, 512)\nwhile True: a @ a",
}
PHASES = ("alone", "neighbours")
REQUESTS = ("fresh", "shared")


class EnvServer(ServerProcess):
    """A ServerProcess started with its own environment."""

    def __init__(self, *args, env: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.env = env

    def launch(self) -> EnvServer:
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env)
        return self


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:VAR=VAL,VAR=VAL` -> (NAME, {VAR: VAL})."""
    name, _, rest = text.partition(":")
    if not name:
        raise SystemExit(f"--variant {text!r}: expected NAME:VAR=VAL,...")
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not VAR=VAL")
        env[var] = value
    return name, env


def server_env(overrides: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(overrides)
    return env


def server_cpu_times(server: ServerProcess) -> tuple[float, float]:
    """(user, system) CPU seconds used so far by the server's processes."""
    root = psutil.Process(server.proc.pid)
    user = system = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            user, system = user + t.user, system + t.system
        except psutil.NoSuchProcess:
            pass
    return user, system


def server_pids(servers) -> list[int]:
    pids = []
    for server in servers:
        root = psutil.Process(server.proc.pid)
        pids += [root.pid, *(p.pid for p in root.children(recursive=True))]
    return pids


def sample_load(exclude_pids: list[int], allow_busy: bool, first: bool) -> dict:
    """Machine load now (`eval.machine`, leaving out this script's processes); the `first` sample,
    taken before any neighbour job starts, refuses a busy machine unless `allow_busy`."""
    from eval.machine import require_quiet
    from eval.machine import sample_load as machine_sample_load

    load = machine_sample_load(exclude_pids=tuple(exclude_pids), seconds=1.0)
    if first:
        require_quiet(load, allow_busy)
    return {**load.as_dict(), "source": "eval.machine"}


def ask(server: ServerProcess, ids: list[int]) -> dict:
    u0, s0 = server_cpu_times(server)
    t0 = time.perf_counter()
    resp = requests.post(f"{server.url}/generate",
                         json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                         timeout=1800)
    ttft = time.perf_counter() - t0
    u1, s1 = server_cpu_times(server)
    resp.raise_for_status()
    meta = resp.json()["meta_info"]
    return {"ttft_s": ttft, "user_s": u1 - u0, "system_s": s1 - s0,
            "prompt_tokens": meta.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens")}


class Neighbours:
    """N `nice -n 19` busy jobs, each in its own session, bounded by `timeout`, always killed."""

    def __init__(self, kind: str, count: int, max_s: int):
        self.argv = ["timeout", str(max_s), "nice", "-n", "19", sys.executable, "-c", NEIGHBOURS[kind]]
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Neighbours:
        env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
        for _ in range(self.count):
            self.procs.append(subprocess.Popen(self.argv, start_new_session=True, env=env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(2.0)   # let them get going (the matmul one imports torch)
        return self

    def pids(self) -> list[int]:
        pids = []
        for proc in self.procs:
            try:
                pids += [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
            except psutil.NoSuchProcess:
                pass
        return pids

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.procs = []


def summarize(records: list[dict], variants: list[str]) -> list[dict]:
    def med(variant, phase, request, key="ttft_s"):
        xs = [r[key] for r in records if (r["variant"], r["phase"], r["request"]) == (variant, phase, request)]
        return statistics.median(xs) if xs else float("nan")

    rows = []
    for request in REQUESTS:
        old_alone = med("old", "alone", request) if "old" in variants else float("nan")
        for v in variants:
            alone, busy = med(v, "alone", request), med(v, "neighbours", request)
            rows.append({
                "request": request, "variant": v, "alone_s": alone, "neighbours_s": busy,
                "slowdown": busy / alone, "vs_old_alone": busy / old_alone,
                "alone_user_s": med(v, "alone", request, "user_s"),
                "alone_system_s": med(v, "alone", request, "system_s"),
                "neighbours_user_s": med(v, "neighbours", request, "user_s"),
                "neighbours_system_s": med(v, "neighbours", request, "system_s"),
                "ttft_s": {p: [r["ttft_s"] for r in records
                               if (r["variant"], r["phase"], r["request"]) == (v, p, request)] for p in PHASES},
            })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| request | variant | TTFT alone s | TTFT with neighbours s | slowdown | vs old alone | "
             "server CPU user / sys s alone | with neighbours |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['request']} | {r['variant']} | {r['alone_s']:.3f} | {r['neighbours_s']:.3f} | "
                     f"{r['slowdown']:.2f}x | {r['vs_old_alone']:.2f}x | "
                     f"{r['alone_user_s']:.2f} / {r['alone_system_s']:.2f} | "
                     f"{r['neighbours_user_s']:.2f} / {r['neighbours_system_s']:.2f} |")
    return "\n".join(lines)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from eval.fixtures.tiny import build_tiny_model

    model = out / "model-qwen3-next"
    if not (model / "config.json").exists():
        build_tiny_model("qwen3-next", model, seed=0)
    variants = {"old": {CPU_THREADS_VAR: "keep"}, "new": {}}
    for text in args.variant:
        name, env = parse_variant(text)
        variants[name] = env
    names = list(variants)
    common = ["--dtype", "float32", "--radix-cache-backend", "tail_replay",
              "--tail-replay-config", json.dumps({"budget": args.budget}),
              "--max-running-requests", "4", "--max-total-tokens", "65536",
              # a large static fraction leaves less slack to lose to other processes during start-up
              "--mem-fraction-static", "0.5", "--log-level", "warning"]
    servers = {name: EnvServer(str(model), common, log_path=out / f"server_{name}.log", env=server_env(env))
               for name, env in variants.items()}
    cpus = len(os.sched_getaffinity(0))
    effective = {name: (cpu_thread_env(server_env(env), cpus)) for name, env in variants.items()}
    gen = torch.Generator().manual_seed(args.seed)

    def tokens(n):
        return torch.randint(TOKEN_LO, TOKEN_HI, (n,), generator=gen).tolist()

    records, loads = [], []
    started = time.time()
    with servers_running(list(servers.values())):
        own = server_pids(servers.values())
        for server in servers.values():            # warm-up: first-call costs outside the timings
            doc = tokens(512)
            ask(server, doc + tokens(args.question))
            ask(server, doc + tokens(args.question))
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for phase in PHASES:
                count = args.neighbours if phase == "neighbours" else 0
                with Neighbours(args.neighbour_kind, count, args.neighbour_max_s) as hogs:
                    load = sample_load(own + hogs.pids(), args.allow_busy, first=not loads)
                    loads.append({"rep": rep, "phase": phase, **load})
                    for name in order:
                        doc = tokens(args.document)
                        for request in REQUESTS:
                            rec = ask(servers[name], doc + tokens(args.question))
                            rec.update(rep=rep, phase=phase, variant=name, request=request)
                            records.append(rec)
                            print(f"rep {rep} {phase:10s} {name:8s} {request:6s} {rec['ttft_s']:7.3f}s "
                                  f"user {rec['user_s']:.2f} sys {rec['system_s']:.2f} "
                                  f"cached {rec['cached_tokens']}", flush=True)
    rows = summarize(records, names)
    table = markdown_table(rows)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    result = {"command": command, "variants": variants, "effective_thread_env": effective,
              "document_tokens": args.document, "question_tokens": args.question,
              "neighbours": {"count": args.neighbours, "kind": args.neighbour_kind},
              "machine": {"platform": platform.platform(), "cpus": cpus, "torch": torch.__version__},
              "loads": loads, "wall_s": time.time() - started, "summary": rows, "records": records}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    load_text = "; ".join(f"rep {x['rep']} {x['phase']}: load1 {x['loadavg_1m']:.2f}"
                          + (f", other CPU {x['other_cpu_percent']:.0f}%" if "other_cpu_percent" in x else "")
                          for x in loads)
    (out / "table.md").write_text(f"`{command}`\n\nthread env per variant: {effective}\n\n"
                                  f"load: {load_text}\n\n{table}\n")
    print(table)
    print(f"load: {load_text}")
    print(f"wrote {out / 'results.json'} ({result['wall_s']:.0f}s)")
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--document", type=int, default=8000, help="document tokens (the shared prefix)")
    ap.add_argument("--question", type=int, default=64, help="question tokens after the document")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--neighbours", type=int, default=2, help="busy jobs in the 'neighbours' phase")
    ap.add_argument("--neighbour-kind", choices=sorted(NEIGHBOURS), default="spin")
    ap.add_argument("--neighbour-max-s", type=int, default=900, help="each busy job ends after this anyway")
    ap.add_argument("--budget", type=float, default=DEFAULTS.knobs.budget,
                    help="Tail-Replay budget of the servers (default: Tail-Replay's default)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VAL,...",
                    help="another server variant (env overrides), e.g. 'two:SGLANG_EXT_CPU_THREADS=2'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-busy", action="store_true", help="measure even if the machine is busy")
    ap.add_argument("--out", default="runs/cpu_neighbour")
    raise SystemExit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
