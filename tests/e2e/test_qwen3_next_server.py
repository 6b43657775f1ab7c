"""The patched CPU server serves a tiny Qwen3-Next (GDN + attention, MoE) exactly like transformers.

Its children are spawned, as SGLang does on GPUs (the suite forks them elsewhere): the patches
the children re-apply (`sglang_ext.spawn_main`) are what this module checks."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from eval.harness import ServerProcess
from eval.reference import greedy_reference, load_reference_model
from tests.e2e.serving import (
    NEW_TOKENS,
    SPAWN_ENV,
    assert_matches_reference,
    children_forked,
    continue_conversation,
    greedy,
    metric_total,
    random_prompt,
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3-next")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "qwen3_next_server.log"
    srv = ServerProcess(str(model_dir), ["--dtype", "float32", "--chunked-prefill-size", "128"], log_path=log, env=SPAWN_ENV)
    with srv:
        yield srv


def test_children_are_spawned(server):
    assert not children_forked(server)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_reference_model(model_dir)


@pytest.mark.parametrize("length", [3, 64, 129, 517])
def test_greedy_output_and_logprobs_equal_transformers(server, hf_model, length):
    ids = random_prompt(length, seed=length)
    result = greedy(server, ids, input_logprobs=True)
    reference = greedy_reference(hf_model, ids, NEW_TOKENS)
    assert_matches_reference(result, reference, input_logprobs=True)


def test_cached_prefix_is_reported_and_output_unchanged(server, hf_model):
    follow_up, second = continue_conversation(server)
    # SGLang caches the finished sequence minus its last token.
    assert second["meta_info"]["cached_tokens"] >= 300
    assert_matches_reference(second, greedy_reference(hf_model, follow_up, NEW_TOKENS))


def test_metrics_counters_move(server):
    before = requests.get(f"{server.url}/metrics", timeout=30).text
    ids = random_prompt(200, seed=11)
    first = greedy(server, ids, new_tokens=2)
    greedy(server, ids + first["output_ids"] + [42], new_tokens=2)
    after = requests.get(f"{server.url}/metrics", timeout=30).text
    for name in ("sglang:prompt_tokens_total", "sglang:cached_tokens_total"):
        assert metric_total(after, name) > metric_total(before, name), name


def test_concurrent_requests_equal_sequential(server):
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 40, 90, 150, 260, 33)]
    sequential = [greedy(server, p)["output_ids"] for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        concurrent = list(pool.map(lambda p: greedy(server, p)["output_ids"], prompts))
    assert concurrent == sequential


def test_chat_completion_uses_the_chat_template(server):
    body = {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Say hello."}]}
    resp = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    usage = resp.json()["usage"]
    assert usage["completion_tokens"] == 4
    # ChatML framing: two messages + generation prompt add special tokens beyond the text.
    assert usage["prompt_tokens"] > len("You are terse. Say hello.") // 4


def test_frontend_program_runs_against_the_server(server):
    import sglang as sgl

    @sgl.function
    def pick(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=5, temperature=0)
        s += "\nVerdict:" + sgl.select("verdict", choices=[" yes", " no", " maybe"])

    backend = sgl.RuntimeEndpoint(server.url)
    state = pick.run(question="Is the sky blue?", backend=backend)
    assert state["verdict"] in (" yes", " no", " maybe")
    direct = server.generate(text="Question: Is the sky blue?\nAnswer:",
                             sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert state["answer"] == direct["text"]


def test_out_of_vocabulary_input_ids_are_that_requests_error(server, model_dir):
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    for bad in (vocab_size, -1):
        resp = requests.post(f"{server.url}/generate", timeout=60,
                             json={"input_ids": [1, bad, 2], "sampling_params": {"max_new_tokens": 1}})
        assert resp.status_code == 400 and f"input_ids[1] = {bad} is not a token id" in resp.text
    assert greedy(server, [4, 5, 6], new_tokens=1)["meta_info"]["completion_tokens"] == 1   # still serving
