"""LinearKV in the patched server (`--radix-cache-backend linearkv`), GDN (Qwen3-Next) and Mamba-2
(Nemotron-H) fixtures, one server each, started together.

- a chunk at offset 0 with no prefix and no selector reproduces full prefill (its KV needs no
  rotation and its end state is the exact state);
- chunks reused at new offsets, in another order, after a cached prefix give the reference path's
  output (`sglang_ext.linearkv.reference.assemble`, selector none and EPIC-k, state predecessor /
  zero, and compose on Mamba-2);
- separator mode, chunked prefill of a long question, bad spans / config (400 or start-up error
  naming the field), and >= 8 concurrent clients sharing chunks in different orders under KV and
  state-pool eviction, with SGLang's strict idle pool-accounting check on (a leaked KV or state
  slot kills the scheduler and fails every later request);
- production traffic: truncated prompts, fuzzed requests with aborts and early disconnects,
  tenants kept apart, KV events without chunk registrations.

The GDN server runs SGLang's GPU configuration: the overlap scheduler on and
`--mamba-radix-cache-strategy extra_buffer` (a chunk registration keeps its end state at the
chunk's end, not on the tracking grid); the Mamba-2 server runs `no_buffer`, publishes KV events
and uses SGLang's typed msgpack IPC (`SGLANG_USE_PICKLE_IPC=0`: the request fields and meta_info
summaries cross it encoded, `patches/shared/ipc_json.py`), the GDN server pickle IPC (the default).
Both truncate over-long prompts (`--allow-auto-truncate`, context 1024).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import requests
import torch

from eval.harness import ServerProcess, free_port, start_servers, stop_servers
from eval.reference import load_reference_model
from sglang_ext.linearkv import parse_selector
from sglang_ext.linearkv import reference as R
from tests.e2e.serving import OverlapServer, metric_total

ARCHS = ("qwen3-next", "nemotron-h")
KV_TOKENS = 3000
STATE_SLOTS = 12
CONTEXT = 1024
#: per server: launcher class, extra flags (the GDN server holds 3 slots per running request under
#: extra_buffer with overlap, its state and two ping-pong slots, so it gets 8 more)
SETUP = {
    "qwen3-next": (OverlapServer, ["--mamba-radix-cache-strategy", "extra_buffer", "--mamba-track-interval", "64",
                                   "--max-mamba-cache-size", str(STATE_SLOTS + 8)]),
    "nemotron-h": (ServerProcess, ["--max-mamba-cache-size", str(STATE_SLOTS)]),
}
CHUNK = 48
NEW = 5
LOGPROB_ATOL = 1e-3
SEP = " # # "


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("linearkv_logs")
    models = {arch: tiny_model_factory(arch) for arch in ARCHS}
    events_port = free_port()
    procs = {}
    for arch in ARCHS:
        cls, flags = SETUP[arch]
        env = {}
        if arch == "nemotron-h":
            flags = [*flags, "--kv-events-config", json.dumps(
                {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}", "bind": True})]
            env = {"SGLANG_USE_PICKLE_IPC": "0"}   # SGLang's typed msgpack IPC (the GDN server: pickle)
        procs[arch] = cls(str(models[arch]), [
            "--dtype", "float32", "--radix-cache-backend", "linearkv", "--enable-metrics",
            "--linearkv-config", json.dumps({"min_chunk_tokens": 8, "separator": SEP}),
            "--chunked-prefill-size", "64", "--max-total-tokens", str(KV_TOKENS), "--allow-auto-truncate",
            "--context-length", str(CONTEXT), "--mem-fraction-static", "0.5", *flags],
            log_path=logs / f"{arch}.log", env=env)
        procs[arch].events_port = events_port if arch == "nemotron-h" else None
    with mock.patch.dict(os.environ, {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}):   # inherited at launch
        start_servers(list(procs.values()))
    try:
        yield procs, models
    finally:
        stop_servers(list(procs.values()))


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _layout(prefix: list[int], chunks: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    spans, pos = [], len(prefix)
    for c in chunks:
        spans.append([pos, pos + len(c)])
        pos += len(c)
    return prefix + [t for c in chunks for t in c], spans


def ask(server, prefix, chunks, question, new=NEW, state=None, selector=None, custom_extra=None, **extra):
    ids, spans = _layout(prefix, chunks)
    linearkv = {"chunks": spans, **({"state": state} if state else {}), **({"selector": selector} if selector else {})}
    return server.generate(input_ids=ids + question, return_logprob=True, **extra, sampling_params={
        "max_new_tokens": new, "temperature": 0, "custom_params": {"linearkv": linearkv, **(custom_extra or {})}})


def full(server, ids, new=NEW):
    """Full prefill: input logprobs from position 0 force a recompute of the whole prompt."""
    return server.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                           sampling_params={"max_new_tokens": new, "temperature": 0})


def _logprobs(result) -> list[float]:
    return [x[0] for x in result["meta_info"]["output_token_logprobs"]]


def _details(result) -> dict:
    return result["meta_info"]["cached_tokens_details"]["linearkv"]


@pytest.mark.parametrize(("arch", "k"), [(arch, k) for arch in ARCHS for k in (0, 8)])
def test_one_chunk_at_offset_zero_reproduces_full_prefill(served, arch, k):
    """Also with EPIC-8: the head recomputed at offset 0 from a zero state is what its
    registration computed, so the output stays the full prefill's."""
    procs, _ = served
    server = procs[arch]
    chunk, question = _ids(CHUNK + 7, 1 + k), _ids(9, 2)
    got = ask(server, [], [chunk], question, selector=f"epic-{k}" if k else None)
    details = _details(got)
    assert details == {"chunks_hit": 1, "chunks_missed": 0, "reused_tokens": CHUNK + 7 - k,
                       "recomputed_tokens": 9 + k, "state_source": "predecessor",
                       "selector": f"epic-{k}" if k else "none"}
    ref = full(server, chunk + question)
    assert got["output_ids"] == ref["output_ids"]
    torch.testing.assert_close(torch.tensor(_logprobs(got)), torch.tensor(_logprobs(ref)), atol=1e-4, rtol=0)


