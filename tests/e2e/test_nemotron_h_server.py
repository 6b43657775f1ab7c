"""The patched CPU server serves tiny Nemotron-H hybrids (Mamba-2 + attention; dense relu2 MLP
and Nemotron-3 style MoE) exactly like transformers: greedy ids and logprobs, short and long
prompts, 128-token chunked prefill, packed batches, and with a cached prefix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from eval.harness import ServerProcess
from eval.reference import greedy_reference, load_reference_model
from tests.e2e.serving import NEW_TOKENS, assert_matches_reference, continue_conversation, greedy, random_prompt

SERVER_ARGS = ["--dtype", "float32", "--chunked-prefill-size", "128"]


@pytest.fixture(scope="module", params=["dense", "moe"])
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, layout):
    return tiny_model_factory("nemotron-h", layout)


@pytest.fixture(scope="module")
def server(model_dir, layout, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / f"nemotron_h_{layout}_server.log"
    srv = ServerProcess(str(model_dir), SERVER_ARGS, log_path=log)
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_reference_model(model_dir)


@pytest.mark.parametrize("length", [3, 64, 129, 517])
def test_greedy_output_and_logprobs_equal_transformers(server, hf_model, length):
    """Lengths around the SSD chunk (64) and the prefill chunk (128); 517 spans 5 prefill chunks."""
    ids = random_prompt(length, seed=length)
    result = greedy(server, ids, input_logprobs=True)
    reference = greedy_reference(hf_model, ids, NEW_TOKENS)
    assert_matches_reference(result, reference, input_logprobs=True)


def test_cached_prefix_is_reused_and_output_unchanged(server, hf_model):
    follow_up, second = continue_conversation(server)
    assert second["meta_info"]["cached_tokens"] > 0
    assert_matches_reference(second, greedy_reference(hf_model, follow_up, NEW_TOKENS))


def test_concurrent_requests_equal_transformers(server, hf_model):
    """Requests batched together: several sequences packed in one prefill and one decode batch."""
    prompts = [random_prompt(n, seed=200 + n) for n in (5, 70, 150)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: greedy(server, p), prompts))
    for ids, result in zip(prompts, results):
        assert_matches_reference(result, greedy_reference(hf_model, ids, NEW_TOKENS))
