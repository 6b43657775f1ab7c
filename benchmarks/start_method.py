"""How long a CPU server takes to start with spawned vs forked children (`SGLANG_EXT_CPU_START_METHOD`).

One tiny Qwen3-Next server at a time, started from the launcher (`eval.harness.ServerProcess`), the
two start methods interleaved per repetition: wall time from launch to the first healthy
`/health_generate`, then one greedy request (its ids and logprobs must be the same under both
methods), then the time `stop()` takes. The machine load is sampled before each start and the run
refuses a busy machine unless `--allow-busy`.

    .venv/bin/python benchmarks/start_method.py --reps 3 --out runs/start-method
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.fixtures.tiny import build_tiny_model  # noqa: E402
from eval.harness import ServerProcess  # noqa: E402
from eval.machine import require_quiet, sample_load  # noqa: E402
from sglang_ext.env import CPU_START_METHOD_VAR, CPU_START_METHODS  # noqa: E402

PROMPT = list(range(10, 300))


def one(model: Path, method: str, log: Path) -> dict:
    server = ServerProcess(str(model), ["--dtype", "float32"], log_path=log, env={CPU_START_METHOD_VAR: method})
    start = time.perf_counter()
    server.start()
    ready = time.perf_counter() - start
    try:
        out = server.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0},
                              return_logprob=True)
    finally:
        start = time.perf_counter()
        server.stop()
        stopped = time.perf_counter() - start
    return {"method": method, "ready_s": ready, "stop_s": stopped, "output_ids": out["output_ids"],
            "output_logprobs": [x[0] for x in out["meta_info"]["output_token_logprobs"]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--allow-busy", action="store_true")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model("qwen3-next", args.out / "model", seed=0)
    runs = []
    for rep in range(args.reps):
        for method in CPU_START_METHODS:
            load = sample_load()
            require_quiet(load, args.allow_busy)
            runs.append({"rep": rep, **one(model, method, args.out / f"server-{method}-{rep}.log"), "load": load.as_dict()})
    medians = {m: {k: statistics.median(r[k] for r in runs if r["method"] == m) for k in ("ready_s", "stop_s")}
               for m in CPU_START_METHODS}
    same = len({(tuple(r["output_ids"]), tuple(round(x, 5) for x in r["output_logprobs"])) for r in runs}) == 1
    report = {"command": " ".join(["benchmarks/start_method.py", *(argv if argv is not None else sys.argv[1:])]),
              "medians": medians, "ready_ratio_spawn_over_fork": medians["spawn"]["ready_s"] / medians["fork"]["ready_s"],
              "same_output_every_run": same, "runs": runs}
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