#: rules served on both models (compose: Mamba-2 only); replay-16 reads no chunk state
STATES = ("predecessor", "zero", "replay-16")


def _expected(prefix, chunks, question, state, selector="none") -> dict:
    """The linearkv summary of an all-hit request, from the server's own plan."""
    from sglang_ext.linearkv.serving import LinearKVConfig, plan_chunks

    ids, spans = _layout(prefix, chunks)
    plan = plan_chunks({"chunks": spans, "state": state, "selector": selector}, len(ids) + len(question),
                       LinearKVConfig(min_chunk_tokens=8), can_compose=True)
    return {"chunks_hit": len(chunks), "chunks_missed": 0,
            "reused_tokens": plan.chunk_tokens - plan.recomputed_chunk_tokens,
            "recomputed_tokens": len(ids) + len(question) - plan.forward_start + plan.head_tokens,
            "state_source": plan.state, "selector": selector}


@pytest.fixture(scope="module")
def reference_models(served):
    _, models = served
    torch.manual_seed(0)
    out = {}
    for arch in ARCHS:
        model = load_reference_model(models[arch])
        out[arch] = (model, R.model_layout(model, model_id=f"tiny-{arch}"))
    return out


@pytest.mark.parametrize(("arch", "state"), [(arch, state) for arch in ARCHS for state in STATES]
                         + [("nemotron-h", "compose")])
def test_reordered_chunks_after_a_cached_prefix_match_the_reference_path(served, reference_models, arch, state):
    procs, _ = served
    server = procs[arch]
    model, layout = reference_models[arch]
    seed = {"predecessor": 10, "zero": 20, "compose": 40, "replay-16": 30}[state]
    prefix = _ids(24, seed)
    chunks = [_ids(CHUNK, seed + 1), _ids(CHUNK - 5, seed + 2), _ids(CHUNK + 11, seed + 3)]
    question = _ids(12, seed + 4)
    order = [chunks[2], chunks[0], chunks[1]]
    first = ask(server, prefix, chunks, question, state=state)   # registers P and the chunks
    # P is in no radix-tree path yet: its own registration at offset 0 serves its exact KV
    assert _details(first)["chunks_hit"] == 3, _details(first)
    got = ask(server, prefix, order, question, state=state)
    expected = _expected(prefix, order, question, state)
    assert _details(got) == expected
    if not state.startswith("replay"):
        assert expected["reused_tokens"] == sum(map(len, chunks)) and expected["recomputed_tokens"] == len(question)
    else:   # the last chunk's last 16 tokens are replayed from zero before the question
        assert expected["recomputed_tokens"] == len(question) + 16

    entries = [R.register(model, layout, c, transitions=state == "compose") for c in order]
    ref = R.assemble(model, layout, entries, question, parse_selector("none"), state, prefix_ids=prefix)
    n = len(prefix) + sum(map(len, chunks)) + len(question)
    ref_ids, ref_lp = R.greedy(model, ref.cache, ref.logits[-1], n, NEW)
    assert got["output_ids"] == ref_ids
    torch.testing.assert_close(torch.tensor(_logprobs(got)), torch.tensor(ref_lp), atol=LOGPROB_ATOL, rtol=0)


EPIC_K = 12


@pytest.mark.parametrize(("arch", "state"), [(arch, state) for arch in ARCHS for state in STATES]
                         + [("nemotron-h", "compose")])
