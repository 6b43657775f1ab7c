"""The patched CPU server serves tiny Nemotron-H hybrids (Mamba-2 + attention; dense relu2 MLP
and Nemotron-3 style MoE) exactly like transformers: greedy ids and logprobs, short and long
prompts, 128-token chunked prefill, packed batches, and with a cached prefix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_ext.reference import greedy_reference, load_reference_model
from sglang_ext.testing import ServerProcess

NEW_TOKENS = 6
LOGPROB_ATOL = 1e-4
SERVER_ARGS = ["--dtype", "float32", "--chunked-prefill-size", "128"]
#: generous: the MoE server torch.compiles its router on the first request, and CI cores are shared
STARTUP_TIMEOUT_S = 600.0


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
        yield srv.start(timeout_s=STARTUP_TIMEOUT_S)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_reference_model(model_dir)


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (length,), generator=gen).tolist()


def _generate(server, ids, input_logprobs=False):
    """Greedy generation with output logprobs (input logprobs force a full recompute: no reuse)."""
    return server.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0},
                           return_logprob=True, logprob_start_len=0 if input_logprobs else -1)


def _assert_matches_reference(result, reference):
    assert result["output_ids"] == reference.output_ids
    out_lp = [x[0] for x in result["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(out_lp), torch.tensor(reference.output_logprobs),
                               atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("length", [3, 64, 129, 517])
def test_greedy_output_and_logprobs_equal_transformers(server, hf_model, length):
    """Lengths around the SSD chunk (64) and the prefill chunk (128); 517 spans 5 prefill chunks."""
    ids = _prompt(length, seed=length)
    result = _generate(server, ids, input_logprobs=True)
    reference = greedy_reference(hf_model, ids, NEW_TOKENS)
    _assert_matches_reference(result, reference)
    in_lp = [x[0] for x in result["meta_info"]["input_token_logprobs"][1:]]
    torch.testing.assert_close(torch.tensor(in_lp), torch.tensor(reference.input_logprobs),
                               atol=LOGPROB_ATOL, rtol=0)


def test_cached_prefix_is_reused_and_output_unchanged(server, hf_model):
    first_ids = _prompt(300, seed=7)
    first = _generate(server, first_ids)
    follow_up = first_ids + first["output_ids"] + _prompt(20, seed=8)
    second = _generate(server, follow_up)
    assert second["meta_info"]["cached_tokens"] > 0
    _assert_matches_reference(second, greedy_reference(hf_model, follow_up, NEW_TOKENS))


def test_concurrent_requests_equal_transformers(server, hf_model):
    """Requests batched together: several sequences packed in one prefill and one decode batch."""
    prompts = [_prompt(n, seed=200 + n) for n in (5, 70, 150)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: _generate(server, p), prompts))
    for ids, result in zip(prompts, results):
        _assert_matches_reference(result, greedy_reference(hf_model, ids, NEW_TOKENS))
