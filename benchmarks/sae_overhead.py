"""SAE's decision overhead per request against prefill time at 8K prompts (<= 2 %).

One patched CPU server (tiny Qwen3-Next fixture, default backend, `--radix-eviction-policy sae`,
`--enable-metrics`), a KV pool of 2 x 8K tokens (+ 1,024) and 8 state slots, so from the third
request on every request evicts KV. Requests: S sessions take turns R rounds; turn 1 is an
8,064-token prompt (the system prefix the sessions share + the session's document), each later
turn adds 256 user tokens; max_new_tokens=1, so a request's wall time is its prefill (TTFT).

SAE's time comes from the server's own counters (/metrics, read after the run): victim choices
(`sae_decision_seconds_total`), the match / insert hooks and the pre-eviction sync
(`sae_hook_seconds_total`) and the state ordering (`sae_state_order_seconds_total`). They are
pushed after each eviction walk, so hook time after the last walk is missing (every request
here evicts, so that is at most one request's hooks). Reported: SAE seconds per request, prefill
seconds per request, and their ratio, all from this one run; machine load sampled before and
after (`eval/machine.py`; a busy machine stops the run unless `--allow-busy`).

Note: the prefill is the tiny fixture's on CPU; a real model's 8K prefill on a GPU takes a
different time, so the absolute SAE time per request is reported too.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sae_overhead.py --out runs/sae_overhead
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.harness import ServerProcess  # noqa: E402
from eval.machine import require_quiet, sample_load  # noqa: E402

PROMPT, SHARED, TURN = 8064, 2048, 256
SAE_SERIES = ("sglang_ext:sae_decision_seconds_total", "sglang_ext:sae_hook_seconds_total",
              "sglang_ext:sae_state_order_seconds_total", "sglang_ext:sae_decisions_total")


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="folder for result.json and the server log")
    ap.add_argument("--allow-busy", action="store_true")
    args = ap.parse_args()

    from eval.fixtures.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="sae_overhead_"))
    model = build_tiny_model("qwen3-next", work / "model", seed=0)
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    server_args = ["--dtype", "float32", "--radix-eviction-policy", "sae", "--enable-metrics",
                   "--max-total-tokens", str(2 * PROMPT + 4 * TURN), "--max-mamba-cache-size", "8",
                   "--max-running-requests", "1", "--chunked-prefill-size", "2048"]
    rnd = random.Random(0)
    shared = [rnd.randrange(10, 500) for _ in range(SHARED)]
    context = {k: shared + [rnd.randrange(10, 500) for _ in range(PROMPT - SHARED)] for k in range(args.sessions)}
    records = []
    with ServerProcess(str(model), server_args, log_path=out / "server.log") as server:
        load_start = sample_load(exclude_pids=(server.proc.pid,), seconds=1.0)
        require_quiet(load_start, args.allow_busy)
        server.generate(input_ids=[rnd.randrange(10, 500) for _ in range(64)],
                        sampling_params={"max_new_tokens": 1})   # warm-up, not counted
        before = requests.get(f"{server.url}/metrics", timeout=30).text
        for r in range(args.rounds):
            for k in range(args.sessions):
                if r:
                    context[k] += [rnd.randrange(10, 500) for _ in range(TURN)]
                t0 = time.perf_counter()
                res = server.generate(input_ids=context[k], sampling_params={
                    "max_new_tokens": 1, "temperature": 0,
                    "custom_params": {"session": f"s{k}", "token_types": [[0, SHARED, "system"],
                                                                         [SHARED, len(context[k]), "user"]]}})
                records.append({"session": k, "round": r, "prompt_tokens": len(context[k]),
                                "cached_tokens": res["meta_info"]["cached_tokens"],
                                "wall_s": time.perf_counter() - t0})
        after = requests.get(f"{server.url}/metrics", timeout=30).text
        load_end = sample_load(exclude_pids=(server.proc.pid,), seconds=1.0)
    sae = {name: metric(after, name) - metric(before, name) for name in SAE_SERIES}
    n = len(records)
    sae_s = sum(v for name, v in sae.items() if name.endswith("seconds_total"))
    prefill_s = sum(r["wall_s"] for r in records)
    result = {"requests": n, "prompt_tokens_mean": sum(r["prompt_tokens"] for r in records) / n,
              "prefill_s_per_request": prefill_s / n, "sae_s_per_request": sae_s / n,
              "sae_share_of_prefill": sae_s / prefill_s, "sae_counters": sae, "records": records,
              "load_start": dataclasses.asdict(load_start), "load_end": dataclasses.asdict(load_end),
              "server_args": server_args}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"{n} requests, mean prompt {result['prompt_tokens_mean']:.0f} tokens: prefill "
          f"{result['prefill_s_per_request'] * 1e3:.1f} ms/request, SAE {result['sae_s_per_request'] * 1e6:.0f} us/request "
          f"({100 * result['sae_share_of_prefill']:.3f} % of prefill); decisions {sae['sglang_ext:sae_decisions_total']:.0f}; "
          f"other CPU {load_start.other_cpu_percent:.0f} % / {load_end.other_cpu_percent:.0f} %")


if __name__ == "__main__":
    main()
