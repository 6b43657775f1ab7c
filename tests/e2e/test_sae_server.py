"""SAECache in the real patched server (`--radix-eviction-policy sae`, default backend, tiny
Qwen3-Next): a typed multi-turn workload that forces eviction, measured against LRU on the same
request sequence; typed `/generate` spans and their 400s; chat completions; /metrics; a bad policy
config stops the start-up naming the key.

The LRU baseline and the SAE server boot side by side; the baseline serves the workload and
stops, the SAE server stays for the rest of the module.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import requests

from eval.harness import ServerProcess, start_servers, stop_servers
from tests.e2e.serving import metric_total

#: KV pool (tokens): three of the four conversations fit, not four (round 2 on)
CAPACITY = 1000
SESSIONS, ROUNDS, SYSTEM, TURN, NEW = 4, 4, 32, 120, 4
SAE_CONFIG = {"clock": "requests"}


def _args(policy: str, config: dict | None = None) -> list[str]:
    extra = ["--radix-eviction-policy-config", json.dumps(config)] if config else []
    return ["--dtype", "float32", "--radix-eviction-policy", policy, *extra, "--max-total-tokens", str(CAPACITY),
            "--chunked-prefill-size", "256", "--max-running-requests", "2", "--enable-metrics"]


def run_workload(server: ServerProcess) -> list[int]:
    """Sessions take turns round-robin (each turn: the whole conversation so far + a new user
    message; typed spans and the session in custom_params). Returns cached tokens per request.
    LRU evicts the conversation that returns next; SAE learns the sessions' gap and keeps it."""
    rnd = random.Random(0)
    system = [rnd.randrange(10, 500) for _ in range(SYSTEM)]
    context = {k: list(system) for k in range(SESSIONS)}
    cached = []
    for _ in range(ROUNDS):
        for k in range(SESSIONS):
            start = len(context[k])
            context[k] += [rnd.randrange(10, 500) for _ in range(TURN)]
            spans = [[0, SYSTEM, "system"]] + ([[SYSTEM, start, "assistant"]] if start > SYSTEM else []) \
                + [[start, len(context[k]), "user"]]
            out = server.generate(input_ids=context[k], sampling_params={
                "max_new_tokens": NEW, "temperature": 0,
                "custom_params": {"token_types": spans, "session": f"conversation-{k}"}})
            cached.append(out["meta_info"]["cached_tokens"])
            context[k] += out["output_ids"]
    return cached


@pytest.fixture(scope="module")
def booted(tiny_model_factory, tmp_path_factory):
    """(lru, sae) servers, booted side by side; both stopped at the end of the module."""
    logs = tmp_path_factory.mktemp("sae_logs")
    model = str(tiny_model_factory("qwen3-next"))
    servers = [ServerProcess(model, _args("lru"), log_path=logs / "lru.log"),
               ServerProcess(model, _args("sae", SAE_CONFIG), log_path=logs / "sae.log")]
    start_servers(servers)
    try:
        yield servers
    finally:
        stop_servers(servers)


@pytest.fixture(scope="module")
def lru_cached(booted):
    lru = booted[0]
    try:
        return run_workload(lru)
    finally:
        lru.stop()


@pytest.fixture(scope="module")
def sae(booted, lru_cached):
    return booted[1]


@pytest.fixture(scope="module")
def sae_cached(sae):
    return run_workload(sae)


def _metrics(server) -> str:
    return requests.get(f"{server.url}/metrics", timeout=30).text


def test_sae_keeps_the_conversations_that_return(sae, sae_cached, lru_cached):
    print(f"\ncached tokens per request\n  lru: {lru_cached} (total {sum(lru_cached)})"
          f"\n  sae: {sae_cached} (total {sum(sae_cached)})")
    assert sum(sae_cached) > 1.5 * sum(lru_cached)
    # the log says the Python tree core runs (the compiled one knows no Python policy)
    assert "Using the Python TreeCore: --radix-eviction-policy sae" in sae.log_text()


def test_metrics_report_evictions_by_type_and_queue_and_what_sae_learned(sae, sae_cached):
    text = _metrics(sae)
    assert metric_total(text, "sglang_ext:sae_evicted_tokens_total", 'queue="session",token_type="user"') > 0
    assert metric_total(text, "sglang_ext:sae_decisions_total") > 0
    assert metric_total(text, "sglang_ext:sae_decision_seconds_total") > 0
    assert "sglang_ext:sae_rereferenced_evicted_tokens_total" in text
    # the sessions' gap (4 requests on the request clock) is what SAE learned for them
    median = metric_total(text, "sglang_ext:sae_learned", 'name="median_reuse_s[session/response]"')
    assert median == pytest.approx(SESSIONS, rel=0.05)
    assert 0 <= metric_total(text, "sglang_ext:sae_learned", 'name="model_win_rate"') <= 1


@pytest.mark.parametrize("custom, field", [
    ({"token_types": [[0, 50, "user"]]}, "token_types[0]: end 50 is past the prompt (20 tokens)"),
    ({"token_types": [[0, 5, "manager"]]}, "token_types[0]: unknown token type 'manager'"),
    ({"token_types": [[4, 9, "user"], [0, 2, "system"]]}, "token_types[1]: spans must be sorted"),
    ({"token_types": {"user": [0, 5]}}, "token_types must be a list"),
    ({"session": {"id": 1}}, "custom_params.session must be a string or an integer"),
])
def test_malformed_fields_are_400_naming_the_field_and_the_server_keeps_serving(sae, custom, field):
    ids = list(range(10, 30))
    bad = requests.post(f"{sae.url}/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 2, "custom_params": custom}}, timeout=120)
    assert bad.status_code == 400, bad.text
    assert field in bad.text and "sampling_params.custom_params" in bad.text
    good = sae.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0, "custom_params": {
        "token_types": [[0, 12, "system"], [12, 20, "tool"]], "session": 3}})
    assert len(good["output_ids"]) == 2


def test_chat_completions_are_served_with_role_spans(sae):
    # the spans themselves are checked against the fixture's chat template in
    # tests/eviction/test_sae_serving.py; here: the seam runs on a live request, SGLang's
    # session_id rides along, and the server answers
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "session_id": "chat-1",
            "messages": [{"role": "system", "content": "You answer briefly."},
                         {"role": "user", "content": "Read the context first."},
                         {"role": "assistant", "content": "Done.", "reasoning_content": "It asks to read."},
                         {"role": "user", "content": "And now answer."}]}
    for _ in range(2):
        resp = requests.post(f"{sae.url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert "sae: chat messages left untyped" not in sae.log_text()


def test_bad_policy_config_stops_the_start_up_naming_the_key(tiny_model_factory):
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "serve", "--model-path",
                           str(tiny_model_factory("qwen3-next")), "--radix-eviction-policy", "sae",
                           "--radix-eviction-policy-config", '{"cost_powr": 1}'],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "sglang_ext: error: --radix-eviction-policy-config key 'cost_powr' is not a setting of 'sae'" in proc.stderr
    assert "Traceback" not in proc.stderr
