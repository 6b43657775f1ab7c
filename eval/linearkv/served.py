"""LinearKV quality through the live server, against the reference path's records.

    OMP_NUM_THREADS=1 python -m eval.linearkv.served --tasks niah,niah_mk,qa --lengths 1024,2048 \
        --samples 3 --reference docs/results/linearkv/results.jsonl.gz --out docs/results/linearkv/served

Per model, one `--radix-cache-backend linearkv` server (`min_chunk_tokens` 1 so that every chunk of
the workload is a chunk, as on the reference path; fp32 on CPU). The items are
`python -m eval.linearkv`'s (same `eval/linearkv/data.py` builder, chunk size and seed, so the same
token ids); per item, selector (`--selectors`: none, epic-<k>; sent per request) and state rule
(`--rules`, the served ones):

- full prefill: the prompt's ids with input logprobs from position 0 (SGLang then recomputes the
  whole prompt: no cache reuse), greedy, `--max-new-tokens`;
- LinearKV: the same ids with `custom_params.linearkv = {"chunks": spans, "state": rule,
  "selector": selector}`; P (the
  template head) is sent once per model beforehand so that it is in the tree (a prompt whose P is
  not cached is prefilled in full; that is a miss); the record keeps
  `meta_info.cached_tokens_details.linearkv`, and only requests that hit every chunk are scored
  (a miss is reported, never counted as PIC);
- drift: the full prefill's output teacher-forced after the LinearKV prompt (input logprobs from
  the question's end, chunks declared as before), mean |logprob - full prefill's logprob| over its
  tokens, as the reference path computes it.

Then, per model and rule, the server's score next to the reference path's score for the same items
and configuration (`--reference`, the part-1 records: `model|task|length|index|selector|rule`), the
share of outputs equal to the reference path's LinearKV output and to the server's full prefill,
and both drifts. Records in `OUT/results.jsonl` (resumable), the table in `OUT/table.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import requests

from eval.harness import ServerProcess, servers_running
from eval.linearkv.data import TASKS, Builder
from eval.linearkv.records import appending, load_records
from eval.quality.ruler import ruler_score
from sglang_ext.linearkv.serving import SERVED_STATE_RULES, epic_k, state_rule

#: compose: Mamba-2 models only (the server refuses it on GDN); replay also as replay-<r>
SERVED_RULES = SERVED_STATE_RULES


def _post(url: str, payload: dict) -> dict:
    resp = requests.post(f"{url}/generate", json=payload, timeout=600)
    if resp.status_code != 200:
        raise RuntimeError(f"/generate failed ({resp.status_code}): {resp.text[:300]}")
    return resp.json()


def _spans(sample) -> list[list[int]]:
    spans, pos = [], len(sample.prefix)
    for c in sample.chunks:
        spans.append([pos, pos + len(c)])
        pos += len(c)
    return spans


def _ids(sample) -> list[int]:
    return list(sample.prefix) + [t for c in sample.chunks for t in c] + list(sample.suffix)


def _out_logprobs(result: dict) -> list[float]:
    return [float(x[0]) for x in result["meta_info"]["output_token_logprobs"]]


def full_prefill(url: str, ids: list[int], max_new_tokens: int) -> dict:
    """Greedy with input logprobs from position 0 (forces a full recompute)."""
    return _post(url, {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})


def _field(spans: list[list[int]], rule: str, selector: str) -> dict:
    return {"linearkv": {"chunks": spans, "state": rule, "selector": selector}}


def linearkv(url: str, ids: list[int], spans: list[list[int]], rule: str, max_new_tokens: int,
             selector: str = "none") -> dict:
    return _post(url, {"input_ids": ids, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                           "custom_params": _field(spans, rule, selector)}})


def forced_logprobs(url: str, ids: list[int], forced: list[int], spans: list[list[int]],
                    rule: str, selector: str = "none") -> tuple[list[float], dict]:
    """Logprobs of `forced` after the prompt `ids` with its chunks declared (teacher forcing). SGLang's
    input logprobs from `logprob_start_len = len(ids) - 1` are [None, lp(forced[0]), .., lp(forced[-2])]
    for the sequence ids + forced[:-1]; the last forced token's comes from the output position."""
    sampling = {"max_new_tokens": 1, "temperature": 0, "custom_params": _field(spans, rule, selector)}
    res = _post(url, {"input_ids": ids + forced[:-1], "return_logprob": True, "logprob_start_len": len(ids) - 1,
                      "token_ids_logprob": [forced[-1]], "sampling_params": sampling})
    meta = res["meta_info"]
    entries = meta["input_token_logprobs"]
    if len(entries) != len(forced) or entries[0][0] is not None:
        raise RuntimeError(f"unexpected input logprobs: {len(entries)} entries for {len(forced)} forced tokens")
    lps = [float(x[0]) for x in entries[1:]]
    last = meta["output_token_ids_logprobs"][0]
    lps.append(float(next(x[0] for x in last if int(x[1]) == forced[-1])))
    return lps, meta


