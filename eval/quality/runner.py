"""Run every sample under every configuration; one JSONL row per (sample, configuration).

Resumable: rows already in the output are skipped; a truncated last line (an interrupted
write) is dropped. Reuse is verified from `meta_info` (`check_reuse`) against the prefix the
warm-up shares with the request (`SharedPrefix`, from the server's own tokenization); a row whose
request did not reuse what its configuration plans stops the run with `ReuseCheckFailed` instead
of being reported as quality retained.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eval.quality.configs import TAIL_REPLAY, EvalConfig
from eval.quality.samples import EvalSample
from eval.quality.servers import Client, tail_replay_server_config
from sglang_ext.tail_replay import META_KEY, TailReplayConfig, plan_replay, replay_window, with_overrides

Scorer = Callable[[EvalSample, str], float]


class ReuseCheckFailed(RuntimeError):
    pass


def reuse_of(meta: dict) -> dict:
    """Tokens reused / replayed / matched for one response, and the state bound its replay reports
    (approximate hits; else None), from its meta_info."""
    details = (meta.get("cached_tokens_details") or {}).get(META_KEY) or {}
    return {"cached_tokens": int(meta.get("cached_tokens", 0)), "hit_kind": details.get("kind"),
            "matched_tokens": details.get("matched_tokens"), "replayed_tokens": details.get("replayed_tokens", 0),
            "state_bound": details.get("state_bound")}


def output_tokens(meta: dict) -> dict:
    """The generated token ids and their log-probabilities (`return_logprob`), 5 decimals."""
    pairs = meta.get("output_token_logprobs") or []
    return {"output_ids": [int(p[1]) for p in pairs], "output_logprobs": [round(float(p[0]), 5) for p in pairs]}


@dataclass(frozen=True)
class SharedPrefix:
    """What a warmed request can reuse: the tokens its prompt shares with the warm-up prompt."""
    tokens: int       # common leading token ids of the warm-up and the request (server tokenizer)
    page_size: int    # the server's KV page size


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _fail(config: EvalConfig, sample: EvalSample, what: str, reuse: dict) -> None:
    raise ReuseCheckFailed(f"{config.name} on {sample.key}: {what} (meta_info: {reuse})")


def check_reuse(config: EvalConfig, sample: EvalSample, reuse: dict, shared: SharedPrefix | None = None,
                server: TailReplayConfig | None = None) -> None:
    """The row reused what its configuration plans, or ReuseCheckFailed naming what is wrong.

    - full (no warm-up): reused nothing.
    - stock (warm-up, SGLang's own cache): no Tail-Replay decision (the server really is stock) and
      at most the shared prefix reused (stock reuses only up to a state checkpoint, often nothing).
    - Tail-Replay: matched L about the shared prefix (within one page below it, at most one token
      above: the warm-up's generated token may continue it); the hit kind the planner gives for L
      under the server config + the row's overrides (a miss is never accepted); replayed tokens
      <= the planned window (ceil(budget x L), or the decay-certified window of a `tr-auto`
      config; clamped) + one page; reused (cached_tokens) + replayed = L. Only an exact replay
      (the window covers all of L) may reuse 0 tokens.

    `server` is the Tail-Replay server's own config (`Client.tail_replay_config()`: with the
    model's decay profile when it has one); None: TAIL_REPLAY_SERVER_CONFIG without a model.
    """
    if config.must_miss and reuse["cached_tokens"] > 0:
        _fail(config, sample, f"full prefill reused {reuse['cached_tokens']} tokens", reuse)
    if config.server != TAIL_REPLAY:
        if reuse["hit_kind"] is not None:
            _fail(config, sample, "a stock row carries a Tail-Replay decision; is the stock server running "
                  "--radix-cache-backend tail_replay?", reuse)
        if shared is not None and reuse["cached_tokens"] > shared.tokens:
            _fail(config, sample, f"stock reused more than the {shared.tokens} shared tokens", reuse)
        return
    if reuse["hit_kind"] in (None, "miss") or (reuse["cached_tokens"] <= 0 and reuse["hit_kind"] != "exact_replay"):
        _fail(config, sample, "the request reused no cached tokens; is the server running with "
              "--radix-cache-backend tail_replay and its radix cache enabled?", reuse)
    if shared is None:
        raise ValueError(f"{config.name}: a Tail-Replay row needs the shared prefix to be checked")
    matched, replayed, page = reuse["matched_tokens"], reuse["replayed_tokens"], shared.page_size
    if matched is None or not shared.tokens - page < matched <= shared.tokens + 1:
        _fail(config, sample, f"matched {matched} tokens, not about the {shared.tokens} tokens shared with the "
              f"warm-up (page {page})", reuse)
    row_config = with_overrides(server if server is not None else tail_replay_server_config(None), config.overrides)
    plan = plan_replay(matched, None, page, row_config)
    if reuse["hit_kind"] != plan.kind.value:
        _fail(config, sample, f"hit kind {reuse['hit_kind']!r}, planned {plan.kind.value!r} for L={matched}", reuse)
    window = replay_window(matched, row_config)
    if replayed > window + page:
        planned = (f"certified for tolerance {config.tolerance:g} at p{config.decay_percentile}" if config.auto
                   else f"budget {config.budget} x L={matched}")
        _fail(config, sample, f"replayed {replayed} > the replay window {window} ({planned}, clamped) + one page "
              f"({page})", reuse)
    if reuse["cached_tokens"] + replayed != matched:
        _fail(config, sample, f"reused {reuse['cached_tokens']} + replayed {replayed} != matched {matched}", reuse)


def shared_prefix(client: Client, sample: EvalSample) -> SharedPrefix:
    return SharedPrefix(common_prefix(client.tokenize(sample.warm_prompt()), client.tokenize(sample.prompt)),
                        client.page_size())


def server_config_for(client: Client, config: EvalConfig) -> TailReplayConfig | None:
    """The Tail-Replay server's own config for a Tail-Replay row (None for stock rows)."""
    return client.tail_replay_config() if config.server == TAIL_REPLAY else None


def run_one(client: Client, config: EvalConfig, sample: EvalSample, scorer: Scorer) -> dict:
    client.flush()
    shared = None
    if config.warm:
        shared = shared_prefix(client, sample)
        client.generate(sample.warm_prompt(), 1)
    out = client.generate(sample.prompt, sample.max_new_tokens, config.overrides)
    reuse = reuse_of(out["meta_info"])
    check_reuse(config, sample, reuse, shared, server_config_for(client, config))
    return {"key": sample.key, "benchmark": sample.benchmark, "dataset": sample.dataset, "sample_id": sample.sample_id,
            "length": sample.length, "group": sample.group, "config": config.name, "budget": config.budget, "kv_mode": config.kv_mode,
            "prompt_tokens": out["meta_info"]["prompt_tokens"],
            "shared_tokens": shared.tokens if shared is not None else None, **reuse, "answers": list(sample.answers),
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


def append_rows(clients: dict[str, Client], configs: list[EvalConfig], samples: Iterable[Any],
                one: Callable[[Client, EvalConfig, Any], dict], out_path: Path, desc: str) -> list[dict]:
    """Append `one(client, config, sample)` for every (sample, config) not yet in `out_path`
    (resumable; every sample has a `key`); return all rows."""
    rows = read_rows(out_path)
    done = {(r["key"], r["config"]) for r in rows}
    todo = [(s, c) for s in samples for c in configs if (s.key, c.name) not in done]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a") as f:
        for sample, config in tqdm(todo, desc=desc, unit="run"):
            row = one(clients[config.server], config, sample)
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
    return rows


def run(clients: dict[str, Client], configs: list[EvalConfig], samples: Iterable[EvalSample], scorer: Scorer,
        out_path: Path) -> list[dict]:
    """Append a row per (sample, config) not yet in `out_path`; return all rows."""
    return append_rows(clients, configs, samples, lambda client, config, sample: run_one(client, config, sample, scorer),
                       out_path, "quality")