def test_epic_heads_recomputed_in_context_match_the_reference_path(served, reference_models, arch, state):
    """EPIC-12 (a chunk shorter than k is recomputed whole): the heads run in the worker's
    pre-pass, each from the state rule's seed, before the question; the output is the reference
    path's `assemble(..., epic-12, state)`."""
    procs, _ = served
    server = procs[arch]
    model, layout = reference_models[arch]
    seed = {"predecessor": 50, "zero": 60, "compose": 70, "replay-16": 80}[state]
    prefix = _ids(20, seed)
    chunks = [_ids(CHUNK, seed + 1), _ids(9, seed + 2), _ids(CHUNK + 11, seed + 3)]
    question = _ids(10, seed + 4)
    selector = f"epic-{EPIC_K}"
    ask(server, prefix, chunks[::-1], _ids(4, seed + 5), state=state, selector=selector)   # registers
    got = ask(server, prefix, chunks, question, state=state, selector=selector)
    heads = EPIC_K + 9 + EPIC_K
    expected = _expected(prefix, chunks, question, state, selector)
    assert _details(got) == expected
    if not state.startswith("replay"):
        assert expected["recomputed_tokens"] == len(question) + heads
    else:   # chunk 1's head starts 16 tokens back into chunk 0, the question 16 tokens back
        assert expected["recomputed_tokens"] == len(question) + heads + 16 + 16

    entries = [R.register(model, layout, c, transitions=state == "compose") for c in chunks]
    ref = R.assemble(model, layout, entries, question, parse_selector(selector), state, prefix_ids=prefix)
    n = len(prefix) + sum(map(len, chunks)) + len(question)
    ref_ids, ref_lp = R.greedy(model, ref.cache, ref.logits[-1], n, NEW)
    assert got["output_ids"] == ref_ids
    torch.testing.assert_close(torch.tensor(_logprobs(got)), torch.tensor(ref_lp), atol=LOGPROB_ATOL, rtol=0)
    if state in ("predecessor", "compose"):
        # and not the selector-none output: the heads' seeds changed their KV. (Under zero, a head
        # whose first attention layer follows every linear layer, as in the GDN fixture, gets back
        # its cached KV: only later attention layers would see the earlier chunks.)
        plain = R.assemble(model, layout, entries, question, parse_selector("none"), state, prefix_ids=prefix)
        assert (plain.logits[-1] - ref.logits[-1]).abs().max() > 10 * LOGPROB_ATOL


def test_epic_requests_sent_together_answer_as_sent_alone(served):
    """EPIC requests with 2, 3 and 4 chunks in different orders, sent together (their heads share
    pre-pass forwards when they land in one batch; the longer ones run more stages), answer what
    they answer one at a time; the pre-pass counters add up to their head spans."""
    procs, _ = served
    server = procs["nemotron-h"]
    pool = [_ids(40, 400 + i) for i in range(4)]
    prefix = _ids(16, 399)
    asks = [(pool[:2], _ids(6, 410)), ([pool[3], pool[1], pool[0]], _ids(7, 411)), (pool[::-1], _ids(5, 412)),
            ([pool[2], pool[0]], _ids(8, 413))]
    sel = "epic-5"
    alone = [ask(server, prefix, chunks, q, selector=sel) for chunks, q in asks]
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    before = [metric_total(text, f"sglang_ext:linearkv_prepass_{name}_total") for name in ("forwards", "heads")]
    with ThreadPoolExecutor(len(asks)) as ex:
        together = list(ex.map(lambda a: ask(server, prefix, a[0], a[1], selector=sel), asks))
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    after = [metric_total(text, f"sglang_ext:linearkv_prepass_{name}_total") for name in ("forwards", "heads")]
    for one, many in zip(alone, together):
        assert _details(many) == _details(one) and _details(one)["chunks_hit"] > 0
        assert many["output_ids"] == one["output_ids"]
        torch.testing.assert_close(torch.tensor(_logprobs(many)), torch.tensor(_logprobs(one)), atol=1e-4, rtol=0)
    assert after[1] - before[1] == sum(len(chunks) for chunks, _ in asks)
    assert 4 <= after[0] - before[0] <= after[1] - before[1]


@pytest.mark.parametrize("selector", ["none", "epic-8"])
def test_long_question_runs_in_prefill_chunks(served, reference_models, selector):
    """A question longer than --chunked-prefill-size (64): the assembled prefix stays the request's
    own across the prefill chunks (EPIC's heads run once, before the first), and the output is
    the reference path's."""
    procs, _ = served
    server = procs["qwen3-next"]
    model, layout = reference_models["qwen3-next"]
    chunks, question = [_ids(CHUNK, 31), _ids(CHUNK, 32)], _ids(150, 33)
    ask(server, [], chunks[::-1], _ids(5, 34))               # registers the chunks elsewhere
    got = ask(server, [], chunks, question, selector=selector)
    assert _details(got)["chunks_hit"] == 2
    entries = [R.register(model, layout, c, transitions=False) for c in chunks]
    ref = R.assemble(model, layout, entries, question, parse_selector(selector), "predecessor")
    ref_ids, ref_lp = R.greedy(model, ref.cache, ref.logits[-1], 2 * CHUNK + 150, NEW)
    assert got["output_ids"] == ref_ids
    torch.testing.assert_close(torch.tensor(_logprobs(got)), torch.tensor(ref_lp), atol=LOGPROB_ATOL, rtol=0)