def _strip(out: list[int], stop: tuple[int, ...]) -> list[int]:
    return out[:-1] if out and out[-1] in stop else out


def server_args(config: dict, context: int) -> list[str]:
    return ["--dtype", "float32", "--radix-cache-backend", "linearkv", "--linearkv-config", json.dumps(config),
            "--context-length", str(context), "--max-mamba-cache-size", "256", "--max-running-requests", "4",
            "--log-level", "warning"]


def _log_path(folder: str, name: str) -> Path:
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path / f"server-{name}.log"


def run_model(model_dir: str, args, records: dict, sink) -> None:
    from tokenizers import Tokenizer

    name = Path(model_dir).name
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    stop = (eos,) if isinstance(eos, int) else tuple(eos or ())
    builder = Builder(tok, chunk_tokens=args.chunk_tokens, seed=args.seed)
    rules = args.rules.split(",")
    selectors = args.selectors.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    jobs = [(t, n, i) for t in args.tasks.split(",") for n in lengths for i in range(args.samples)]
    todo = [j for j in jobs if any(f"{name}|{j[0]}|{j[1]}|{j[2]}|{sel}|{r}" not in records
                                   for sel in selectors for r in rules)]
    if not todo:
        return
    config = {"selector": "none", "state": "predecessor", "min_chunk_tokens": 1}
    server = ServerProcess(model_dir, server_args(config, max(lengths) * 2 + 1024),
                           log_path=_log_path(args.log_dir, name))
    print(f"{name}: starting the server ...", flush=True)
    with servers_running([server]):
        url = server.url
        warmed: set[tuple[int, ...]] = set()
        for task, length, index in todo:
            s = builder.sample(task, length, index)
            ids, spans = _ids(s), _spans(s)
            if s.prefix not in warmed:   # P in the tree (P is the template head, shared by a task's prompts)
                _post(url, {"input_ids": list(s.prefix), "sampling_params": {"max_new_tokens": 0}})
                warmed.add(s.prefix)
            t = time.perf_counter()
            full = full_prefill(url, ids, args.max_new_tokens)
            full_s = time.perf_counter() - t
            full_out = list(full["output_ids"])
            full_lp = _out_logprobs(full)
            full_score = float(ruler_score(s.metric, tok.decode(full_out), s.answers))
            for selector, rule in [(sel, r) for sel in selectors for r in rules]:
                key = f"{name}|{task}|{length}|{index}|{selector}|{rule}"
                if key in records:
                    continue
                t = time.perf_counter()
                got = linearkv(url, ids, spans, rule, args.max_new_tokens, selector)
                pic_s = time.perf_counter() - t
                detail = (got["meta_info"].get("cached_tokens_details") or {}).get("linearkv") or {}
                out = list(got["output_ids"])
                forced, fmeta = forced_logprobs(url, ids, full_out, spans, rule, selector)
                fdetail = (fmeta.get("cached_tokens_details") or {}).get("linearkv") or {}
                own = _out_logprobs(got)
                agree = next((j for j, (a, b) in enumerate(zip(out, full_out)) if a != b), min(len(out), len(full_out)))
                check = max((abs(forced[j] - own[j]) for j in range(agree)), default=0.0)
                hit = detail.get("chunks_hit") == len(s.chunks) and detail.get("chunks_missed") == 0
                sink({"key": key, "model": name, "task": task, "length": length, "index": index,
                      "selector": selector, "rule": rule, "tokens": len(ids), "chunks": len(s.chunks),
                      "linearkv": detail, "forced_linearkv": fdetail, "hit": hit,
                      "forced_hit": fdetail.get("chunks_hit") == len(s.chunks),
                      "score": float(ruler_score(s.metric, tok.decode(out), s.answers)),
                      "full_score": full_score, "output": out, "full_output": full_out,
                      "same_as_full": _strip(out, stop) == _strip(full_out, stop),
                      "drift": statistics.fmean(abs(a - b) for a, b in zip(forced, full_lp)),
                      "forced_vs_own_max": check, "stop": list(stop),
                      "pic_s": pic_s, "full_s": full_s, "text": tok.decode(out)})


