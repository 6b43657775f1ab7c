"""Run one exactness-fuzzer seed's workload, as generated (rounds side by side), on a fresh server
of one fuzzer configuration, and say which requests got no answer: the check that tells a stall
of this extension from one of SGLang itself (`--backend stock`: the same configuration, same pools,
environment and workload, on SGLang's own cache; `--no-env`: without the configuration's extra
environment, e.g. SGLang's forced-retraction test mode).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fuzz_one_seed.py --config tr-retract --seed 1180 --out DIR
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fuzz_one_seed.py --config tr-retract --seed 1180 --backend stock --out DIR

Writes DIR/<label>.json (the answers' statuses, the ops with no answer) and the server's log.
Oracles are not run here: `python -m benchmarks.exactness_fuzz` does that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.fixtures.tiny import build_tiny_model  # noqa: E402
from eval.fuzz.client import run_ops  # noqa: E402
from eval.fuzz.configs import CONFIGS  # noqa: E402
from eval.fuzz.workload import generate_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--ops", type=int, default=48, help="ops per seed (the long run's --ops)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--backend", choices=("tail_replay", "linearkv", "stock"), default=None,
                    help="run the configuration on this backend instead of its own")
    ap.add_argument("--no-env", action="store_true", help="without the configuration's extra environment")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    config = CONFIGS[args.config]
    label = args.config
    if args.no_env:
        config, label = dataclasses.replace(config, env=()), label + "-no-env"
    if args.backend is not None:
        config, label = dataclasses.replace(config, backend=args.backend), label + "-" + args.backend
    label += f"-seed{args.seed}"
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(config.arch, args.out / f"model-{config.arch}", seed=0)
    server = config.server(str(model), args.out / f"{label}.log")
    server.start()
    try:
        workload = generate_workload(args.seed, args.ops, args.concurrency, config.shape())
        observations: list[dict] = []
        t0 = time.monotonic()
        run_ops(server.url, workload.rounds, observations=observations)
        wall = time.monotonic() - t0
    finally:
        server.stop()
    silent = [{"op": o["op"], "round": o["round"], "error": (o.get("error") or "")[:200]}
              for o in observations if o["status"] == 0]
    result = {"config": args.config, "backend": config.backend, "env": dict(config.env), "seed": args.seed,
              "ops": args.ops, "concurrency": args.concurrency, "server_args": config.args(),
              "requests": len(observations), "statuses": sorted({str(o["status"]) for o in observations}),
              "no_answer": silent, "wall_s": round(wall, 1)}
    (args.out / f"{label}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{label}: {len(observations)} requests, {len(silent)} without an answer, {wall:.1f} s")


if __name__ == "__main__":
    main()
