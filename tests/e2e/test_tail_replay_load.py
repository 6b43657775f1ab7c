"""Tail-Replay under serving load: a small recurrent-state pool, a small KV pool, many concurrent
clients over shared documents (issue: Tail-Replay under real serving load).

One tail_replay server with the default keep_checkpoints=True on SGLang's static pools, far fewer
state slots than branches and a KV pool small enough that eviction runs during the test; one stock server with
the radix cache disabled as the no-reuse reference. SGLang's idle pool-accounting check runs in
strict mode (`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1`), so a leaked KV or state slot kills
the scheduler and fails every later request.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from eval.harness import ServerProcess, start_servers, stop_servers
from eval.replay.servers import flush_cache
from tests.e2e.serving import metric_total, random_prompt

#: SGLang's static pools (`byte_budget: false`): a state pool and a KV pool of fixed sizes, whose
#: pressure these tests are about (on one byte budget the split follows the workload instead:
#: tests/e2e/test_tail_replay_byte_budget.py)
CONFIG = {"budget": 1 / 16, "min_replay_tokens": 1, "min_match_tokens": 16,
          "byte_budget": False}   # keep_checkpoints: default
STATE_SLOTS = 8
KV_TOKENS = 2048
DOC = 256            # document length; 8 documents + their questions overflow the KV pool
CLIENTS = 16
#: greedy outputs of an exact replay may differ from the no-reuse server only where the
#: reference's top two candidates are this close (batch-shape float noise, not a wrong state)
NEAR_TIE = 1e-3
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tail_replay_load_logs")
    model = str(tiny_model_factory("qwen3-next"))
    common = ["--dtype", "float32", "--chunked-prefill-size", "128", "--max-total-tokens", str(KV_TOKENS)]
    procs = {
        "tail_replay": ServerProcess(model, [*common, "--radix-cache-backend", "tail_replay",
                                             "--tail-replay-config", json.dumps(CONFIG),
                                             "--max-mamba-cache-size", str(STATE_SLOTS)],
                                     log_path=logs / "tail_replay.log"),
        "no_reuse": ServerProcess(model, [*common, "--disable-radix-cache"], log_path=logs / "no_reuse.log"),
    }
    strict = os.environ.get("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE")
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"   # inherited at launch
    try:
        start_servers(list(procs.values()))
    finally:
        if strict is None:
            os.environ.pop("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE")
        else:
            os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = strict
    try:
        yield procs
    finally:
        stop_servers(list(procs.values()))


def ask(server, ids, overrides=None, new_tokens=6, top=0):
    custom = {"tail_replay": overrides} if overrides else None
    return server.generate(input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                                           "custom_params": custom},
                           return_logprob=True, top_logprobs_num=top)


def _details(result) -> dict:
    return result["meta_info"]["cached_tokens_details"]["tail_replay"]


def _assert_healthy(server) -> None:
    requests.get(f"{server.url}/health_generate", timeout=120).raise_for_status()
    assert not re.search(r"memory leak|Traceback", server.log_text(), re.I)


def test_state_pressure_keeps_the_attention_kv(servers):
    """More branches than state slots, one request at a time, within the KV pool: every finished
    request donates its end state, so the state pool runs out and old states go; their documents'
    KV stays, and the first document, whose state is long gone, is still reused."""
    server = servers["tail_replay"]
    flush_cache(server.url)   # retried while SGLang still holds a just-finished request
    documents = [random_prompt(150, seed=100 + i) for i in range(KV_TOKENS // 160)]   # fit the KV pool
    assert len(documents) > STATE_SLOTS
    for doc in documents:
        ask(server, doc, new_tokens=1)
    result = ask(server, documents[0][:140] + random_prompt(8, seed=99))
    assert _details(result)["matched_tokens"] == 140
    assert _details(result)["kind"] == "approximate"
    assert result["meta_info"]["cached_tokens"] == 140 - -(-140 // 16)
    _assert_healthy(server)


def _prompts() -> list[list[int]]:
    documents = [random_prompt(DOC, seed=200 + d) for d in range(8)]
    return [doc + random_prompt(16, seed=300 + 10 * d + q) for d, doc in enumerate(documents) for q in range(4)]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _margin(reference: dict, position: int) -> float:
    """Gap between the reference's two best candidates at an output position."""
    top = sorted((lp for lp, *_ in reference["meta_info"]["output_top_logprobs"][position]), reverse=True)
    return top[0] - top[1]


def test_concurrent_exact_replay_under_eviction_matches_no_reuse(servers):
    """16 clients, 64 requests (32 prompts over 8 shared documents, each twice), budget 1.0 (an
    exact replay from the zero state): every output is the no-reuse server's, up to batch-shape
    float noise (logprobs within LOGPROB_ATOL; a different greedy token only at a near tie of the
    reference, which is reported); the KV pool overflows, so the tree evicts while serving."""
    prompts = _prompts()
    distinct = 8 * DOC + len(prompts) * (16 + 6)      # documents, questions, answers: all inserted
    assert distinct > KV_TOKENS                       # so the tree must evict to hold them
    reference = [ask(servers["no_reuse"], p, top=2) for p in prompts]
    tail_replay = servers["tail_replay"]
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        served = list(pool.map(lambda p: ask(tail_replay, p, {"budget": 1.0}), prompts + prompts))
    hits = [r for r in served if _details(r)["kind"] != "miss"]
    assert hits and all(_details(r)["kind"] in ("exact_replay", "exact_checkpoint") for r in hits)
    near_ties = []
    for i, result in enumerate(served):
        ref = reference[i % len(prompts)]
        split = _first_divergence(result["output_ids"], ref["output_ids"])
        shared = len(ref["output_ids"]) if split is None else split + 1
        got = [x[0] for x in result["meta_info"]["output_token_logprobs"][:shared]]
        want = [x[0] for x in ref["meta_info"]["output_token_logprobs"][:shared]]
        assert max(abs(g - w) for g, w in zip(got, want)) <= LOGPROB_ATOL, f"request {i}"
        if split is not None:
            assert _margin(ref, split) < NEAR_TIE, f"request {i} differs at token {split} without a near tie"
            near_ties.append((i, split, _margin(ref, split)))
    print("greedy flips at near ties (request, position, reference top-2 margin):", near_ties)
    _assert_healthy(tail_replay)


def test_concurrent_default_budget_under_eviction_serves_everything(servers):
    server = servers["tail_replay"]
    before = requests.get(f"{server.url}/metrics", timeout=30).text
    prompts = _prompts()
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        served = list(pool.map(lambda p: ask(server, p), prompts + prompts[::-1]))
    assert all(r["meta_info"]["completion_tokens"] == 6 for r in served)
    kinds = [_details(r)["kind"] for r in served]
    assert "approximate" in kinds
    after = requests.get(f"{server.url}/metrics", timeout=30).text
    reused = metric_total(after, "sglang_ext:tail_replay_reused_tokens_total") - \
        metric_total(before, "sglang_ext:tail_replay_reused_tokens_total")
    assert reused == sum(_details(r)["reused_tokens"] for r in served) > 0
    _assert_healthy(server)
