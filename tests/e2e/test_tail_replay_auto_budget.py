"""`budget: "auto"` in the patched server: the model folder's decay.json is found at start-up, the
replayed window is the one it certifies (also per request, with another tolerance), and a server
asked for "auto" without a profile refuses to start, naming the model path."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from eval.harness import ServerProcess, servers_running

#: slowest head's p90 decay 0.9: tolerance 0.01 -> 44 tokens, 0.1 -> 22 tokens
PROFILE = {"layers": {"0": [{"head": 0, "decay_p10": 0.2, "decay_p50": 0.6, "decay_p90": 0.9}]}}
CONFIG = {"budget": "auto", "min_replay_tokens": 0, "keep_checkpoints": False}


@pytest.fixture(scope="module")
def model_with_profile(tiny_model_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("auto") / "model"
    shutil.copytree(tiny_model_factory("qwen3-next"), folder)
    (folder / "decay.json").write_text(json.dumps(PROFILE))
    return folder


def _ask(server, ids, overrides=None):
    params = {"max_new_tokens": 2, "temperature": 0}
    if overrides:
        params["custom_params"] = {"tail_replay": overrides}
    return server.generate(input_ids=ids, sampling_params=params)["meta_info"]["cached_tokens_details"]["tail_replay"]


def test_auto_budget_replays_the_certified_window(model_with_profile, tmp_path):
    rng = random.Random(0)
    documents = [[rng.randrange(10, 400) for _ in range(300)] for _ in range(2)]
    server = ServerProcess(str(model_with_profile), ["--dtype", "float32", "--radix-cache-backend", "tail_replay",
                                                     "--tail-replay-config", json.dumps(CONFIG)],
                           log_path=tmp_path / "server.log")
    with servers_running([server]):
        for doc, overrides, window in ((documents[0], None, 44), (documents[1], {"tolerance": 0.1}, 22)):
            _ask(server, doc)
            details = _ask(server, doc + [7, 8, 9], overrides)
            assert details["kind"] == "approximate" and details["matched_tokens"] == 300
            assert details["replayed_tokens"] == window
    log = (tmp_path / "server.log").read_text()
    assert "certified window for tolerance 0.01: 44 tokens" in log


def test_auto_budget_without_a_profile_refuses_to_start(tiny_model_factory):
    model = tiny_model_factory("qwen3-next")
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "serve", "--model-path", str(model), "--dtype",
                           "float32", "--radix-cache-backend", "tail_replay", "--tail-replay-config",
                           '{"budget": "auto"}'], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"no decay.json in --model-path '{model}'" in proc.stderr
    assert "Traceback" not in proc.stderr