def test_separator_mode_finds_the_chunks_in_text(served):
    procs, _ = served
    server = procs["qwen3-next"]
    docs = ["the first passage talks about rivers and boats " * 3,
            "a second passage lists mountains and their heights " * 3]
    prompts = [SEP.join(["system prompt here", docs[0], docs[1], "which river?"]),
               SEP.join(["system prompt here", docs[1], docs[0], "which mountain?"])]
    results = [server.generate(text=p, sampling_params={"max_new_tokens": 3, "temperature": 0}) for p in prompts]
    second = results[1]["meta_info"]["cached_tokens_details"]["linearkv"]
    assert second["chunks_hit"] == 2 and second["reused_tokens"] > 0
    # the same request as token spans (segments tokenized one by one) gives the same output
    tok = _tokenizer(procs["qwen3-next"])
    seg = [tok.encode("system prompt here"), *(tok.encode(d, add_special_tokens=False) for d in docs[::-1]),
           tok.encode("which mountain?", add_special_tokens=False)]
    by_spans = ask(server, seg[0], seg[1:3], seg[3], new=3)
    assert by_spans["output_ids"] == results[1]["output_ids"]


def _tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_path)


BAD_FIELDS = [
    ({"chunks": [[0, 10], [12, 20]]}, "custom_params.linearkv.chunks[1]"),
    ({"chunks": [[5, 3]]}, "custom_params.linearkv.chunks[0]"),
    ({"chunks": [[0, 60]]}, "custom_params.linearkv.chunks"),
    ({"chunks": "0-10"}, "custom_params.linearkv.chunks"),
    ({"chunks": [[0, 10]], "state": "packed-last"}, "custom_params.linearkv.state"),
    ({"chunk": [[0, 10]]}, "custom_params.linearkv"),
    ({"register": True}, "custom_params.linearkv.register"),
    ({"chunks": [[0, 10]], "keep_state": False}, "custom_params.linearkv.keep_state"),
    ({"chunks": [[0, 10]], "state": "compose"}, "served for Mamba-2 models only"),
    ({"chunks": [[0, 10]], "selector": "cacheblend-15"}, "custom_params.linearkv.selector"),
    ({"chunks": [[0, 10]], "selector": "epic-x"}, "custom_params.linearkv.selector"),
    ([1, 2], "custom_params.linearkv"),
]


@pytest.mark.parametrize(("value", "field"), BAD_FIELDS)
def test_bad_request_fields_answer_400_naming_the_field(served, value, field):
    procs, _ = served
    server = procs["qwen3-next"]
    resp = requests.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": _ids(60, 5), "sampling_params": {"max_new_tokens": 2, "custom_params": {"linearkv": value}}})
    assert resp.status_code == 400, resp.text
    assert field in resp.text
    assert server.generate(input_ids=_ids(20, 6), sampling_params={"max_new_tokens": 2})["output_ids"]


def test_concurrent_clients_sharing_chunks_under_eviction(served):
    """8 clients x 4 requests over a pool of 8 shared chunks in random orders, half of them with
    EPIC-4 (whose seeds lock their chunks' states until the first forward): the KV pool (3000
    tokens) and the state pool (12 slots) both evict; every request succeeds, chunks are served
    from the cache, and the idle pool check stays clean."""
    procs, _ = served
    server = procs["qwen3-next"]
    pool = [_ids(64, 100 + i) for i in range(8)]
    prefix = _ids(32, 99)
    before = metric_total(requests.get(f"{server.url}/metrics", timeout=30).text, "sglang_ext:linearkv_chunks_hit_total")

    def client(c: int) -> list[dict]:
        rng = random.Random(c)
        out = []
        for r in range(4):
            chunks = rng.sample(pool, 4)
            res = ask(server, prefix, chunks, _ids(6, 1000 * c + r), new=4, selector=rng.choice(["none", "epic-4"]))
            out.append(_details(res))
        return out

    with ThreadPoolExecutor(8) as ex:
        details = [d for ds in ex.map(client, range(8)) for d in ds]
    assert len(details) == 32
    # a fair share is served from the cache; with 8 requests running, at most 4 of the 12 state
    # slots hold chunk states, and an EPIC request needs all 5 of its seeds (P and 4 chunks) resident
    # (one for selector none), so most EPIC requests fall back to a full prefill here
    assert sum(d["chunks_hit"] for d in details) >= 12, details
    after = metric_total(requests.get(f"{server.url}/metrics", timeout=30).text, "sglang_ext:linearkv_chunks_hit_total")
    assert after - before == sum(d["chunks_hit"] for d in details)
    # idle now: a leak would have failed the strict pool check and this request with it
    assert server.generate(input_ids=_ids(30, 7), sampling_params={"max_new_tokens": 2})["output_ids"]
    assert "leak" not in server.log_text().lower()