def table(records: list[dict], reference: dict[str, dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r.get("selector", "none"), r["rule"]), []).append(r)
    lines = ["| model | selector | state | items | chunks hit | reference score | server score | difference "
             "(points) | server full-prefill score | reference full score | same output as reference LinearKV | "
             "same output as server full prefill | drift server / reference |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (model, selector, rule), rs in sorted(groups.items()):
        scored = [r for r in rs if r["hit"]]
        refs = [reference.get(r["key"]) for r in scored]
        paired = [(r, ref) for r, ref in zip(scored, refs) if ref is not None]
        if not paired:
            lines.append(f"| {model} | {selector} | {rule} | {len(rs)} | {len(scored)} / {len(rs)} | - | - | - | - | - | - | - | - |")
            continue
        server = statistics.fmean(r["score"] for r, _ in paired)
        ref = statistics.fmean(x["score"] for _, x in paired)
        full = statistics.fmean(r["full_score"] for r, _ in paired)
        ref_full = statistics.fmean(x["full_score"] for _, x in paired)
        same_ref = statistics.fmean(_strip(r["output"], tuple(r["stop"])) == _strip(x["output"], tuple(r["stop"]))
                                   for r, x in paired)
        same_full = statistics.fmean(r["same_as_full"] for r, _ in paired)
        drift = statistics.fmean(r["drift"] for r, _ in paired)
        ref_drift = statistics.fmean(x["drift"] for _, x in paired)
        lines.append(f"| {model} | {selector} | {rule} | {len(paired)} | {len(scored)} / {len(rs)} | {ref:.1f} | "
                     f"{server:.1f} | {server - ref:+.1f} | {full:.1f} | {ref_full:.1f} | {100 * same_ref:.0f} % | "
                     f"{100 * same_full:.0f} % | {drift:.4f} / {ref_drift:.4f} |")
    return "\n".join(lines) + "\n"


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _log_run(path: Path, run: dict) -> None:
    """Append this run to the folder's `machine.json` ({"runs": [...]})."""
    data = json.loads(path.read_text()) if path.exists() else {}
    runs = data.get("runs", []) if isinstance(data, dict) else []
    path.write_text(json.dumps({"runs": [*runs, run]}, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.linearkv.served", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["trained_models/gdn-ruler", "trained_models/mamba2-ruler"])
    p.add_argument("--tasks", default="niah,niah_mk,qa", help=f"comma list of {TASKS}")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--rules", default="predecessor,zero", help=f"served state rules: {SERVED_RULES}")
    p.add_argument("--selectors", default="none,epic-16", help="served selectors, sent per request: none, epic-<k>")
    p.add_argument("--chunk-tokens", type=int, default=128, help="as the reference run's (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", default="docs/results/linearkv/results.jsonl.gz",
                   help="the reference path's records (python -m eval.linearkv)")
    p.add_argument("--out", default="runs/linearkv-served")
    p.add_argument("--log-dir", default="runs/linearkv-served", help="server logs (kept out of --out)")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    for t in args.tasks.split(","):
        if t not in TASKS:
            p.error(f"unknown task {t!r}; choose from {TASKS}")
    for r in args.rules.split(","):
        if state_rule(r)[0] not in SERVED_RULES:
            p.error(f"--rules: {r!r} is not served; choose from {SERVED_RULES} or replay-<r>")
    for sel in args.selectors.split(","):
        try:
            epic_k(sel, None, "--selectors {}", ValueError)
        except ValueError as exc:
            p.error(str(exc))
    if not Path(args.reference).exists():
        p.error(f"--reference {args.reference}: no such file (run python -m eval.linearkv first)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    records = load_records(path)
    reference = load_records(Path(args.reference))
    if not args.report_only:
        load = os.getloadavg()
        with appending(path, records) as sink:
            for m in args.models:
                run_model(m, args, records, sink)
        _log_run(out / "machine.json", {"command": "python -m eval.linearkv.served " + " ".join(argv or sys.argv[1:]),
                                         "backend_commit": _commit(), "loadavg_start": load,
                                         "loadavg_end": os.getloadavg(),
                                         "omp_num_threads": os.environ.get("OMP_NUM_THREADS")})
    text = table(list(records.values()), reference)
    misses = [r["key"] for r in records.values() if not r["hit"]]
    text += f"\nrequests that did not hit every chunk (not scored): {len(misses)} {misses[:10]}\n"
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
