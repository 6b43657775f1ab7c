"""Servers started from the defaults (no `--dtype`) under `--mamba-radix-cache-strategy extra_buffer`.

Without `--dtype` the tiny fixtures (float32 checkpoints) run in float16 (SGLang's "auto"), while
stock SGLang keeps conv-window states in a fixed bfloat16: the strategy's tracking copy in prefill
(an index put into the conv pool) then killed the server on its first request ("Index put requires
the source and destination dtypes match"), for GDN (Qwen3-Next) and Mamba-2 (Nemotron-H) alike.
`patches/shared/mamba_conv_dtype.py` stores the conv states in the model's dtype. Here two requests share
a prefix; the second reuses the state the first tracked at the last track-interval boundary.
"""

from __future__ import annotations

import pytest
import requests

from eval.harness import ServerProcess, start_servers, stop_servers
from tests.e2e.serving import random_prompt

ARCHS = ("qwen3-next", "nemotron-h")
PREFIX, SUFFIX, NEW = 300, 5, 4


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("default_dtype_logs")
    procs = {arch: ServerProcess(str(tiny_model_factory(arch)), ["--mamba-radix-cache-strategy", "extra_buffer"],
                                 log_path=logs / f"{arch}.log")
             for arch in ARCHS}
    start_servers(list(procs.values()))
    try:
        yield procs
    finally:
        stop_servers(list(procs.values()))


def ask(server, ids):
    return server.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW, "temperature": 0})


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_requests_complete_from_the_default_dtype(servers, arch):
    server = servers[arch]
    info = requests.get(f"{server.url}/server_info", timeout=30).json()
    assert info["dtype"] == "auto" and info["mamba_radix_cache_strategy"] == "extra_buffer"
    document = random_prompt(PREFIX, seed=7)
    first = ask(server, document + random_prompt(SUFFIX, seed=8))
    second = ask(server, document + random_prompt(SUFFIX, seed=9))
    assert first["meta_info"]["cached_tokens"] == 0
    track = info["mamba_track_interval"]
    assert 0 < track <= PREFIX
    assert second["meta_info"]["cached_tokens"] == PREFIX // track * track
    assert len(first["output_ids"]) == len(second["output_ids"]) == NEW
    assert requests.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    assert "Traceback" not in server.log_text()
