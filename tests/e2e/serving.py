"""Helpers shared by the end-to-end test modules (prompts, greedy requests, reference checks)."""

from __future__ import annotations

import re
import sys

import torch

from eval.harness import ServerProcess
from sglang_ext.env import CPU_START_METHOD_VAR
from sglang_ext.patches.cpu.start_method import FORK_LOG

#: a server's environment for SGLang's own start method (spawned children re-apply the patches);
#: the suite forks them otherwise (tests/conftest.py)
SPAWN_ENV = {CPU_START_METHOD_VAR: "spawn"}

NEW_TOKENS = 6
LOGPROB_ATOL = 1e-4


def children_forked(server) -> bool:
    """Whether SGLang's start-method call went through `sglang_ext.patches.cpu.start_method`
    (fork) in this server, by its log line."""
    return FORK_LOG in server.log_text()


def random_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (length,), generator=gen).tolist()


def greedy(server, ids, new_tokens=NEW_TOKENS, input_logprobs=False, logprob_start_len=None):
    """Greedy generation with output logprobs. Input logprobs from position 0 force a full
    recompute (no prefix reuse); `logprob_start_len` asks for them from a later position."""
    start = logprob_start_len if logprob_start_len is not None else (0 if input_logprobs else -1)
    return server.generate(input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "temperature": 0},
                           return_logprob=True, logprob_start_len=start)


def assert_matches_reference(result, reference, atol=LOGPROB_ATOL, input_logprobs=False):
    """Same greedy ids and output logprobs (and prompt logprobs, if they were requested)."""
    assert result["output_ids"] == reference.output_ids
    out_lp = [x[0] for x in result["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(out_lp), torch.tensor(reference.output_logprobs), atol=atol, rtol=0)
    if input_logprobs:
        in_lp = [x[0] for x in result["meta_info"]["input_token_logprobs"][1:]]
        torch.testing.assert_close(torch.tensor(in_lp), torch.tensor(reference.input_logprobs), atol=atol, rtol=0)


def continue_conversation(server, first_len=300, seed=7):
    """Send a prompt, then prompt + answer + a new turn; return (follow-up ids, its result)."""
    first_ids = random_prompt(first_len, seed=seed)
    first = greedy(server, first_ids)
    follow_up = first_ids + first["output_ids"] + random_prompt(20, seed=seed + 1)
    return follow_up, greedy(server, follow_up)


def metric_total(metrics_text: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample over label sets (optionally those containing `labels`)."""
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*{re.escape(labels)}[^}}]*}})? ([0-9.e+-]+)$"
    return sum(float(v) for v in re.findall(pattern, metrics_text, re.M))


#: SGLang's pool checks, on (strict: a leak raises in the scheduler)
STRICT_CHECK_ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1"}
_SANITY_METRIC = re.compile(r'^sglang:scheduler_stage_seconds_total\{category="sanity_check_cache"[^}]*\} (\S+)$', re.M)


def sanity_check_seconds(server) -> float:
    """Seconds SGLang's idle tree-cache sanity check has run so far (grows each time it runs)."""
    import requests

    return sum(float(v) for v in _SANITY_METRIC.findall(requests.get(f"{server.url}/metrics", timeout=30).text))


def wait_for_idle_check(server, before: float, timeout_s: float = 30.0) -> None:
    """Until SGLang's idle pool check has run again after `before` (sanity_check_seconds)."""
    import time

    deadline = time.monotonic() + timeout_s
    while sanity_check_seconds(server) <= before:
        assert time.monotonic() < deadline, f"the idle pool check did not run within {timeout_s:.0f} s"
        time.sleep(0.5)


class OverlapServer(ServerProcess):
    """The launcher without its CPU default `--disable-overlap-schedule`: SGLang's overlap
    scheduler (its GPU default, under which `auto` resolves to `extra_buffer`) runs on CPU; the
    launcher turns it off only to keep CPU runs simple."""

    def command(self) -> list[str]:
        code = ("import sys; from sglang_ext import launcher; "
                "launcher.CPU_DEFAULTS.pop('--disable-overlap-schedule'); launcher.serve(sys.argv[1:])")
        return [sys.executable, "-c", code, "--model-path", self.model_path,
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]


def conversation_turns(server, conversations: int, turns: int, *, first: int = 200, turn_tokens: int = 60,
                       new_tokens: int = 4) -> list[dict]:
    """Multi-turn conversations served one request at a time, turn by turn across the conversations
    (round robin, so they compete for the cache): a `first`-token first prompt, each later turn the
    previous prompt, its greedy output and a `turn_tokens`-token user turn. One row per request:
    turn, conversation, prompt tokens, cached tokens, the Tail-Replay label's exact and kind (None
    on a server without Tail-Replay), output ids."""
    convs = [random_prompt(first, seed=c) for c in range(conversations)]
    rows = []
    for turn in range(turns):
        for c in range(conversations):
            result = greedy(server, convs[c], new_tokens)
            meta = result["meta_info"]
            label = (meta.get("cached_tokens_details") or {}).get("tail_replay") or {}
            rows.append({"turn": turn, "conversation": c, "prompt_tokens": len(convs[c]),
                         "cached_tokens": meta["cached_tokens"], "exact": label.get("exact"),
                         "kind": label.get("kind"), "output_ids": result["output_ids"]})
            convs[c] = convs[c] + result["output_ids"] + random_prompt(turn_tokens, seed=1000 + 50 * turn + c)
    return rows
