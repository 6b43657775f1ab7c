"""`exactness: "exact_unless_pressed"` against live servers (tiny Qwen3-Next with a decay profile
whose slowest head forgets 0.9 per token, so a fresh replay of W tokens is certified to 0.9 ** W):
a server whose thresholds are always met (0) replays approximately within the tolerance and says
which thresholds, stays exact where the certified bound is beyond it; a server whose thresholds are
never met answers exactly; a client sending the server's stamp gets a 400 and the server stays up.

Two servers, started together once for the module. States are kept out of the tree
(`keep_checkpoints: false`), so a document's second request is a pure KV hit of L = 300 tokens: the
approximate mode replays its last W tokens from a zero state, the exact mode recomputes it.
(`--tp 2` does not run on the CPU path these tests use; every rank reading the first rank's stamp
is tested in tests/tail_replay/test_pressure.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import requests

from eval.harness import ServerProcess, start_servers, stop_servers
from tests.e2e.serving import LOGPROB_ATOL, metric_total, random_prompt

PROFILE = {"layers": {"0": [{"head": 0, "decay_p10": 0.2, "decay_p50": 0.6, "decay_p90": 0.9}]}}
L = 300
#: budget 0.3: W = 90 tokens, certified to 0.9 ** 90 = 7.6e-5 (within 0.01); budget 0.1 per request:
#: W = 30, 0.9 ** 30 = 0.042 (beyond)
CONFIG = {"exactness": "exact_unless_pressed", "keep_checkpoints": False, "budget": 0.3, "min_replay_tokens": 16,
          "min_match_tokens": 128}
PRESSED = {**CONFIG, "pressure": {"num_queue_reqs": 0, "token_usage": 0, "tolerance": 0.01}}
CALM = {**CONFIG, "pressure": {"num_queue_reqs": 1_000_000, "tolerance": 0.01}}
COUNTER = "sglang_ext:tail_replay_pressure_requests_total"


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pressure") / "model"
    shutil.copytree(tiny_model_factory("qwen3-next"), folder)
    (folder / "decay.json").write_text(json.dumps(PROFILE))
    procs = {name: ServerProcess(str(folder), ["--dtype", "float32", "--radix-cache-backend", "tail_replay",
                                               "--tail-replay-config", json.dumps(config)],
                                 log_path=folder.parent / f"{name}.log")
             for name, config in (("pressed", PRESSED), ("calm", CALM))}
    start_servers(list(procs.values()))
    try:
        yield procs
    finally:
        stop_servers(list(procs.values()))


def _ask(server, ids, overrides=None) -> dict:
    params = {"max_new_tokens": 3, "temperature": 0}
    if overrides:
        params["custom_params"] = {"tail_replay": overrides}
    return server.generate(input_ids=ids, sampling_params=params, return_logprob=True)


def _details(result) -> dict:
    return result["meta_info"]["cached_tokens_details"]["tail_replay"]


def _second_turn(server, seed, overrides=None) -> dict:
    """A document (cold), then the document with a question: the question's hit is L tokens of KV."""
    document = random_prompt(L, seed=seed)
    _ask(server, document)
    return _ask(server, document + random_prompt(4, seed=seed + 1), overrides)


def _metrics(server) -> str:
    return requests.get(f"{server.url}/metrics", timeout=30).text


def test_pressed_replays_approximately_within_the_tolerance_and_says_why(servers):
    server = servers["pressed"]
    label = 'outcome="approximate",pressed_by="num_queue_reqs,token_usage"'
    before = metric_total(_metrics(server), COUNTER, label)
    details = _details(_second_turn(server, seed=11))
    assert (details["kind"], details["matched_tokens"], details["replayed_tokens"]) == ("approximate", L, 90)
    assert details["pressure"] == {"pressed_by": ["num_queue_reqs", "token_usage"], "outcome": "approximate",
                                   "planned_bound": pytest.approx(0.9 ** 90)}
    assert details["exact"] is False and details["kv_exact"] is False
    assert metric_total(_metrics(server), COUNTER, label) == before + 1


def test_pressed_beyond_the_tolerance_stays_exact(servers):
    pressed, calm = servers["pressed"], servers["calm"]
    result = _second_turn(pressed, seed=21, overrides={"budget": 0.1})
    details = _details(result)
    assert details["kind"] == "miss" and details["exact"] is True and details["kv_exact"] is True
    assert details["pressure"] == {"pressed_by": ["num_queue_reqs", "token_usage"], "outcome": "beyond_tolerance",
                                   "planned_bound": pytest.approx(0.9 ** 30)}
    # the same answer as the never-pressed server's, computed exactly
    reference = _second_turn(calm, seed=21)
    assert result["output_ids"] == reference["output_ids"]
    logprobs = [[x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in (result, reference)]
    assert logprobs[0] == pytest.approx(logprobs[1], abs=LOGPROB_ATOL)


def test_never_pressed_answers_exactly(servers):
    server = servers["calm"]
    details = _details(_second_turn(server, seed=11))
    assert details["kind"] == "miss" and details["exact"] is True and details["kv_exact"] is True
    assert details["pressure"] == {"pressed_by": [], "outcome": "not_pressed", "planned_bound": None}
    assert metric_total(_metrics(server), COUNTER, 'outcome="not_pressed",pressed_by=""') >= 2


@pytest.mark.parametrize("custom, needle", [
    ({"tail_replay_pressure": {"pressed_by": ["num_queue_reqs"]}},
     "custom_params['tail_replay_pressure'] is set by the server at arrival; a request cannot set it"),
    ({"tail_replay": {"pressure": {"num_queue_reqs": 0}}}, "'pressure': is a server setting"),
])
def test_a_client_sending_the_stamp_or_the_thresholds_gets_a_400(servers, custom, needle):
    server = servers["calm"]
    resp = requests.post(f"{server.url}/generate", timeout=120, json={
        "input_ids": random_prompt(20, seed=5), "sampling_params": {"max_new_tokens": 1, "custom_params": custom}})
    assert resp.status_code == 400, resp.text
    assert needle in resp.text
    assert _details(_ask(server, random_prompt(20, seed=6)))["pressure"]["outcome"] == "not_pressed"
