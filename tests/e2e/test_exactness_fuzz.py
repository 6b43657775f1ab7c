"""The differential exactness fuzzer's seed set on live servers.

Four servers start together (tiny Qwen3-Next, fp32, `--enable-deterministic-inference`): one without
cache (the reference), Tail-Replay under `no_buffer`, LinearKV under `extra_buffer`, and Tail-Replay
with SGLang's retraction switch on (`tr-retract`; `eval.fuzz.configs`: small KV and state pools,
streaming sessions on, SGLang's strict idle pool check and tree sanity check on). Each configuration
gets `SEEDS` seeded workloads (`eval.fuzz.workload`: mixed exactness modes and budgets, batches,
aborts mid-decode, streaming sessions with aborted turns, LinearKV chunk layouts and the same tokens
as plain prompts, five tenants, probes of other tenants' documents). A test fails on any violation
(`eval.fuzz.oracles`): an answer labelled exact (`kv_exact`, else `exact`) or asked to be exact that
differs from the server without cache beyond the measured noise, a cached token reused across
tenants, a log line of SGLang's pool or tree checks or a traceback, a 5xx, a request never answered.
Each violation names its seed; `python -m benchmarks.exactness_fuzz` shrinks them and runs the long
version.
"""

from __future__ import annotations

import json

import pytest

from eval.fuzz.configs import CONFIGS, no_cache_server
from eval.fuzz.reference import NoCacheReference, measure_noise
from eval.fuzz.runner import fuzz_server
from eval.fuzz.workload import generate_workload
from eval.harness import start_servers, stop_servers

SUITE_CONFIGS = ("tr-nobuf", "lkv-eb", "tr-retract")
SEEDS = {"tr-nobuf": [11], "lkv-eb": [12], "tr-retract": [13]}
OPS = 32


@pytest.fixture(scope="module")
def fuzzed(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("exactness_fuzz_logs")
    model = str(tiny_model_factory("qwen3-next"))
    reference = no_cache_server(model, logs / "no-cache.log")
    servers = {name: CONFIGS[name].server(model, logs / f"{name}.log") for name in SUITE_CONFIGS}
    start_servers([reference, *servers.values()])
    try:
        ref = NoCacheReference(reference.url)
        prompts = [op["ids"] for op in generate_workload(0, 12).ops() if op["op"] == "generate"][:4]
        yield servers, ref, measure_noise(ref, prompts)
    finally:
        stop_servers([reference, *servers.values()])


def test_no_cache_noise_is_far_below_the_tolerance(fuzzed):
    """The tolerance is honest: two runs of the server without cache (alone, side by side) agree
    on every token and within a tenth of it."""
    _, _, noise = fuzzed
    assert noise["same_tokens"], noise
    assert noise["max_logprob_diff"] * 10 <= noise["tolerance"], noise


@pytest.mark.parametrize("name", SUITE_CONFIGS)
def test_seed_set_finds_no_violation(fuzzed, name):
    servers, ref, noise = fuzzed
    config = CONFIGS[name]
    result = fuzz_server(servers[name], ref, SEEDS[name], OPS, config.shape(), noise["tolerance"], max_shrinks=0)
    assert result["seeds"] == SEEDS[name] and result["requests"] >= OPS, result
    assert result["statuses"].get("200", 0) > 0, result["statuses"]
    assert not result["violations"], json.dumps(result["violations"], indent=1)[:6000]
    if name == "tr-retract":   # SGLang's retraction switch retracted running requests, and they answered
        assert result["paths"].get("retraction", {}).get("requests", 0) > 0, result["paths"]
