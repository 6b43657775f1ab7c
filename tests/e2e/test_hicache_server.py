"""Stock SGLang's hierarchical cache (the host tier) in the real CPU server: a tiny Qwen3-Next
under `--mamba-radix-cache-strategy extra_buffer --enable-hierarchical-cache` (the launcher adds
`--hicache-io-backend direct --hicache-mem-layout page_first_direct`; the host pools and their
copies come from patches/cpu/hicache.py), no `--radix-cache-backend`.

A prompt is sent three times: uncached, then a device hit, then, after other prompts have pushed
it out of the small device pool (`--max-total-tokens 1024`; HiCache writes through, so the host
keeps it), a host hit: SGLang reports `cached_tokens_details` {"device": 0, "host": N}. All three
give the same tokens and logprobs, and the uncached run equals transformers. SGLang's strict idle
pool check runs on the way out.
"""

from __future__ import annotations

import pytest

from eval.harness import ServerProcess
from eval.reference import greedy_reference, load_reference_model
from tests.e2e.serving import LOGPROB_ATOL, STRICT_CHECK_ENV, assert_matches_reference, greedy, random_prompt, sanity_check_seconds, wait_for_idle_check

PROMPT, PUSH, PUSHES, NEW = 300, 400, 3, 8
ARGS = ["--dtype", "float32", "--mamba-radix-cache-strategy", "extra_buffer", "--enable-hierarchical-cache",
        "--max-total-tokens", "1024", "--max-mamba-cache-size", "8"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3-next")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("hicache_logs") / "hicache_server.log"
    with ServerProcess(str(model_dir), ARGS, log_path=log, env=STRICT_CHECK_ENV) as srv:
        yield srv


def cached(result) -> tuple[int, dict]:
    meta = result["meta_info"]
    return meta["cached_tokens"], meta.get("cached_tokens_details") or {}


def test_host_tier_hit_equals_device_hit_and_full_prefill(server, model_dir):
    ids = random_prompt(PROMPT, seed=1)
    uncached = greedy(server, ids, NEW)
    device_hit = greedy(server, ids, NEW)
    for seed in range(PUSHES):                               # push the prompt out of the device pool
        greedy(server, random_prompt(PUSH, seed=100 + seed), NEW)
    host_hit = greedy(server, ids, NEW)

    assert cached(uncached)[0] == 0
    hit, details = cached(device_hit)
    assert hit == PROMPT // 64 * 64                           # extra_buffer: the state at the last 64-token chunk
    assert details == {"device": hit, "host": 0}
    assert cached(host_hit) == (hit, {"device": 0, "host": hit})    # every cached token came from the host

    reference = greedy_reference(load_reference_model(model_dir), ids, NEW)
    for result in (uncached, device_hit, host_hit):
        assert_matches_reference(result, reference, atol=LOGPROB_ATOL)
    assert host_hit["output_ids"] == device_hit["output_ids"]
    assert [x[0] for x in host_hit["meta_info"]["output_token_logprobs"]] == \
        [x[0] for x in device_hit["meta_info"]["output_token_logprobs"]]


def test_idle_pool_accounting_check_runs_clean(server):
    before = sanity_check_seconds(server)
    greedy(server, random_prompt(40, seed=7), NEW)
    wait_for_idle_check(server, before)                      # the scheduler went idle and checked
    assert server.proc.poll() is None
    log = server.log_text()
    assert "memory leak" not in log and "Traceback" not in log
