"""The simulator's prediction for a live replay: the same trace, the same first N requests, the
same capacity, through `eval/trace_sim` (the same policy objects the server runs).

    python -m eval.replay.predict --trace kv-cache-tester --sessions 48 --session-gap-s 10 \
        --requests 300 --tokens-per-block 1 --max-total-tokens 12288 --policies lru,tlru,sae

Mapping: one simulator block = one replayed block = `--tokens-per-block` replayed tokens, so the
capacity is `--max-total-tokens / --tokens-per-block` blocks and the predicted reused tokens are
hit blocks x tokens per block. Outputs are not cached (the replay's outputs are synthetic
tokens that no later prompt contains). What the simulator does not model: the running request's
own KV in the pool, SGLang's state checkpoints (the default backend hits only where one exists),
Tail-Replay's replayed tails, and time: the simulator runs on trace time, the live SAE on the
replay's wall clock (requests back to back).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from eval.replay.inputs import resolve_trace
from eval.trace_sim.ablations import make_sim_policy
from eval.trace_sim.cost_model import DEFAULT_COST_MODEL, load_cost_model
from eval.trace_sim.loaders import DEFAULT_TRACE_ROOT, KvLoadOptions, load_kv_cache_tester, load_mooncake
from eval.trace_sim.simulate import prepare, replay
from eval.trace_sim.trace import NO_BLOCK


def predict(trace_name: str, traces_root, requests: int, sessions: int, session_gap_s: float,
            tokens_per_block: int, max_total_tokens: int, policies: list[str]) -> list[dict]:
    kind, path = resolve_trace(trace_name, traces_root)
    if kind == "mooncake":
        trace = load_mooncake(path, limit=requests)
    else:
        trace = load_kv_cache_tester(path, KvLoadOptions(arrival_gap_s=session_gap_s, limit_files=sessions,
                                                         cache_outputs=False))
    kept = tuple(r for r in trace.requests if r.last_block != NO_BLOCK)[:requests]
    prepared = prepare(replace(trace, requests=kept))
    capacity = max_total_tokens // tokens_per_block
    cost = load_cost_model(DEFAULT_COST_MODEL)
    rows = []
    for name in policies:
        stats = replay(prepared, make_sim_policy(name), capacity, cost).stats.summary()
        rows.append({"policy": name, "capacity_blocks": capacity, "block_hit_ratio": stats["block_hit_ratio"],
                     "predicted_reused_tokens": int(round(stats["block_hit_ratio"] * _prompt_blocks(prepared)))
                     * tokens_per_block, "us_per_decision": stats["us_per_decision"]})
    return rows


def _prompt_blocks(prepared) -> int:
    paths, tree = prepared.paths, prepared.tree
    total = 0
    for i in range(len(prepared.trace.requests)):
        n = int(paths.n_prompt_nodes[i])
        if n:
            last = int(paths.nodes[int(paths.offsets[i]) + n - 1])
            total += int(tree.start_block[last] + tree.length[last])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.replay.predict", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="kv-cache-tester")
    p.add_argument("--traces-root", default=DEFAULT_TRACE_ROOT,
                   help="folder of the named traces (default: the committed sample eval/traces, or $SGLANG_EXT_TRACES)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--session-gap-s", type=float, default=60.0)
    p.add_argument("--tokens-per-block", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, required=True)
    p.add_argument("--policies", default="lru,tlru,sae")
    args = p.parse_args(argv)
    rows = predict(args.trace, args.traces_root, args.requests, args.sessions, args.session_gap_s,
                   args.tokens_per_block, args.max_total_tokens, args.policies.split(","))
    json.dump(rows, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
