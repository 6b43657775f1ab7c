"""SAECache with `--radix-cache-backend tail_replay` (one server): the backend's tree runs the
Python core with SAE choosing the full-KV leaves, the typed multi-turn workload is served with
reuse, and SAE's decisions and feedback show in /metrics."""

from __future__ import annotations

import json

import pytest
import requests

from eval.harness import ServerProcess
from tests.e2e.serving import metric_total
from tests.e2e.test_sae_server import SAE_CONFIG, _args, run_workload

TAIL_REPLAY = {"min_match_tokens": 16, "min_replay_tokens": 1}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    args = [*_args("sae", SAE_CONFIG), "--radix-cache-backend", "tail_replay",
            "--tail-replay-config", json.dumps(TAIL_REPLAY)]
    with ServerProcess(str(tiny_model_factory("qwen3-next")), args,
                       log_path=tmp_path_factory.mktemp("sae_tr") / "server.log") as proc:
        yield proc


def test_tail_replay_backend_runs_sae(server):
    cached = run_workload(server)
    print(f"\nsae + tail_replay cached tokens per request: {cached} (total {sum(cached)})")
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    assert metric_total(text, "sglang_ext:sae_decisions_total") > 0
    assert metric_total(text, "sglang_ext:sae_evicted_tokens_total", 'queue="session"') > 0
    assert metric_total(text, "sglang_ext:tail_replay_hits_total") > 0
    # every conversation's second turn reuses its first (nothing is evicted before round 2)
    assert all(c > 0 for c in cached[4:8])
    assert "sae: /metrics not updated" not in server.log_text()
