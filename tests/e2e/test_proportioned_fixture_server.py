"""The patched CPU server serves the Qwen3-Next-proportioned fixture (hidden 512, 8 layers, 16
experts, top-10) exactly like transformers, so the TTFT benchmark times the real model. Its
children are forked from the launcher (the suite's start method, tests/conftest.py)."""

from __future__ import annotations

import pytest

from eval.harness import ServerProcess
from eval.reference import greedy_reference, load_reference_model
from tests.e2e.serving import NEW_TOKENS, assert_matches_reference, children_forked, greedy, random_prompt


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3-next", "proportioned")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "proportioned_server.log"
    # a static fraction above the CPU default (0.1): the weights (~170 MB) plus other processes'
    # allocations during start-up must not exhaust SGLang's share of free memory
    args = ["--dtype", "float32", "--chunked-prefill-size", "128", "--max-total-tokens", "8192",
            "--mem-fraction-static", "0.5"]
    srv = ServerProcess(str(model_dir), args, log_path=log)
    with srv:
        yield srv


def test_greedy_output_and_logprobs_equal_transformers(server, model_dir):
    ids = random_prompt(150, seed=3)            # two chunks of 128: chunked prefill included
    result = greedy(server, ids, input_logprobs=True)
    reference = greedy_reference(load_reference_model(model_dir), ids, NEW_TOKENS)
    assert_matches_reference(result, reference, input_logprobs=True)


def test_children_are_forked(server):
    assert children_forked(server)
