"""Tail-Replay on SGLang's host tier (HiCache L2) in the real CPU server.

`--radix-cache-backend tail_replay --enable-hierarchical-cache` with a device KV pool smaller than
the traffic (`--max-total-tokens 1024`): HiCache writes every prefix through to the host, device
pressure demotes it there, and the planner plans over device + host KV.

- `keep_checkpoints: false` (a KV-only host tier: every hit is a replay plan, and the host state
  pool is one slot): the same prompt is served once from device KV and once from host KV, with the
  tree otherwise in the same state (the cache is flushed and the first prompt recomputed in
  between): same plan, same tokens, same logprobs. An `exactness: "exact"` request over host KV
  equals transformers' full prefill.
- The default config (states go to the host with their node, as on stock SGLang): a conversation's
  next turn, after its first turn was pushed to the host, resumes exactly from the host copy of the
  first turn's end state and equals transformers' full prefill.

SGLang's strict idle pool check runs on the way out of each.
"""

from __future__ import annotations

import json

import pytest

from eval.harness import ServerProcess
from eval.reference import greedy_reference, load_reference_model
from eval.replay.servers import flush_cache
from tests.e2e.serving import LOGPROB_ATOL, STRICT_CHECK_ENV, assert_matches_reference, greedy, random_prompt, sanity_check_seconds, wait_for_idle_check

PROMPT, PUSH, PUSHES, NEW = 300, 400, 3, 6
ARGS = ["--dtype", "float32", "--radix-cache-backend", "tail_replay", "--enable-hierarchical-cache",
        "--max-total-tokens", "1024", "--max-mamba-cache-size", "8"]
KV_ONLY = ["--tail-replay-config", json.dumps({"keep_checkpoints": False})]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3-next")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """keep_checkpoints false: a KV-only host tier."""
    log = tmp_path_factory.mktemp("tr_hicache_logs") / "tail_replay_hicache_kv_only.log"
    with ServerProcess(str(model_dir), ARGS + KV_ONLY, log_path=log, env=STRICT_CHECK_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def server_with_states(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tr_hicache_logs") / "tail_replay_hicache_states.log"
    with ServerProcess(str(model_dir), ARGS, log_path=log, env=STRICT_CHECK_ENV) as srv:
        yield srv


def details(result) -> dict:
    return result["meta_info"].get("cached_tokens_details") or {}


def plan(result) -> dict:
    summary = dict(details(result)["tail_replay"])
    for key in ("bound", "state_bound", "state_bound_per_layer"):
        summary.pop(key, None)
    return summary


def push_out(server) -> None:
    for seed in range(PUSHES):   # other prompts fill the small device pool: the first goes to the host
        greedy(server, random_prompt(PUSH, seed=100 + seed), NEW)


def flush(server) -> None:
    flush_cache(server.url)   # SGLang refuses while a just-finished request is still in its queues: retried


def test_host_hit_is_served_as_the_same_device_hit_would_be(server):
    shared = random_prompt(PROMPT, seed=1)
    first, second = shared + random_prompt(8, seed=2), shared + random_prompt(8, seed=3)

    greedy(server, first, NEW)
    device_hit = greedy(server, second, NEW)
    flush(server)
    greedy(server, first, NEW)                                 # the same tree as before, recomputed
    push_out(server)
    host_hit = greedy(server, second, NEW)

    assert plan(device_hit)["kind"] == "approximate" and details(device_hit)["host"] == 0
    assert plan(host_hit) == plan(device_hit)                 # the same plan over host KV
    assert details(host_hit)["device"] == 0                   # the prefix came from the host
    assert details(host_hit)["host"] == plan(host_hit)["reused_tokens"] > 0
    assert host_hit["output_ids"] == device_hit["output_ids"]
    assert [x[0] for x in host_hit["meta_info"]["output_token_logprobs"]] == \
        [x[0] for x in device_hit["meta_info"]["output_token_logprobs"]]


def test_exact_request_over_host_kv_equals_full_prefill(server, model_dir):
    ids = random_prompt(PROMPT, seed=11) + random_prompt(8, seed=12)
    greedy(server, random_prompt(PROMPT, seed=11), NEW)
    push_out(server)
    result = server.generate(input_ids=ids, sampling_params={
        "max_new_tokens": NEW, "temperature": 0, "custom_params": {"tail_replay": {"exactness": "exact"}}},
        return_logprob=True)
    summary = details(result)["tail_replay"]
    assert summary["exact"] is True and summary["kind"] in ("miss", "exact_replay")   # no state on the host
    assert_matches_reference(result, greedy_reference(load_reference_model(model_dir), ids, NEW), atol=LOGPROB_ATOL)


def test_host_state_pool_is_one_slot_and_the_idle_pool_check_runs_clean(server):
    log = server.log_text()
    assert "hierarchical Mamba cache (1 state slots" in log   # the host budget went to KV
    before = sanity_check_seconds(server)
    greedy(server, random_prompt(40, seed=7), NEW)
    wait_for_idle_check(server, before)
    assert server.proc.poll() is None
    log = server.log_text()
    assert "memory leak" not in log and "Traceback" not in log


def test_next_turn_resumes_exactly_from_the_host_copy_of_its_state(server_with_states, model_dir):
    server = server_with_states
    first_ids = random_prompt(PROMPT, seed=21)
    first = greedy(server, first_ids, NEW)
    push_out(server)
    ids = first_ids + first["output_ids"] + random_prompt(8, seed=22)
    result = greedy(server, ids, NEW)
    summary = details(result)["tail_replay"]
    assert summary["kind"] == "exact_checkpoint" and summary["exact"] is True
    assert details(result)["host"] > 0                        # its prefix came from the host
    assert_matches_reference(result, greedy_reference(load_reference_model(model_dir), ids, NEW), atol=LOGPROB_ATOL)
    before = sanity_check_seconds(server)
    greedy(server, random_prompt(40, seed=23), NEW)
    wait_for_idle_check(server, before)
    log = server.log_text()
    assert "memory leak" not in log and "Traceback" not in log
