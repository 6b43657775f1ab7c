"""Tail-Replay under SGLang's `extra_buffer` state strategy, in the real patched server.

Two servers, both `--mamba-radix-cache-strategy extra_buffer`, chunked prefill of 64 or 128
tokens (documents of 240 tokens take several chunks) and a track interval of 64 (a decode of 12
tokens after a 250-token prompt crosses the boundary at 256, so decode-time tracking runs; with
128-token chunks a branch point on the 64-token grid can fall inside a chunk, where its track
takes the place of the chunk's own):

- "no_checkpoints": Qwen3-Next (GDN), the overlap scheduler on (SGLang's GPU default, which the
  CPU launcher turns off; this server runs the launcher with that default removed),
  `keep_checkpoints: false`, `--max-mamba-cache-size 6`. Each request holds its state and two
  ping-pong slots, so 2 requests run at once (with one slot each, 6 would be admitted and the
  third one's ping-pong allocation would fail).
- "checkpoints": Nemotron-H (Mamba-2), no overlap, checkpoints kept (the default),
  `--max-mamba-cache-size 12` (SGLang's own 4 slots per request: 3 running), on SGLang's static
  pools (`byte_budget: false`: the state pool's pressure is what several tests are about).

The "no_checkpoints" server runs on one byte budget (the default: SGLang's unified memory).

Both run with SGLang's strict idle check (the scheduler raises, and the server dies, when the
pools do not add up once it is idle) and its tree-cache sanity check.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import requests

from eval.harness import ServerProcess, start_servers, stop_servers
from eval.reference import greedy_reference, load_reference_model
from eval.replay.servers import stream_generate
from sglang_ext.tail_replay import SHARED_REPAIR_KEY
from tests.e2e.serving import LOGPROB_ATOL, OverlapServer, assert_matches_reference, metric_total, random_prompt

DOC, QUESTION, NEW = 240, 10, 12
DOCS, QUESTIONS = 3, 3                  # 9 concurrent clients over 3 shared documents
BASE = {"min_match_tokens": 16, "min_replay_tokens": 1}
COMMON = ["--dtype", "float32", "--radix-cache-backend", "tail_replay",
          "--mamba-radix-cache-strategy", "extra_buffer",
          "--mamba-track-interval", "64", "--mem-fraction-static", "0.3"]
#: name: (arch, config, state slots, overlap scheduler, chunked prefill size)
SERVERS = {
    "no_checkpoints": ("qwen3-next", {**BASE, "budget": 1 / 16, "keep_checkpoints": False}, 6, True, 64),
    "checkpoints": ("nemotron-h", {**BASE, "budget": 1 / 4, "byte_budget": False}, 12, False, 128),
}
#: SGLang's pool checks, on (strict: a leak raises in the scheduler)
CHECK_ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1"}
SANITY_METRIC = re.compile(r'^sglang:scheduler_stage_seconds_total\{category="sanity_check_cache"[^}]*\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("extra_buffer_logs")
    procs = {}
    for name, (arch, config, slots, overlap, chunk) in SERVERS.items():
        cls = OverlapServer if overlap else ServerProcess
        args = [*COMMON, "--tail-replay-config", json.dumps(config), "--max-mamba-cache-size", str(slots),
                "--chunked-prefill-size", str(chunk)]
        procs[name] = cls(str(tiny_model_factory(arch)), args, log_path=logs / f"{name}.log")
    with mock.patch.dict(os.environ, CHECK_ENV):
        start_servers(list(procs.values()))
    try:
        yield procs
    finally:
        stop_servers(list(procs.values()))


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    """Greedy full-prefill references (transformers), computed once per (arch, prompt)."""
    models, cache = {}, {}

    def reference(arch: str, ids: list[int], new_tokens: int = NEW):
        key = (arch, tuple(ids), new_tokens)
        if key not in cache:
            if arch not in models:
                models[arch] = load_reference_model(tiny_model_factory(arch))
            cache[key] = greedy_reference(models[arch], ids, new_tokens)
        return cache[key]

    return reference


def ask(server, ids, overrides=None, new_tokens=NEW):
    custom = {"tail_replay": overrides} if overrides else None
    return server.generate(input_ids=ids, return_logprob=True,
                           sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                            "ignore_eos": True, "custom_params": custom})


def details(result) -> dict:
    return result["meta_info"]["cached_tokens_details"]["tail_replay"]


def prompts(seed: int) -> list[list[int]]:
    """Documents interleaved (d0 q0, d1 q0, d2 q0, d0 q1, ...), so each is shared in flight."""
    docs = [random_prompt(DOC, seed=seed + d) for d in range(DOCS)]
    return [docs[d] + random_prompt(QUESTION, seed=seed + 100 + q * DOCS + d)
            for q in range(QUESTIONS) for d in range(DOCS)]


def burst(server, ids_list, overrides):
    with ThreadPoolExecutor(len(ids_list)) as pool:
        return list(pool.map(lambda ids: ask(server, ids, overrides), ids_list))


def sanity_check_seconds(server) -> float:
    return sum(float(v) for v in SANITY_METRIC.findall(requests.get(f"{server.url}/metrics", timeout=30).text))


def test_sizing_admits_pool_over_the_slots_a_request_holds(servers):
    # no_checkpoints: own state + 2 ping-pong slots (overlap) = 3 -> 6 // 3; checkpoints: SGLang's 4
    for name, expected in (("no_checkpoints", 2), ("checkpoints", 3)):
        info = requests.get(f"{servers[name].url}/get_server_info", timeout=30).json()
        assert info["disable_overlap_schedule"] is (name == "checkpoints")
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == expected


@pytest.mark.parametrize("name", SERVERS)
def test_concurrent_clients_at_full_budget_equal_full_prefill(servers, references, name):
    arch = SERVERS[name][0]
    ids_list = prompts(seed=10)
    results = burst(servers[name], ids_list, {"budget": 1.0})
    for ids, result in zip(ids_list, results):
        assert_matches_reference(result, references(arch, ids), atol=LOGPROB_ATOL)
        assert details(result)["kind"] in ("miss", "exact_replay", "exact_checkpoint")
    # the shared documents were found in the tree while others were running
    assert sum(details(r)["matched_tokens"] >= DOC - 64 for r in results) >= DOCS


def test_concurrent_approximate_hits_without_checkpoints(servers):
    server = servers["no_checkpoints"]
    ids_list = prompts(seed=20)
    first = burst(server, ids_list[:DOCS], None)           # one client per document: misses
    assert [details(r)["kind"] for r in first] == ["miss"] * DOCS
    results = burst(server, ids_list[DOCS:], None)         # 6 clients on 2 running slots
    for result in results:
        assert details(result)["kind"] == "approximate"
        assert details(result)["matched_tokens"] >= DOC
        assert len(result["output_ids"]) == NEW


def test_decode_tracked_checkpoint_is_exact(servers, references):
    server = servers["checkpoints"]
    first_ids = random_prompt(DOC + QUESTION, seed=30)       # 250 tokens; decode crosses 256
    first = ask(server, first_ids)
    follow_up = first_ids + first["output_ids"] + random_prompt(QUESTION, seed=31)
    second = ask(server, follow_up)                          # KV to 261 (the last output token has none)
    assert details(second) == {"kind": "exact_checkpoint", "matched_tokens": 261,
                               "reused_tokens": 256, "replayed_tokens": 5, "exact": True, "kv_exact": True, "bound": 0.0}
    assert_matches_reference(second, references("nemotron-h", follow_up))


def test_prefill_tracked_checkpoint_is_exact(servers, references):
    server = servers["checkpoints"]
    document = random_prompt(DOC, seed=40)
    ask(server, document, new_tokens=1)                      # prefill tracks the state at 192; KV to 240
    question = document + random_prompt(QUESTION, seed=41)
    result = ask(server, question)
    assert details(result) == {"kind": "exact_checkpoint", "matched_tokens": 240,
                               "reused_tokens": 192, "replayed_tokens": 48, "exact": True, "kv_exact": True, "bound": 0.0}
    assert_matches_reference(result, references("nemotron-h", question))


SHARED_REPAIRS = ("sglang_ext:tail_replay_repairs_total", 'kind="shared_state"')


def _shared_repairs(server) -> float:
    return metric_total(requests.get(f"{server.url}/metrics", timeout=30).text, *SHARED_REPAIRS)


def test_the_first_branch_off_a_shared_prefix_gets_stocks_branch_state_exact(servers, references):
    """Stock SGLang's extra buffer keeps an exact state where a request branches off the tree (on
    the checkpoint grid below its match: 192 of a 240-token document), computed during that
    request's miss. Here the branching request is served by an approximate replay (the path holds
    no exact state: the document's first request kept none) and asks, at its own match, for that
    state's exact recomputation; the ask leaves with its first streamed token, the server runs
    it in the background, once, and the next request that branches there resumes exactly from
    192, as on stock, with outputs equal to a full prefill. A conversation's next turn that
    branches where its previous answer begins (its own history, not a shared prefix) asks for
    nothing, though its plan is approximate too."""
    server = servers["checkpoints"]
    document = random_prompt(DOC, seed=70)
    questions = [random_prompt(QUESTION, seed=71 + i) for i in range(3)]
    assert len({q[0] for q in questions}) == 3                 # each branches off at the document's end
    before = _shared_repairs(server)
    own = random_prompt(DOC + QUESTION, seed=80)
    answer = ask(server, own, {"keep_checkpoints": False})["output_ids"]
    next_turn = own + [t for t in random_prompt(QUESTION, seed=81) if t != answer[0]]
    assert details(ask(server, next_turn))["kind"] == "approximate"   # branches where the answer began
    ask(server, document + questions[0], {"keep_checkpoints": False})   # the document's KV, no state
    branching = stream_generate(server.url, document + questions[1], 24)
    assert branching.ok, branching.error
    summary = branching.meta_info["cached_tokens_details"]["tail_replay"]
    assert summary["kind"] == "approximate" and summary["matched_tokens"] == DOC and summary["exact"] is False
    assert SHARED_REPAIR_KEY not in branching.meta_info["cached_tokens_details"]
    deadline = time.monotonic() + 60
    while _shared_repairs(server) < before + 1:
        assert time.monotonic() < deadline, "the branch point's repair did not finish within 60 s"
        time.sleep(0.2)
    third_ids = document + questions[2]
    third = ask(server, third_ids)
    assert details(third) == {"kind": "exact_checkpoint", "matched_tokens": DOC, "reused_tokens": 192,
                              "replayed_tokens": DOC - 192, "exact": True, "kv_exact": True, "bound": 0.0}
    assert_matches_reference(third, references("nemotron-h", third_ids))
    assert _shared_repairs(server) == before + 1   # once: the third found the exact state; the next turn asked none


def test_a_turn_whose_state_was_freed_tracks_and_inserts_its_own_prompt_as_stock(servers, references):
    """State pressure frees a conversation's state and keeps its KV (stock frees that leaf whole).
    The next turn matches the KV and finds no state below its match: it branches off nothing, so
    under the extra buffer it tracks its state at its own prompt's end (256 of 256 tokens, its
    second 128-token chunk) and inserts that far, as on stock, and the turn after resumes there
    exactly. (Before: the extra buffer's branch-point track at the old end, 192, inside that
    chunk, took the place of the chunk's own, the insert stopped there, and the third turn
    resumed from 192: the agentic replay's requests that reused less than stock.)"""
    server = servers["checkpoints"]
    first = random_prompt(200, seed=90)
    ask(server, first, new_tokens=1)                             # its state at 192, its KV to 200
    for i in range(14):                                          # 14 newer states through 12 slots
        ask(server, random_prompt(70, seed=91 + i), new_tokens=1)
    second_ids = first + random_prompt(56, seed=110)
    second = ask(server, second_ids, {"exactness": "exact"}, new_tokens=1)
    assert details(second)["kind"] == "miss" and details(second)["matched_tokens"] == 200   # KV, no state
    third_ids = second_ids + random_prompt(QUESTION, seed=111)
    third = ask(server, third_ids)
    assert details(third) == {"kind": "exact_checkpoint", "matched_tokens": 256, "reused_tokens": 256,
                              "replayed_tokens": 0, "exact": True, "kv_exact": True, "bound": 0.0}
    assert_matches_reference(third, references("nemotron-h", third_ids))


def test_a_finished_request_leaves_its_kv_past_its_last_state_in_the_tree(servers, references):
    """The extra buffer inserts a finished request only up to the last state it tracked (192 of a
    200-token prompt: its second chunk's grid point) and stock SGLang frees the KV after it.
    Tail-Replay inserts that KV too, without a state. The next request over the same prompt
    matches all of it: by default it resumes exactly from the state at 192 and recomputes the
    rest, as stock (same reuse, same answer); a request that takes approximation reuses the KV
    past the state."""
    server = servers["checkpoints"]
    first = random_prompt(200, seed=120)
    ask(server, first, new_tokens=4)
    ids = first + random_prompt(QUESTION, seed=121)
    exact = ask(server, ids)
    assert details(exact) == {"kind": "exact_checkpoint", "matched_tokens": 200, "reused_tokens": 192,
                              "replayed_tokens": 8, "exact": True, "kv_exact": True, "bound": 0.0}
    assert exact["meta_info"]["cached_tokens"] == 192
    assert_matches_reference(exact, references("nemotron-h", ids))
    # an approximate plan starts on the checkpoint grid: the last matched token's window, cut to
    # the grid, reaches the state at 192, so even a request that takes approximation resumes there
    approx = ask(server, first + random_prompt(QUESTION, seed=122), {"exactness": "approximate", "budget": 0})
    assert details(approx)["kind"] == "exact_checkpoint" and details(approx)["matched_tokens"] == 200
    assert approx["meta_info"]["cached_tokens"] == 192
    assert len(approx["output_ids"]) == NEW


def test_an_approximate_replay_starts_on_the_checkpoint_grid(servers):
    """SGLang's extra buffer tracks a request's states at its prefix plus whole steps of the
    checkpoint grid (64 here), so an approximate replay that started off the grid would put every
    state it tracks off the grid stock's states lie on, and the conversation's next turn would
    resume up to 63 tokens shallower than stock's (the agentic replay's requests that reused 16-26
    tokens fewer than stock). A document whose states were freed (its KV kept): the replay window
    (72 of 240 matched tokens) starts at 168; cut to the grid, at 128."""
    server = servers["checkpoints"]
    document = random_prompt(DOC, seed=130)
    ask(server, document, new_tokens=1)                          # states to 192, KV to 240
    for i in range(14):                                          # 14 newer states through 12 slots
        ask(server, random_prompt(70, seed=131 + i), new_tokens=1)
    result = ask(server, document + random_prompt(QUESTION, seed=150), {"budget": 0.3})
    assert details(result)["kind"] == "approximate" and details(result)["matched_tokens"] == DOC
    assert details(result)["reused_tokens"] == 128 and result["meta_info"]["cached_tokens"] == 128
    assert len(result["output_ids"]) == NEW


@pytest.mark.parametrize("name", SERVERS)
def test_idle_pool_accounting_check_runs_clean(servers, name):
    server = servers[name]
    before = sanity_check_seconds(server)
    ask(server, random_prompt(DOC, seed=50))
    deadline = time.monotonic() + 60
    while sanity_check_seconds(server) <= before:            # the scheduler went idle and checked
        assert time.monotonic() < deadline, "the idle pool check did not run within 60 s"
        time.sleep(0.5)
    assert server.proc.poll() is None
    assert len(ask(server, random_prompt(20, seed=51))["output_ids"]) == NEW
    assert "memory leak" not in server.log_text()
    assert "Traceback" not in server.log_text()
