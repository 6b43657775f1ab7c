"""LinearKV evaluation over the reference path: every state initializer x selector against full prefill.

    python -m eval.linearkv --models trained_models/gdn-ruler trained_models/mamba2-ruler \
        --tasks niah,niah_mk,qa --lengths 1024,2048 --samples 4 --out docs/results/linearkv

Per model, task, length and sample: chunks are registered once (a shared pool, so later samples
hit chunks cached by earlier ones at other offsets); the full prefill is decoded greedily, then each
configuration is assembled from the cached chunks and decoded. Records go to `results.jsonl`
(resumable: finished keys are skipped), then `table.md` and `plot.png` are written from it.

Metrics: task score (RULER string match) and its % of the full prefill's; share of outputs identical
to the full prefill's; logprob drift = mean |logprob_PIC - logprob_full| of the full prefill's output
tokens under teacher forcing; TTFT ratio = time to first-token logits of `assemble` over that of one
full-prompt forward, measured back to back in this process (median over samples); and, per linear
layer, ||S||/||S_full|| and cos(S, S_full) of the composed (HYPIC) and single (last chunk) state
against the full prefill's state before the question, by number of chunks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eval.linearkv.data import TASKS, Builder
from eval.linearkv.records import appending, load_records
from eval.quality.ruler import ruler_score
from sglang_ext.linearkv import STATE_RULES, get_state_rule, parse_selector
from sglang_ext.linearkv import reference as R
from sglang_ext.linearkv.initializers import LayerChunks, Seed

DEFAULT_SELECTORS = "none,epic-16,cacheblend-15"
DEFAULT_RULES = "zero,predecessor,compose,packed-last,packed-mean,packed-compose"


def _load(model_dir: str):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return model, tok


def _key(*parts) -> str:
    return "|".join(str(p) for p in parts)


def _score(metric: str, tok, out_ids: list[int], answers) -> float:
    return float(ruler_score(metric, tok.decode(out_ids), answers))


@torch.no_grad()
def _time_full(model, ids: list[int]) -> float:
    t = time.perf_counter()
    model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=True)
    return time.perf_counter() - t


@torch.no_grad()
def run_model(model_dir: str, args, records: dict, sink) -> None:
    model, tok = _load(model_dir)
    name = Path(model_dir).name
    layout = R.model_layout(model, model_id=name)
    store = R.new_store(layout)
    builder = Builder(tok, chunk_tokens=args.chunk_tokens, seed=args.seed)
    eos = model.config.eos_token_id
    stop = (eos,) if isinstance(eos, int) else tuple(eos or ())
    selectors = [parse_selector(s) for s in args.selectors.split(",")]
    rules = [get_state_rule(r) for r in args.rules.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    jobs = [(t, n, i) for t in args.tasks.split(",") for n in lengths for i in range(args.samples)]
    bar = tqdm(total=len(jobs) * (1 + len(selectors) * len(rules)), desc=name, unit="run")
    for task, length, index in jobs:
        s = builder.sample(task, length, index)
        base = _key(name, task, length, index)
        todo = [(sel, rule) for sel in selectors for rule in rules if _key(base, sel.name, rule.name) not in records]
        if _key(base, "full") in records and not todo:
            bar.update(1 + len(selectors) * len(rules))
            continue
        hits = sum(store.lookup(c) is not None for c in s.chunks)
        t = time.perf_counter()
        refs = [(store.lookup(c) or R.register(model, layout, c, store)).chunk_id for c in s.chunks]
        register_s = time.perf_counter() - t
        context = list(s.prefix) + [x for c in s.chunks for x in c]
        ids = context + list(s.suffix)
        full = R.full_prefill(model, layout, context, s.suffix)
        full_out, full_lp = R.greedy(model, full.cache, full.logits[-1], len(ids), args.max_new_tokens, stop_ids=stop)
        full_score = _score(s.metric, tok, full_out, s.answers)
        _time_full(model, ids)                                  # warm-up
        full_s = _time_full(model, ids)
        rec = {"key": _key(base, "full"), "kind": "full", "model": name, "task": task, "length": length, "index": index,
               "tokens": len(ids), "chunks": len(s.chunks), "chunk_hits": hits, "register_s": register_s,
               "full_s": full_s, "score": full_score, "output": full_out, "text": tok.decode(full_out),
               "answers": list(s.answers), "diag": _diag(model, layout, s, store, refs, full)}
        if _key(base, "full") not in records:
            sink(rec)
        bar.update(1)
        for sel, rule in todo:
            t = time.perf_counter()
            got = R.assemble(model, layout, refs, s.suffix, sel, rule, s.prefix, store)
            pic_s = time.perf_counter() - t
            forced_cache = copy.deepcopy(got.cache)
            out, _ = R.greedy(model, got.cache, got.logits[-1], len(ids), args.max_new_tokens, stop_ids=stop)
            _, forced_lp = R.greedy(model, forced_cache, got.logits[-1], len(ids), 0, forced=full_out)
            sink({"key": _key(base, sel.name, rule.name), "kind": "pic", "model": name, "task": task, "length": length,
                  "index": index, "selector": sel.name, "rule": rule.name, "recomputed": len(got.recomputed),
                  "tokens": len(ids), "chunks": len(s.chunks), "pic_s": pic_s, "full_s": full_s,
                  "score": _score(s.metric, tok, out, s.answers), "full_score": full_score,
                  "same": out == full_out, "first_same": out[:1] == full_out[:1],
                  "drift": statistics.fmean(abs(a - b) for a, b in zip(forced_lp, full_lp)),
                  "output": out, "text": tok.decode(out)})
            bar.update(1)
    bar.close()


def _diag(model, layout, s, store, refs, full) -> dict:
    """Per linear layer: (ratio, cos) of composed and single states vs the full prefill's."""
    cache = R._new_cache(model)
    model(torch.tensor([list(s.prefix)]), position_ids=torch.arange(len(s.prefix))[None], past_key_values=cache,
          use_cache=True)
    out = {}
    entries = [store.get(r) for r in refs]
    for i in layout.linear_layers:
        prefix = Seed(cache.layers[i].recurrent_states[0][0], cache.layers[i].conv_states[0][0])
        lc = LayerChunks(layout.kind, [e.linear[i] for e in entries], prefix)
        exact = full.context_states[i].state
        comp = get_state_rule("compose").seed(lc, len(entries)).state
        single = get_state_rule("predecessor").seed(lc, len(entries)).state
        out[str(i)] = {"compose": R.state_diagnostic(exact, comp), "single": R.state_diagnostic(exact, single)}
    return out