@pytest.mark.parametrize(("config", "needle"), [
    ({"selector": "cacheblend-15"}, "--linearkv-config key 'selector'"),
    ({"bogus": 1}, "--linearkv-config: unknown key 'bogus'"),
    ({"min_chunk_tokens": 0}, "--linearkv-config key 'min_chunk_tokens'"),
])
def test_bad_config_fails_at_start_naming_the_key(tiny_model_factory, config, needle):
    model = tiny_model_factory("qwen3-next")
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "serve", "--model-path", str(model),
                           "--radix-cache-backend", "linearkv", "--linearkv-config", json.dumps(config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ---- production traffic ----------------------------------------------------------------------


def _post(server, payload: dict, timeout: float = 120) -> requests.Response:
    return requests.post(f"{server.url}/generate", json=payload, timeout=timeout)


def _alive(server) -> None:
    """The server is up and its pools add up: SGLang's strict idle check (on in these servers)
    raises in the scheduler on a leaked KV or state slot, which takes the server down."""
    assert server.proc.poll() is None, server.log_text()[-3000:]
    # greedy, EOS ignored: the server samples with a random seed per start, and a sampled EOS
    # (a random tiny model) would end the answer after one token
    out = server.generate(input_ids=_ids(30, 7),
                          sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 2, out["meta_info"].get("finish_reason")
    assert server.proc.poll() is None


@pytest.mark.parametrize("arch", ARCHS)
def test_truncated_prompt_is_a_plain_prefill_not_a_dead_scheduler(served, arch):
    """The issue's repro: 1,500 ids with chunks up to token 1,400 on a server with
    --allow-auto-truncate and context 1024 killed the scheduler. Now: the prompt is served as a
    plain prefill and meta_info says so; a truncated prompt whose chunks end before the cut is
    served from its chunks."""
    procs, _ = served
    server = procs[arch]
    ids = _ids(1500, 31)
    resp = _post(server, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "custom_params": {"linearkv": {"chunks": [[200, 700], [700, 1400]]}}}})
    assert resp.status_code == 200, resp.text
    details = _details(resp.json())
    assert details["chunks_hit"] == 0 and details["chunks_missed"] == 2 and "fallback" in details, details
    assert details["recomputed_tokens"] <= CONTEXT
    first = [[100, 400], [400, 700]]
    for _ in range(2):   # the second one hits the chunks the first registered
        resp = _post(server, {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "custom_params": {"linearkv": {"chunks": first}}}})
        assert resp.status_code == 200, resp.text
    details = _details(resp.json())
    assert details["chunks_hit"] == 2 and "fallback" not in details, details
    _alive(server)


