"""Run every sample under every configuration; one JSONL row per (sample, configuration).

Resumable: rows already in the output are skipped; a truncated last line (an interrupted
write) is dropped. Reuse is verified from `meta_info` (`check_reuse`): a Tail-Replay row whose
request reused nothing, or a full-prefill row that reused something, stops the run with
`ReuseCheckFailed` instead of being reported as quality retained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from tqdm import tqdm

from eval.quality.configs import EvalConfig
from eval.quality.samples import EvalSample
from eval.quality.servers import Client

Scorer = Callable[[EvalSample, str], float]


class ReuseCheckFailed(RuntimeError):
    pass


def reuse_of(meta: dict) -> dict:
    """Tokens reused / replayed / matched for one response, from its meta_info."""
    details = (meta.get("cached_tokens_details") or {}).get("tail_replay") or {}
    return {"cached_tokens": int(meta.get("cached_tokens", 0)), "hit_kind": details.get("kind"),
            "matched_tokens": details.get("matched_tokens"), "replayed_tokens": details.get("replayed_tokens", 0)}


def output_tokens(meta: dict) -> dict:
    """The generated token ids and their log-probabilities (`return_logprob`), 5 decimals."""
    pairs = meta.get("output_token_logprobs") or []
    return {"output_ids": [int(p[1]) for p in pairs], "output_logprobs": [round(float(p[0]), 5) for p in pairs]}


def check_reuse(config: EvalConfig, sample: EvalSample, reuse: dict) -> None:
    if config.must_hit and (reuse["cached_tokens"] <= 0 or reuse["hit_kind"] in (None, "miss")):
        raise ReuseCheckFailed(
            f"{config.name} on {sample.key}: the request reused no cached tokens (meta_info: {reuse}); is the "
            "server running with --radix-cache-backend tail_replay and its radix cache enabled?")
    if config.must_miss and reuse["cached_tokens"] > 0:
        raise ReuseCheckFailed(f"{config.name} on {sample.key}: full prefill reused {reuse['cached_tokens']} tokens")


def run_one(client: Client, config: EvalConfig, sample: EvalSample, scorer: Scorer) -> dict:
    client.flush()
    if config.warm:
        client.generate(sample.warm_prompt(), 1)
    out = client.generate(sample.prompt, sample.max_new_tokens, config.overrides)
    reuse = reuse_of(out["meta_info"])
    check_reuse(config, sample, reuse)
    return {"key": sample.key, "benchmark": sample.benchmark, "dataset": sample.dataset, "sample_id": sample.sample_id,
            "length": sample.length, "group": sample.group, "config": config.name, "budget": config.budget, "kv_mode": config.kv_mode,
            "prompt_tokens": out["meta_info"]["prompt_tokens"], **reuse, "answers": list(sample.answers),
            "prediction": out["text"], "score": scorer(sample, out["text"]), **output_tokens(out["meta_info"])}


def read_rows(path: Path) -> list[dict]:
    """Rows of an output file; a truncated last line is dropped (and the file rewritten)."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise ValueError(f"{path}:{number}: not a JSON line; fix or remove it") from None
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def run(clients: dict[str, Client], configs: list[EvalConfig], samples: Iterable[EvalSample], scorer: Scorer,
        out_path: Path) -> list[dict]:
    """Append a row per (sample, config) not yet in `out_path`; return all rows."""
    rows = read_rows(out_path)
    done = {(r["key"], r["config"]) for r in rows}
    todo = [(s, c) for s in samples for c in configs if (s.key, c.name) not in done]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a") as f:
        for sample, config in tqdm(todo, desc="quality", unit="run"):
            row = run_one(clients[config.server], config, sample, scorer)
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
    return rows