# ---------------------------------------------------------------------------------------------
# report


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def table(records: list[dict]) -> str:
    fulls = {(r["model"], r["task"], r["length"], r["index"]): r for r in records if r["kind"] == "full"}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["kind"] == "pic":
            groups.setdefault((r["model"], r["task"], r["selector"], r["rule"]), []).append(r)
    lines = ["| model | task | selector | state | n | score | full score | % of full | same output | "
             "same 1st token | logprob drift | recomputed | TTFT / full |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (model, task, sel, rule), rs in sorted(groups.items()):
        score = statistics.fmean(r["score"] for r in rs)
        fscore = statistics.fmean(r["full_score"] for r in rs)
        pct = f"{100 * score / fscore:.0f}" if fscore > 0 else "n/a"
        lines.append(
            f"| {model} | {task} | {sel} | {rule} | {len(rs)} | {score:.1f} | {fscore:.1f} | {pct} | "
            f"{100 * statistics.fmean(r['same'] for r in rs):.0f} % | "
            f"{100 * statistics.fmean(r['first_same'] for r in rs):.0f} % | "
            f"{statistics.fmean(r['drift'] for r in rs):.3f} | "
            f"{100 * statistics.fmean(r['recomputed'] / r['tokens'] for r in rs):.1f} % | "
            f"{_median([r['pic_s'] / r['full_s'] for r in rs]):.2f} |")
    lines += ["", "Composition diagnostic (mean over samples; ratio = ||S||/||S_full||, cos = cos(S, S_full), "
              "S_full = full prefill's state before the question):", "",
              "| model | layer | chunks (min-max) | compose ratio | compose cos | single ratio | single cos |",
              "|---|---:|---|---:|---:|---:|---:|"]
    by_layer: dict[tuple, list] = {}
    for f in fulls.values():
        for layer, d in f["diag"].items():
            by_layer.setdefault((f["model"], int(layer)), []).append((f["chunks"], d))
    for (model, layer), ds in sorted(by_layer.items()):
        ks = [k for k, _ in ds]
        m = {f"{w}_{j}": statistics.fmean(d[w][j] for _, d in ds) for w in ("compose", "single") for j in (0, 1)}
        lines.append(f"| {model} | {layer} | {min(ks)}-{max(ks)} | {m['compose_0']:.3f} | {m['compose_1']:.3f} | "
                     f"{m['single_0']:.3f} | {m['single_1']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fulls = [r for r in records if r["kind"] == "full"]
    models = sorted({r["model"] for r in fulls})
    fig, axes = plt.subplots(2, max(1, len(models)), figsize=(6 * max(1, len(models)), 8), squeeze=False)
    for col, model in enumerate(models):
        rs = [r for r in fulls if r["model"] == model]
        layers = sorted({int(layer) for r in rs for layer in r["diag"]})
        cmap = plt.get_cmap("viridis", len(layers))
        for li, layer in enumerate(layers):
            for which, marker in (("compose", "o"), ("single", "x")):
                xs = [r["chunks"] for r in rs]
                for row in (0, 1):
                    ys = [r["diag"][str(layer)][which][row] for r in rs]
                    axes[row][col].scatter(xs, ys, marker=marker, color=cmap(li), s=18,
                                           label=f"L{layer} {which}" if row == 0 else None)
        axes[0][col].set_title(f"{model}: ||S|| / ||S_full||")
        axes[1][col].set_title(f"{model}: cos(S, S_full)")
        axes[0][col].axhline(1.0, color="grey", lw=0.5)
        axes[0][col].set_yscale("log")
        for row in (0, 1):
            axes[row][col].set_xlabel("number of chunks K")
        axes[0][col].legend(fontsize=6, ncol=2)
    fig.suptitle("LinearKV: composed (o) and single last-chunk (x) state vs full prefill, per linear layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.linearkv", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["trained_models/gdn-ruler", "trained_models/mamba2-ruler"])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {TASKS}")
    p.add_argument("--lengths", default="1024,2048", help="target prompt lengths in tokens")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--selectors", default=DEFAULT_SELECTORS, help="none, epic-<k>, cacheblend-<r>")
    p.add_argument("--rules", default=DEFAULT_RULES, help=f"state initializers: {sorted(STATE_RULES)}")
    p.add_argument("--chunk-tokens", type=int, default=128, help="essay chunk size for the niah tasks")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/linearkv")
    p.add_argument("--report-only", action="store_true", help="rewrite table.md / plot.png from results.jsonl")
    args = p.parse_args(argv)
    for t in args.tasks.split(","):
        if t not in TASKS:
            p.error(f"unknown task {t!r}; choose from {TASKS}")
    try:
        [parse_selector(s) for s in args.selectors.split(",")]
        [get_state_rule(r) for r in args.rules.split(",")]
    except ValueError as err:
        p.error(str(err))
    sys.modules.setdefault("fla", None)
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    records = load_records(path)
    if not args.report_only:
        load = os.getloadavg()
        with appending(path, records) as sink:
            for m in args.models:
                run_model(m, args, records, sink)
        (out / "machine.json").write_text(json.dumps({"loadavg_start": load, "loadavg_end": os.getloadavg(),
                                                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                                      "torch_threads": torch.get_num_threads()}, indent=2))
    recs = list(records.values())
    (out / "table.md").write_text(table(recs))
    plot(recs, out / "plot.png")
    print(table(recs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