def _fuzz_request(rng: random.Random, arch: str, pool: list[list[int]], i: int) -> tuple[str, dict]:
    """(kind, /generate payload) of one fuzzed request."""
    kind = rng.choice(["valid", "valid", "bad", "truncate", "logprob", "separator", "abort", "stream", "plain"])
    prefix = _ids(rng.choice([0, 5, 24]), 7000 + i)
    chunks = [rng.choice(pool)[:rng.randint(1, 64)] if rng.random() < 0.7 else _ids(rng.randint(1, 64), 8000 + i)
              for _ in range(rng.randint(1, 4))]
    question = _ids(rng.randint(1, 12), 9000 + i)
    if kind == "truncate":
        chunks.append(_ids(rng.randint(900, 1400), 9500 + i))
    ids, spans = _layout(prefix, chunks)
    ids += question
    linearkv: dict = {"chunks": spans}
    states = ["predecessor", "zero"] + (["compose"] if arch == "nemotron-h" else [])
    if rng.random() < 0.5:
        linearkv["state"] = rng.choice(states)
    if rng.random() < 0.5:
        linearkv["selector"] = rng.choice(["none", "epic", f"epic-{rng.randint(0, 9)}"])
    params: dict = {"max_new_tokens": rng.randint(1, 4), "temperature": 0}
    payload: dict = {"input_ids": ids, "sampling_params": params}
    if kind == "bad":
        bad = [[[0, 5], [3, 9]], [[0, len(ids)]], [[-1, 4]], [[0, 2.5]], [["a", 3]], [], [[0, 4], [6, 9]],
               [[0, 10 ** 9]], [[4, 4]], {"0": 3}]
        linearkv["chunks"] = rng.choice(bad)
    elif kind == "logprob":
        payload.update(return_logprob=True, logprob_start_len=rng.randrange(0, len(ids)))
    elif kind == "separator":
        words = ["alpha", "beta", "gamma", "delta", "river", "stone"]
        parts = [" ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(rng.randint(3, 5))]
        payload = {"text": SEP.join(parts), "sampling_params": params}
        linearkv = {"separator": SEP} if arch == "nemotron-h" else {}
    elif kind == "abort":
        payload["rid"] = f"fuzz-{arch}-{i}"
    elif kind == "stream":
        payload["stream"] = True
    if kind != "plain" and linearkv:
        params["custom_params"] = {"linearkv": linearkv}
    return kind, payload


def _send_fuzzed(server, kind: str, payload: dict, rng: random.Random) -> tuple[str, int, str]:
    if kind == "abort":
        delay = rng.uniform(0, 0.3)

        def abort() -> None:
            time.sleep(delay)
            requests.post(f"{server.url}/abort_request", json={"rid": payload["rid"]}, timeout=30)

        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(abort)
            resp = _post(server, payload)
            fut.result()
        return kind, resp.status_code, resp.text[:300]
    if kind == "stream":   # the client goes away after the first event
        with requests.post(f"{server.url}/generate", json=payload, timeout=120, stream=True) as resp:
            next(resp.iter_lines(), None)
            return kind, resp.status_code, ""
    resp = _post(server, payload)
    return kind, resp.status_code, resp.text[:300]


@pytest.mark.parametrize("arch", ARCHS)
def test_fuzzed_requests_leave_the_server_up_and_the_pools_clean(served, arch):
    """48 seeded random requests, 6 at a time: valid chunk layouts (shared and new chunks, tiny
    ones joined, every state rule and selector), malformed spans, prompts cut by
    --allow-auto-truncate, input logprobs from anywhere, separator prompts, aborts at random
    moments (registration, assembly, forward) and streams dropped after their first event. Every
    answer is a 200 or a 400 naming the field (aborted ones: whatever SGLang answers an abort);
    afterwards the server is up and SGLang's strict idle pool check is clean."""
    procs, _ = served
    server = procs[arch]
    rng = random.Random(ARCHS.index(arch))
    pool = [_ids(64, 600 + j) for j in range(5)]
    jobs = [(*_fuzz_request(rng, arch, pool, i), random.Random(i)) for i in range(48)]
    with ThreadPoolExecutor(6) as ex:
        answers = list(ex.map(lambda job: _send_fuzzed(server, *job), jobs))
    for kind, status, text in answers:
        if kind == "bad":
            assert status == 400 and "custom_params.linearkv" in text, (kind, status, text)
        elif kind != "abort":
            assert status == 200, (kind, status, text)
    time.sleep(1.0)   # idle: the strict pool check runs
    _alive(server)
    assert "Traceback" not in server.log_text(), server.log_text()[-4000:]


def test_tenants_do_not_share_chunks(served):
    """Chunks are registered per tenant (`extra_key`, cache salt), as SGLang keys its own prefix
    cache: another tenant's identical request registers its chunks afresh (a cold request's
    cached tokens), its own second request reuses them."""
    procs, _ = served
    server = procs["qwen3-next"]
    chunks, question = [_ids(CHUNK, 4100), _ids(CHUNK, 4101)], _ids(5, 4102)

    def cached(**tenant) -> float:
        def total() -> float:
            return metric_total(requests.get(f"{server.url}/metrics", timeout=30).text, "sglang:cached_tokens_total")
        before = total()
        ask(server, _ids(16, 4103), chunks, question, **tenant)
        time.sleep(0.3)
        return total() - before

    cold, warm = cached(extra_key="tenant-a"), cached(extra_key="tenant-a")
    assert warm > cold
    assert cached(extra_key="tenant-b") == cold
    assert cached(extra_key="tenant-b") == warm
    assert cached(extra_key="tenant-b", cache_salt="salt-1") == cold
    resp = _post(server, {"input_ids": _ids(40, 4104), "extra_key": "linearkv-chunk:x", "sampling_params": {
        "max_new_tokens": 1, "custom_params": {"linearkv": {"chunks": [[0, 20]]}}}})
    assert resp.status_code == 400 and "extra_key" in resp.text
    # a batch of plain prompts may not write into a chunk namespace either
    resp = _post(server, {"input_ids": [_ids(40, 4105), _ids(40, 4106)], "extra_key": "linearkv-chunk:x",
                          "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 400 and "extra_key" in resp.text


@pytest.mark.parametrize("arch", ARCHS)
def test_request_fields_and_meta_info_cross_both_ipc_modes(served, arch):
    """Nested custom_params (chunk spans, a Tail-Replay override) reach the scheduler and nested
    summaries come back as objects under pickle IPC (GDN server) and msgpack IPC (Mamba-2 server,
    where SGLang's typed decoding refused them and took the scheduler down)."""
    procs, _ = served
    server = procs[arch]
    got = ask(server, _ids(12, 4300), [_ids(20, 4301), _ids(20, 4302)], _ids(4, 4303),
              custom_extra={"tail_replay": {"budget": 0.5}})
    details = got["meta_info"]["cached_tokens_details"]
    assert isinstance(details["linearkv"], dict) and details["linearkv"]["chunks_hit"] == 2, details
    plain = server.generate(input_ids=_ids(40, 4304), sampling_params={"max_new_tokens": 2})
    again = server.generate(input_ids=_ids(40, 4304)[:30] + [7, 8], sampling_params={"max_new_tokens": 2})
    assert plain["output_ids"] and isinstance(again["meta_info"]["cached_tokens_details"]["tail_replay"], dict)
    _alive(server)


def test_kv_only_rules_register_no_chunk_state(served):
    """A `replay` request's registrations keep only the chunks' KV (no state slot): a later
    `predecessor` request with the same chunks registers them again (a cold request's cached
    tokens) and adds their states; a `replay` request after it hits them without re-registering."""
    procs, _ = served
    server = procs["nemotron-h"]

    calls = iter(range(4210, 4300))

    def cached(chunks, state) -> float:   # a new P each time: only the chunks' registrations differ
        def total() -> float:
            return metric_total(requests.get(f"{server.url}/metrics", timeout=30).text, "sglang:cached_tokens_total")
        before = total()
        assert _details(ask(server, _ids(16, next(calls)), chunks, _ids(5, 4201), state=state))["chunks_hit"] == 2
        time.sleep(0.3)
        return total() - before

    seen, fresh = [_ids(CHUNK, 4202), _ids(CHUNK, 4203)], [_ids(CHUNK, 4204), _ids(CHUNK, 4205)]
    replay_cold = cached(seen, "replay-16")
    cold = cached(fresh, "predecessor")
    assert cached(seen, "predecessor") == cold        # the KV-only chunks were registered again
    warm = cached(seen, "predecessor")
    assert warm > cold
    # chunks with states serve KV-only rules too: the registrations hit, as the predecessor ones did
    assert cached(seen, "replay-16") - replay_cold == warm - cold


def test_kv_events_leave_chunk_registrations_out(served):
    """A router fed by the worker's KV events (`--kv-events-config`) must not see chunk
    registrations as prompt prefixes: the stored blocks hold the request's P (tokens below 100
    here) and never a chunk's tokens (100..199), which sit only in the chunk namespace."""
    import msgspec
    import zmq

    procs, _ = served
    server = procs["nemotron-h"]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{server.events_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(1.0)   # the subscription reaches the publisher
        rng = random.Random(5)
        prefix = [rng.randrange(10, 100) for _ in range(40)]
        chunks = [[rng.randrange(100, 200) for _ in range(CHUNK)] for _ in range(2)]
        ask(server, prefix, chunks, [rng.randrange(200, 300) for _ in range(5)])
        ask(server, prefix, chunks[::-1], [rng.randrange(200, 300) for _ in range(5)])
        stored: list[int] = []
        while sub.poll(2000):   # every event the two requests caused, until 2 s of silence
            _, _, payload = sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload)
            stored += [t for event in batch[1] if event.get("type") == "BlockStored" for t in event["token_ids"]]
    finally:
        sub.close(0)
    assert set(prefix) <= set(stored), "P's blocks were published"
    assert not [t for t in stored if 100 <= t < 200], "a chunk registration was published"


def test_a_plain_exact_request_over_assembled_tokens_reads_no_chunk_kv(served):
    """(extra_buffer) An assembled request's context-free chunk KV, question KV
    and output are not exact; they must never come back as exact KV of the plain prompt. After a
    two-chunk request, the same token ids sent plainly with `exactness: "exact"` reuse at most P
    and answer as a server without cache does."""
    procs, _ = served
    server = procs["qwen3-next"]
    rng = random.Random(43)
    prefix = [rng.randrange(10, 100) for _ in range(16)]
    chunks = [[rng.randrange(100, 200) for _ in range(CHUNK)] for _ in range(2)]
    question = [rng.randrange(200, 300) for _ in range(40)]
    assert _details(ask(server, prefix, chunks, question))["chunks_hit"] == 2   # assembled
    ids = _layout(prefix, chunks)[0] + question
    plain = server.generate(input_ids=ids, return_logprob=True, sampling_params={
        "max_new_tokens": NEW, "temperature": 0,
        "custom_params": {"tail_replay": {"exactness": "exact", "budget": 1.0}}})
    read = plain["meta_info"]["cached_tokens_details"]["tail_replay"]
    assert read["matched_tokens"] <= len(prefix) and plain["meta_info"]["cached_tokens"] <= len(prefix), read
    assert _logprobs(plain) == pytest.approx(_logprobs(full(server, ids)), abs=LOGPROB_ATOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_rounds_full_of_loads_and_plain_requests_keep_the_state_pool(served, arch):
    """24 requests at once, EPIC-4 requests over shared chunks (each load takes
    its state slots, under extra_buffer its ping-pong slots too, and keeps 5 chunk states locked
    until its first forward) among plain prompts and fresh registrations, so admission rounds fill
    the state pool: every request answers, and afterwards the pools add up (SGLang's strict idle
    check) and the scheduler is up."""
    procs, _ = served
    server = procs[arch]
    pool = [_ids(40, 700 + i) for i in range(4)]
    prefix = _ids(16, 699)
    assert _details(ask(server, prefix, pool, _ids(4, 698), selector="epic-4"))["chunks_hit"] == 4

    def one(i: int) -> dict:
        rng = random.Random(i)
        if i % 3 == 0:
            return server.generate(input_ids=_ids(120, 7100 + i), sampling_params={"max_new_tokens": 4})
        if i % 3 == 1:
            return ask(server, prefix, rng.sample(pool, 4), _ids(6, 7200 + i), new=4, selector="epic-4")
        return ask(server, _ids(8, 7300 + i), [_ids(40, 7400 + i), rng.choice(pool)], _ids(6, 7500 + i), new=4)

    with ThreadPoolExecutor(24) as ex:
        answers = list(ex.map(one, range(24)))
    assert all(a["output_ids"] for a in answers)
    time.sleep(1.0)   # idle: the strict pool check runs
    _alive(server)
    assert "Traceback" not in server.log_text(), server.log_text()[-4000:]


STORED = "sglang_ext:tail_replay_stored_bound_bucket"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunk_registrations_are_stored_as_exact(served, arch):
    """A chunk registration is prefilled from scratch at position 0 of its namespace: its KV and
    end state are exact and enter the tree with bound 0, not as UNTRACKED (+Inf stored bounds,
    never exact, first to go under `state_order: approximate_first`). Chunks at offset 0 (no P):
    the assembled request itself inserts nothing, so only the registrations are stored."""
    procs, _ = served
    server = procs[arch]

    def stored() -> tuple[float, float]:
        text = requests.get(f"{server.url}/metrics", timeout=30).text
        exact = metric_total(text, STORED, 'le="0.0"')
        return exact, metric_total(text, STORED, 'le="+Inf"') - metric_total(text, STORED, 'le="1.0"')

    exact_before, untracked_before = stored()
    rng = random.Random(4300 + ARCHS.index(arch))
    chunks = [[rng.randrange(100, 200) for _ in range(CHUNK)] for _ in range(2)]
    assert _details(ask(server, [], chunks, _ids(5, 4310)))["chunks_hit"] == 2
    time.sleep(0.3)
    exact_after, untracked_after = stored()
    assert exact_after - exact_before >= 2, "each registration stores its chunk's KV, exact"
    assert untracked_after == untracked_before, "a registration was stored with an unknown (infinite) bound"


EXACT = {"tail_replay": {"exactness": "exact"}}


def _label(result) -> dict:
    return result["meta_info"]["cached_tokens_details"]["tail_replay"]


def test_a_request_with_chunks_asking_exact_is_served_exactly(served):
    """Assembled chunk KV is context-free, never exact. After a request registered two chunks,
    the same chunks sent with `exactness: "exact"` (reordered, and in the registered order) are
    served as a plain prefill: their output logprobs equal a full recompute's, meta_info says
    `exact` and `kv_exact` and why the chunks missed; the assembled request itself says
    `exact: false, kind: "assembled"`. In separator mode an exact request's text is not split."""
    from sglang_ext.linearkv.serving import EXACT_FALLBACK

    procs, _ = served
    server = procs["qwen3-next"]   # extra_buffer, overlap scheduler
    rng = random.Random(51)
    prefix = [rng.randrange(10, 100) for _ in range(20)]
    chunks = [[rng.randrange(100, 200) for _ in range(120)] for _ in range(2)]
    assembled = ask(server, prefix, chunks, _ids(30, 5100))
    assert _details(assembled)["chunks_hit"] == 2
    assert _label(assembled) == {"kind": "assembled", "exact": False, "kv_exact": False, "bound": None}
    for order, seed in ((chunks[::-1], 5101), (chunks, 5102)):
        question = _ids(30, seed)
        exact = ask(server, prefix, order, question, custom_extra=EXACT)
        details, label = _details(exact), _label(exact)
        assert details["chunks_hit"] == 0 and details["chunks_missed"] == 2 and details["fallback"] == EXACT_FALLBACK
        assert label["exact"] is True and label["kv_exact"] is True and label["bound"] == 0.0, label
        assert exact["meta_info"]["cached_tokens"] <= len(prefix), exact["meta_info"]
        reference = full(server, _layout(prefix, order)[0] + question)
        assert _logprobs(exact) == pytest.approx(_logprobs(reference), abs=1e-4)
    text = SEP.join(["a system prompt", "a passage about rivers " * 4, "a passage about hills " * 4, "which?"])
    for custom, split in ((EXACT, False), (None, True)):
        result = server.generate(text=text, sampling_params={"max_new_tokens": 2, "temperature": 0,
                                                             "custom_params": custom})
        details = result["meta_info"]["cached_tokens_details"]
        assert ("linearkv" in details) is split, details
        if not split:   # the separators were read as sent
            assert result["meta_info"]["prompt_tokens"] == len(_tokenizer(server).encode(text))
            assert _label(result)["exact"] is True
