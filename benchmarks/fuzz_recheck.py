"""Recheck an exactness-fuzzer report's findings against SGLang's own numerics.

    .venv/bin/python -m benchmarks.fuzz_recheck --report docs/results/exactness-fuzz-long/report.json \
        --model runs/exactness-fuzz/models/qwen3-next --out docs/results/exactness-fuzz-long/recheck.json

1. Every reproduced batch finding: the same batch request to the server without cache, to SGLang's
   own cache (`stock-nobuf`) and to Tail-Replay (`tr-nobuf`), each part against the server without
   cache asked alone: if all three move a part's logprobs alike, the batch moved them, not a cache.
2. Chunk splits: one finding's prompt resumed by SGLang's own cache from a cached prefix of k
   tokens (computed as [0, k) then [k, n)) for many k, against the server without cache asked the
   whole prompt alone: whether where a prompt is cut changes its answer.
3. One finding's round (`--round-seed/--round-op`): the ops of its round side by side on an emptied
   cache, and the finding's op with each neighbour alone, on SGLang's own cache and on each
   `--round-configs` server; every answer checked against the server without cache (SGLang's own
   cache's too): if SGLang's own cache moves the same answers by the same amounts, the batch
   moved them, not ours.

`--rerun CONFIG:SEED:REPS ...` instead reruns whole seeds, side by side as in the fuzz run,
REPS times each on an emptied cache, and reports what each rerun flags.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import requests

from eval.fuzz.client import run_op, run_ops
from eval.fuzz.configs import CONFIGS, no_cache_server
from eval.fuzz.reference import NoCacheReference
from eval.fuzz.runner import check, flush, fuzz_server
from eval.fuzz.workload import generate_workload
from eval.harness import servers_running

SPLITS = (1, 2, 3, 4, 5, 8, 16, 32, 57, 60, 61, 62, 63, 64, 65, 66, 67, 100)


def _diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0)


def batch_findings(report: dict, servers: dict, ref: NoCacheReference) -> dict:
    out = {}
    for name, config in report["configs"].items():
        for v in config.get("violations", []):
            ops = (v.get("reproduction") or {}).get("ops") or []
            if v["kind"] != "batch" or not (v.get("reproduction") or {}).get("reproduced") or len(ops) != 1:
                continue
            op = ops[0]
            alone = [ref.ask(list(p), op["new"]) for p in op["prompts"]]
            res = {}
            for label, server in servers.items():
                obs = run_op(server.url, op, lambda i: None)
                res[label] = [{"cached_tokens": o.get("cached_tokens"), "same_ids": o.get("output_ids") == a[0],
                               "max_logprob_diff_vs_alone": _diff(o.get("logprobs") or [], a[1])}
                              for o, a in zip(obs, alone, strict=True)]
            out[f"{name} seed {v['seed']} op {op['index']}"] = res
    return out


def chunk_splits(ids: list[int], new: int, stock_url: str, ref: NoCacheReference) -> dict:
    want = ref.ask(ids, new)
    out = {}
    for k in [k for k in SPLITS if k < len(ids)]:
        requests.post(f"{stock_url}/flush_cache", timeout=60).raise_for_status()
        time.sleep(0.5)
        requests.post(f"{stock_url}/generate", json={"input_ids": ids[:k], "sampling_params": {"max_new_tokens": 1}},
                      timeout=600).raise_for_status()
        r = requests.post(f"{stock_url}/generate", json={
            "input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}, timeout=600).json()
        lp = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        out[k] = {"cached_tokens": r["meta_info"]["cached_tokens"], "same_ids": r["output_ids"] == want[0],
                  "max_logprob_diff": _diff(lp, want[1])}
    return out


def round_recheck(seed: int, op_index: int, configs: list[str], model: str, logs: Path) -> dict:
    rnd = next(r for r in generate_workload(seed, 48, 4, CONFIGS[configs[0]].shape()).rounds
               if any(o["index"] == op_index for o in r))
    by = {o["index"]: o for o in rnd}
    combos = [sorted(by)] + [[op_index, i] for i in sorted(by) if i != op_index] + [[op_index]]
    out: dict = {"seed": seed, "op": op_index, "round_ops": sorted(by), "by_config": {}}
    for name in ["stock-nobuf", *configs]:
        config = CONFIGS[name]
        server, ref_server = config.server(model, logs / f"round-{name}.log"), no_cache_server(model, logs / "round-ref.log")
        with servers_running([server, ref_server]):
            ref = NoCacheReference(ref_server.url)
            rows = []
            for combo in combos:
                flush(server.url)
                obs = run_ops(server.url, [[by[i] for i in combo]])
                found = [{"op": v["op"], "part": v["part"], "max_logprob_diff": v["detail"].get("max_logprob_diff"),
                          "cached_tokens": v["detail"].get("cached_tokens")}
                         for v in check(obs, ref, 1e-4, all_exact=config.backend == "stock") if v["oracle"] == "exactness"]
                rows.append({"ops": combo, "exactness_flags": found})
            out["by_config"][name] = rows
    return out


def rerun_seeds(specs: list[str], model: str, logs: Path) -> dict:
    out = {}
    for spec in specs:
        name, seed, reps = spec.split(":")
        config = CONFIGS[name]
        server, ref_server = config.server(model, logs / f"rerun-{name}-{seed}.log"), no_cache_server(model, logs / "rerun-ref.log")
        with servers_running([server, ref_server]):
            result = fuzz_server(server, NoCacheReference(ref_server.url), [int(seed)] * int(reps), 48, config.shape(),
                                 1e-4, max_shrinks=0, all_exact=config.backend == "stock")
        out[spec] = {"requests": result["requests"], "flags": [
            {"oracle": v["oracle"], "op": v["op"], "part": v["part"], "kind": v["kind"],
             "max_logprob_diff": v["detail"].get("max_logprob_diff"), "cached_tokens": v["detail"].get("cached_tokens")}
            for v in result["violations"]]}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", type=Path, required=True, help="a benchmarks.exactness_fuzz report.json")
    p.add_argument("--model", type=Path, required=True, help="the tiny Qwen3-Next fixture the run used")
    p.add_argument("--split-seed", type=int, default=7157, help="the finding whose prompt is split (tr-nobuf)")
    p.add_argument("--split-op", type=int, default=22)
    p.add_argument("--round-seed", type=int, default=7517, help="a finding whose round is rechecked side by side")
    p.add_argument("--round-op", type=int, default=36)
    p.add_argument("--round-configs", default="lkv-eb,tr-eb", help="its configuration first, then others")
    p.add_argument("--rerun", nargs="*", default=None, metavar="CONFIG:SEED:REPS",
                   help="only rerun these whole seeds side by side (e.g. tr-nobuf:7157:4)")
    p.add_argument("--logs", type=Path, default=Path("runs/fuzz-recheck"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    report = json.loads(args.report.read_text())
    args.logs.mkdir(parents=True, exist_ok=True)
    model = str(args.model)
    if args.rerun is not None:
        result = rerun_seeds(args.rerun, model, args.logs)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    servers = {"no cache": no_cache_server(model, args.logs / "ref.log"),
               "stock-nobuf": CONFIGS["stock-nobuf"].server(model, args.logs / "stock.log"),
               "tr-nobuf": CONFIGS["tr-nobuf"].server(model, args.logs / "tr.log")}
    op = next(o for o in generate_workload(args.split_seed, 48, 4, CONFIGS["tr-nobuf"].shape()).ops()
              if o["index"] == args.split_op)
    with servers_running(list(servers.values())):
        ref = NoCacheReference(servers["no cache"].url)   # asked alone; the same server answers the batch
        result = {"batch_findings": batch_findings(report, servers, ref),
                  "chunk_splits": {"seed": args.split_seed, "op": args.split_op, "prompt_tokens": len(op["ids"]),
                                   "by_cached_prefix": chunk_splits(list(op["ids"]), op["new"],
                                                                    servers["stock-nobuf"].url, ref)}}
    result["round"] = round_recheck(args.round_seed, args.round_op, args.round_configs.split(","), model, args.logs)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
