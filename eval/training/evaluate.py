"""RULER-style accuracy of a model through the patched SGLang server (full prefill, no reuse).

    python -m eval.training.evaluate --model trained_models/gdn-ruler \
        --lengths 1024,2048,4096,8192 --samples 20

Launches `sglang-ext serve --disable-radix-cache --dtype float32` on the model (or uses
`--url`), sends held-out samples (held-out essay / SQuAD / HotpotQA parts, seeds never used in
training; task variants in `tasks.HELD_OUT_TASKS` never trained on; 8K longer than any training
sequence), greedy, and scores them with RULER's own metric functions. Writes per-sample rows
(`ruler_samples.jsonl`) and the score table (`ruler_scores.json`) next to the model.
"""

from __future__ import annotations

import argparse
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from tqdm import tqdm

from eval.quality.ruler import ruler_score
from eval.training import tasks

SERVER_ARGS = ["--disable-radix-cache", "--dtype", "float32", "--context-length", "16384"]


def score(task: str, prediction: str, answers: tuple[str, ...]) -> float:
    return ruler_score(tasks.METRIC[task], prediction, answers)


def eval_samples(tokenizer, task_names, lengths, n: int) -> list[tasks.Sample]:
    counter = tasks.TokenCounter(tokenizer)
    return [tasks.make_sample(t, length, random.Random(f"eval-{t}-{length}-{i}"), tokenizer, "eval", counter)
            for length in lengths for t in task_names for i in range(n)]


def run_sample(url: str, sample: tasks.Sample) -> dict:
    payload = {"text": sample.prompt, "sampling_params": {"max_new_tokens": sample.tokens_to_generate, "temperature": 0}}
    resp = requests.post(f"{url}/generate", json=payload, timeout=1200)
    resp.raise_for_status()
    out = resp.json()
    return {"task": sample.task, "length": sample.length, "prompt_tokens": out["meta_info"]["prompt_tokens"],
            "answers": list(sample.answers), "prediction": out["text"],
            "score": score(sample.task, out["text"], sample.answers), "held_out_task": sample.task in tasks.HELD_OUT_TASKS}


def summarize(rows: list[dict]) -> dict:
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        table.setdefault(row["task"], {}).setdefault(str(row["length"]), []).append(row["score"])
    return {task: {length: round(sum(v) / len(v), 1) for length, v in by_len.items()} for task, by_len in table.items()}


def evaluate(url: str, tokenizer, task_names, lengths, n: int, concurrency: int = 4) -> list[dict]:
    samples = eval_samples(tokenizer, task_names, lengths, n)
    with ThreadPoolExecutor(concurrency) as pool:
        return list(tqdm(pool.map(lambda s: run_sample(url, s), samples), total=len(samples), desc="ruler"))


def markdown_table(summary: dict, lengths) -> str:
    head = "| task | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |\n|---|" + "---:|" * len(lengths)
    rows = [f"| {t}{' (held out)' if t in tasks.HELD_OUT_TASKS else ''} | "
            + " | ".join(f"{summary[t].get(str(n), float('nan')):.1f}" for n in lengths) + " |" for t in summary]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="model folder (tokenizer.json inside)")
    parser.add_argument("--url", help="a running server on that model; default: launch one")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--tasks", default=",".join(tasks.ALL_TASKS))
    parser.add_argument("--samples", type=int, default=20, help="samples per task and length")
    parser.add_argument("--out-dir", type=Path, help="default: the model folder")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    task_names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in task_names if t not in tasks.ALL_TASKS]
    if unknown:
        parser.error(f"unknown --tasks {unknown}; choose from {list(tasks.ALL_TASKS)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    out_dir = args.out_dir or args.model
    if args.url:
        rows = evaluate(args.url, tokenizer, task_names, lengths, args.samples)
    else:
        from eval.harness import ServerProcess, servers_running

        with servers_running([ServerProcess(str(args.model), SERVER_ARGS, log_path=out_dir / "eval_server.log")]) as (server,):
            rows = evaluate(server.url, tokenizer, task_names, lengths, args.samples)
        (out_dir / "eval_server.log").unlink(missing_ok=True)
    with open(out_dir / "ruler_samples.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = summarize(rows)
    (out_dir / "ruler_scores.json").write_text(json.dumps({"lengths": lengths, "samples_per_cell": args.samples,
                                                           "scores": summary}, indent=2))
    print(markdown_table(summary, lengths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
