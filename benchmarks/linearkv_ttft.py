"""TTFT through the live server: LinearKV chunk reuse vs full prefill.

One `--radix-cache-backend linearkv` server (selector none unless `--selector`, e.g. epic-16,
state `predecessor` unless `--state`); for each prompt length L a prompt is `P | C_1 .. C_K | Q`: a short system prefix P,
K = L / 512 random-token chunks of `--chunk-tokens` and a short question Q (`--question-tokens`).
Per length, after `/flush_cache`:

- cold: the chunks in one order, declared in `custom_params.linearkv.chunks`, right after the flush:
  P and the chunks are registered, then the request is assembled (P's KV from its own registration
  at offset 0, since no radix-tree path holds it yet); recorded, not timed against anything; one
  more request in another order warms the hit path;
- per repetition, interleaved (order alternated between repetitions):
  * linearkv: the same chunks in a fresh order with a fresh Q, declared as chunks; the script
    checks `meta_info.cached_tokens_details.linearkv` says every chunk hit and K x chunk tokens
    were reused (the rest recomputed);
  * full prefill: the same chunks in a fresh order after a never-seen P of the same length and a
    fresh Q, no chunks declared: a cache miss (checked: 0 cached tokens), i.e. SGLang's ordinary
    prefill of the same shape on the same server;
  * first sight: K never-seen chunks after the cached P, declared: the request registers them (one
    batched prefill per chunk from a zero state) and is then assembled from them (checked like
    linearkv), i.e. what a document costs the first time it is used;
  * with `--selector epic-<k>` also linearkv_none: a hit like linearkv with selector none per
    request (no heads recomputed), so EPIC's pre-pass cost is read within the same run.

TTFT is the client's wall time of a `max_new_tokens=1` request (registration of the declared
chunks, which on a hit costs one one-token prefill per chunk, is inside it); the server
processes' CPU seconds are recorded beside it (they move much less than wall time when other jobs
share the cores). Reported: medians and the ratio linearkv / full prefill per length, measured in
one run, with the machine load (`eval.machine`) at start and end and the server's thread settings.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linearkv_ttft.py --lengths 4096,8192,16384 --reps 3 \
        --out runs/linearkv_ttft --allow-busy
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ttft_tail_replay import process_tree, sample_load, server_thread_env, timed_post  # noqa: E402
from eval.harness import ServerProcess, servers_running  # noqa: E402
from eval.quality.servers import Client  # noqa: E402
from sglang_ext.linearkv.serving import parse_config  # noqa: E402

DEFAULT_MODEL = "trained_models/gdn-ruler"


class Prompts:
    """Random token ids in [10, vocab) (fresh on every call)."""

    def __init__(self, seed: int, vocab: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def tokens(self, n: int) -> list[int]:
        return torch.randint(10, self.vocab, (n,), generator=self.gen).tolist()

    def order(self, k: int) -> list[int]:
        return torch.randperm(k, generator=self.gen).tolist()


def compose(prefix: list[int], chunks: list[list[int]], order: list[int], question: list[int]) -> tuple[list[int], list[list[int]]]:
    """Prompt ids and the chunk spans of `prefix | chunks in order | question`."""
    ids, spans = list(prefix), []
    for j in order:
        spans.append([len(ids), len(ids) + len(chunks[j])])
        ids += chunks[j]
    return ids + question, spans


def timed_generate(server: ServerProcess, ids: list[int], spans: list[list[int]] | None,
                   selector: str | None = None) -> dict:
    custom = None
    if spans is not None:
        custom = {"linearkv": {"chunks": spans, **({"selector": selector} if selector else {})}}
    ttft, cpu, meta = timed_post(server, ids, custom)
    details = meta.get("cached_tokens_details") or {}
    return {"ttft_s": ttft, "server_cpu_s": cpu, "prompt_tokens": meta.get("prompt_tokens"),
            "cached_tokens": meta.get("cached_tokens"), "linearkv": details.get("linearkv"),
            "e2e_latency": meta.get("e2e_latency")}


def check_hit(rec: dict, k: int, chunk_tokens: int, question: int, epic_k: int = 0,
              state: str = "predecessor") -> list[str]:
    """The hit's linearkv summary is the server plan's for k chunks (EPIC heads and `replay`
    tails recomputed, the rest reused)."""
    from sglang_ext.linearkv.serving import ChunkPlan, state_rule

    rule, replay = state_rule(state)
    plan = ChunkPlan(tuple((j * chunk_tokens, (j + 1) * chunk_tokens) for j in range(k)), rule, epic_k, replay)
    want = {"chunks_hit": k, "chunks_missed": 0, "reused_tokens": plan.chunk_tokens - plan.recomputed_chunk_tokens,
            "recomputed_tokens": question + plan.recomputed_chunk_tokens}
    got = {key: (rec.get("linearkv") or {}).get(key) for key in want}
    return [] if got == want else [f"L={rec['L']} rep={rec['rep']}: expected linearkv {want}, got {rec.get('linearkv')}"]


def server_args(longest: int, config: dict) -> list[str]:
    context = int(math.ceil((longest + 2048) / 1024) * 1024)
    return ["--dtype", "float32",
            "--radix-cache-backend", "linearkv", "--linearkv-config", json.dumps(config),
            "--context-length", str(context),
            "--max-total-tokens", str(12 * context),    # chunks (3 fresh sets per length) + the full prefills
            "--max-mamba-cache-size", "256",            # one end state per chunk (4 x 32 at 16K) + requests
            "--max-running-requests", "4",
            "--mem-fraction-static", "0.5",
            # a 16K full prefill on 2 busy shared cores can take minutes; SGLang's default watchdog
            # (300 s per batch) would kill the server mid-measurement
            "--watchdog-timeout", "3600",
            "--log-level", "warning"]


def summarize(records: list[dict], lengths: list[int]) -> list[dict]:
    rows = []
    for L in lengths:
        mine = {c: [r for r in records if r["L"] == L and r["config"] == c]
                for c in ("linearkv", "full_prefill", "first_sight")}
        if not all(mine.values()):
            continue
        med = {c: statistics.median(r["ttft_s"] for r in rs) for c, rs in mine.items()}
        cpu = {c: statistics.median(r["server_cpu_s"] for r in rs) for c, rs in mine.items()}
        rows.append({"L": L, "prompt_tokens": mine["linearkv"][0]["prompt_tokens"], "reps": len(mine["linearkv"]),
                     "chunks": mine["linearkv"][0]["chunks"],
                     "median_ttft_linearkv_s": med["linearkv"], "median_ttft_full_s": med["full_prefill"],
                     "ttft_ratio": med["linearkv"] / med["full_prefill"],
                     "ttft_linearkv_s": [r["ttft_s"] for r in mine["linearkv"]],
                     "ttft_full_s": [r["ttft_s"] for r in mine["full_prefill"]],
                     "median_cpu_linearkv_s": cpu["linearkv"], "median_cpu_full_s": cpu["full_prefill"],
                     "cpu_ratio": cpu["linearkv"] / cpu["full_prefill"],
                     "median_ttft_first_sight_s": med["first_sight"],
                     "first_sight_ratio": med["first_sight"] / med["full_prefill"],
                     "cold_ttft_s": next((r["ttft_s"] for r in records if r["L"] == L and r["config"] == "cold"), None)})
        plain = [r["ttft_s"] for r in records if r["L"] == L and r["config"] == "linearkv_none"]
        if plain:
            rows[-1].update(median_ttft_linearkv_none_s=statistics.median(plain),
                            none_ratio=statistics.median(plain) / med["full_prefill"])
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| L | prompt tokens | chunks | full prefill TTFT s | LinearKV TTFT s | ratio | "
             "server CPU s full / LinearKV | CPU ratio | first sight (new chunks: registered, then assembled) s | "
             "its ratio | cold request (P and chunks new: registered, then assembled) s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cold = f"{r['cold_ttft_s']:.2f}" if r["cold_ttft_s"] is not None else "-"
        lines.append(f"| {r['L']:,} | {r['prompt_tokens']:,} | {r['chunks']} | {r['median_ttft_full_s']:.3f} | "
                     f"{r['median_ttft_linearkv_s']:.3f} | **{r['ttft_ratio']:.2f}x** | "
                     f"{r['median_cpu_full_s']:.2f} / {r['median_cpu_linearkv_s']:.2f} | {r['cpu_ratio']:.2f}x | "
                     f"{r['median_ttft_first_sight_s']:.3f} | {r['first_sight_ratio']:.2f}x | {cold} |")
    if any("none_ratio" in r for r in rows):
        lines += ["", "| L | LinearKV with selector none per request (same server) TTFT s | its ratio |", "|---:|---:|---:|"]
        lines += [f"| {r['L']:,} | {r['median_ttft_linearkv_none_s']:.3f} | {r['none_ratio']:.2f}x |"
                  for r in rows if "none_ratio" in r]
    return "\n".join(lines)


def write(out: Path, args, common: list[str], records: list[dict], problems: list[str], lengths: list[int],
          loads: dict, started: float) -> tuple[list[dict], str]:
    """results.json and table.md from the records so far."""
    rows = summarize(records, lengths)
    table = markdown_table(rows)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    result = {
        "command": command, "model": args.model, "lengths": lengths, "chunk_tokens": args.chunk_tokens,
        "prefix_tokens": args.prefix_tokens, "question_tokens": args.question_tokens, "reps": args.reps,
        "server_args": common, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "torch": torch.__version__},
        "server_thread_env": server_thread_env(), "machine_load": loads,
        "wall_s": time.time() - started, "problems": problems, "summary": rows, "records": records,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    load_lines = "\n".join(f"- {k}: {v}" for k, v in loads.items())
    (out / "table.md").write_text(f"`{command}`\n\nmodel {args.model}; server threads {result['server_thread_env']}"
                                  f"\n\nmachine load (eval.machine):\n{load_lines}\n\n{table}\n")
    return rows, table


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    bad = [L for L in lengths if L % args.chunk_tokens or L < args.chunk_tokens]
    if bad:
        raise SystemExit(f"--lengths {bad}: each must be a positive multiple of --chunk-tokens {args.chunk_tokens}")
    model_config = json.loads((Path(args.model) / "config.json").read_text())
    prompts = Prompts(args.seed, int(model_config["vocab_size"]))
    config = {"selector": args.selector, "state": args.state, "min_chunk_tokens": 16}
    k_epic = parse_config(config).k or 0   # EPIC's k (a bad --selector stops here, naming it)
    common = server_args(args.prefix_tokens + max(lengths) + args.question_tokens, config)
    server = ServerProcess(args.model, common, log_path=out / "server.log")
    records: list[dict] = []
    problems: list[str] = []
    started = time.time()
    print(f"starting the server ({args.model}; {' '.join(common)}) ...", flush=True)
    with servers_running([server]):
        own = process_tree(server)
        loads = {"start": sample_load(own, args.allow_busy)}
        system = prompts.tokens(args.prefix_tokens)
        # first-call costs (allocator, code paths of registration, miss and hit) outside the timings
        warm = [prompts.tokens(args.chunk_tokens) for _ in range(2)]
        for order in ([0, 1], [1, 0], [0, 1]):
            timed_generate(server, *compose(system, warm, order, prompts.tokens(args.question_tokens)))
        for L in lengths:
            loads[f"before L={L}"] = sample_load(own, True)
            Client(server.url).flush(attempts=100)
            k = L // args.chunk_tokens
            chunks = [prompts.tokens(args.chunk_tokens) for _ in range(k)]

            def measure(config_name: str, ids: list[int], spans: list[list[int]] | None, rep: int, L=L, k=k) -> dict:
                rec = timed_generate(server, ids, spans, "none" if config_name == "linearkv_none" else None)
                rec.update(config=config_name, L=L, rep=rep, chunks=k)
                records.append(rec)
                print(f"L={L} rep={rep} {config_name}: {rec['ttft_s']:.3f}s cached {rec['cached_tokens']} "
                      f"{rec['linearkv']}", flush=True)
                return rec

            measure("cold", *compose(system, chunks, list(range(k)), prompts.tokens(args.question_tokens)), rep=-1)
            timed_generate(server, *compose(system, chunks, prompts.order(k), prompts.tokens(args.question_tokens)))
            for rep in range(args.reps):
                hit_ids, hit_spans = compose(system, chunks, prompts.order(k), prompts.tokens(args.question_tokens))
                full_ids, _ = compose(prompts.tokens(args.prefix_tokens), chunks, prompts.order(k),
                                      prompts.tokens(args.question_tokens))
                fresh = [prompts.tokens(args.chunk_tokens) for _ in range(k)]
                new_ids, new_spans = compose(system, fresh, list(range(k)), prompts.tokens(args.question_tokens))
                pair = [("linearkv", hit_ids, hit_spans), ("full_prefill", full_ids, None),
                        ("first_sight", new_ids, new_spans)]
                if k_epic:   # the same kind of hit without EPIC's heads (selector none per request)
                    pair.append(("linearkv_none", *compose(system, chunks, prompts.order(k),
                                                           prompts.tokens(args.question_tokens))))
                for name, ids, spans in (pair if rep % 2 == 0 else pair[::-1]):
                    rec = measure(name, ids, spans, rep)
                    if name in ("linearkv", "first_sight"):
                        problems += check_hit(rec, k, args.chunk_tokens, args.question_tokens, k_epic, args.state)
                    elif name == "linearkv_none":
                        problems += check_hit(rec, k, args.chunk_tokens, args.question_tokens, state=args.state)
                    elif rec["cached_tokens"]:
                        problems.append(f"L={L} rep={rep}: full prefill reported {rec['cached_tokens']} cached tokens")
            write(out, args, common, records, problems, lengths, loads, started)   # partial results survive a crash
        loads["end"] = sample_load(own, True)
    rows, table = write(out, args, common, records, problems, lengths, loads, started)
    print(table)
    for p in problems:
        print("PROBLEM:", p)
    print(f"server threads {server_thread_env()}")
    print(f"machine load {loads}")
    print(f"wrote {out / 'results.json'} and {out / 'table.md'} ({time.time() - started:.0f}s)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a hybrid checkpoint folder (default: %(default)s)")
    ap.add_argument("--lengths", default="4096,8192,16384", help="chunk tokens per prompt, comma-separated")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--prefix-tokens", type=int, default=32, help="the system prefix P")
    ap.add_argument("--question-tokens", type=int, default=32, help="the question Q")
    ap.add_argument("--state", default="predecessor", help="predecessor | zero | replay | replay-<r> (KV-only)")
    ap.add_argument("--selector", default="none", help="none | epic-<k> (the server's --linearkv-config selector)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--allow-busy", action="store_true", help="measure even if the machine is busy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/linearkv_ttft")
    raise SystemExit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
