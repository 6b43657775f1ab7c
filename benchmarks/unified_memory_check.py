"""Tail-Replay on SGLang's unified memory (`--enable-unified-memory`) against the same server without
it, on the CPU server (`patches/cpu/unified_memory.py`).

Two servers, one after the other, on the tiny Qwen3-Next fixture (unless `--model`), both Tail-Replay
with `exactness: "approximate"`, `keep_checkpoints: false` (every hit replays a tail whose cached
K/V is read from the pool: `kv_mode: "exact"`), 128-token chunked prefill; one of them with
`--enable-unified-memory` (virtual slot ids, translated at each read). Five greedy requests, one at
a time, 8 new tokens each: a 200-token prompt, the same again (a replayed hit), one that shares its
first 150 tokens (a replayed hit), an unrelated one, the first again. SGLang's strict idle memory
check and tree sanity check run on both. The report gives per request the output ids, cached
tokens, hit kind and the largest output log-probability difference.

    .venv/bin/python benchmarks/unified_memory_check.py --out runs/unified-memory-check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.fixtures.tiny import build_tiny_model  # noqa: E402
from eval.harness import ServerProcess  # noqa: E402
from tests.e2e.serving import STRICT_CHECK_ENV, greedy, random_prompt  # noqa: E402

CONFIG = {"exactness": "approximate", "keep_checkpoints": False, "min_match_tokens": 16}
COMMON = ["--dtype", "float32", "--max-total-tokens", "2048", "--max-mamba-cache-size", "8",
          "--chunked-prefill-size", "128", "--radix-cache-backend", "tail_replay",
          "--tail-replay-config", json.dumps(CONFIG)]
SERVERS = {"plain": [], "unified": ["--enable-unified-memory"]}


def prompts() -> list[list[int]]:
    a = random_prompt(200, seed=1)
    return [a, a, a[:150] + random_prompt(40, seed=2), random_prompt(90, seed=3), a]


def serve(model: Path, name: str, out: Path) -> list[dict]:
    got = []
    with ServerProcess(str(model), COMMON + SERVERS[name], log_path=out / f"server-{name}.log",
                       env=dict(STRICT_CHECK_ENV)) as server:
        info = requests.get(f"{server.url}/get_server_info", timeout=30).json()
        if info["enable_unified_memory"] is not (name == "unified"):
            raise RuntimeError(f"server {name}: enable_unified_memory is {info['enable_unified_memory']}")
        for ids in prompts():
            result = greedy(server, ids, 8)
            meta = result["meta_info"]
            got.append({"output_ids": result["output_ids"],
                        "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                        "cached_tokens": meta["cached_tokens"],
                        "kind": meta["cached_tokens_details"]["tail_replay"]["kind"]})
    return got


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_tiny_model("qwen3-next", out / "model-qwen3-next", seed=0)
    runs = {name: serve(model, name, out) for name in SERVERS}
    rows = []
    for i, (plain, unified) in enumerate(zip(runs["plain"], runs["unified"])):
        rows.append({"request": i, "kind": plain["kind"], "cached_tokens": plain["cached_tokens"],
                     "same_output_ids": plain["output_ids"] == unified["output_ids"],
                     "same_cached_tokens": plain["cached_tokens"] == unified["cached_tokens"],
                     "max_logprob_difference": max(abs(p - u) for p, u in zip(plain["logprobs"], unified["logprobs"]))})
    report = {"command": " ".join(sys.argv), "config": CONFIG, "servers": SERVERS, "runs": runs, "requests": rows}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Tail-Replay with and without --enable-unified-memory (CPU, approximate replays)", "",
             f"`{report['command']}`", "",
             "| request | hit kind | cached tokens | same output ids | max logprob difference |",
             "|---:|---|---:|---|---:|"]
    lines += [f"| {r['request']} | {r['kind']} | {r['cached_tokens']} | {r['same_output_ids']} | "
              f"{r['max_logprob_difference']:.2e} |" for r in rows]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["same_output_ids"] and r["same_cached_tokens"] for r in rows) else 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Qwen3-Next checkpoint folder (default: build the tiny fixture)")
    ap.add_argument("--out", default="runs/unified-memory-check")
    sys.exit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
