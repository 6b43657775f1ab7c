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
  slot kills the scheduler and fails every later request).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import requests
import torch

from eval.harness import ServerProcess, start_servers, stop_servers
from eval.reference import load_reference_model
from sglang_ext.linearkv import parse_selector
from sglang_ext.linearkv import reference as R
from tests.e2e.serving import metric_total

ARCHS = ("qwen3-next", "nemotron-h")
KV_TOKENS = 3000
STATE_SLOTS = 12
CHUNK = 48
NEW = 5
LOGPROB_ATOL = 1e-3
SEP = " # # "


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("linearkv_logs")
    models = {arch: tiny_model_factory(arch) for arch in ARCHS}
    procs = {arch: ServerProcess(str(models[arch]), [
        "--dtype", "float32", "--radix-cache-backend", "linearkv", "--enable-metrics",
        "--linearkv-config", json.dumps({"min_chunk_tokens": 8, "separator": SEP}),
        "--chunked-prefill-size", "64", "--max-total-tokens", str(KV_TOKENS),
        "--max-mamba-cache-size", str(STATE_SLOTS), "--mem-fraction-static", "0.5"],
        log_path=logs / f"{arch}.log") for arch in ARCHS}
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


def ask(server, prefix, chunks, question, new=NEW, state=None, selector=None, **extra):
    ids, spans = _layout(prefix, chunks)
    linearkv = {"chunks": spans, **({"state": state} if state else {}), **({"selector": selector} if selector else {})}
    return server.generate(input_ids=ids + question, return_logprob=True, **extra, sampling_params={
        "max_new_tokens": new, "temperature": 0, "custom_params": {"linearkv": linearkv}})


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


@pytest.fixture(scope="module")
def reference_models(served):
    _, models = served
    torch.manual_seed(0)
    out = {}
    for arch in ARCHS:
        model = load_reference_model(models[arch])
        out[arch] = (model, R.model_layout(model, model_id=f"tiny-{arch}"))
    return out


@pytest.mark.parametrize(("arch", "state"), [(arch, state) for arch in ARCHS for state in ("predecessor", "zero")]
                         + [("nemotron-h", "compose")])
def test_reordered_chunks_after_a_cached_prefix_match_the_reference_path(served, reference_models, arch, state):
    procs, _ = served
    server = procs[arch]
    model, layout = reference_models[arch]
    seed = {"predecessor": 10, "zero": 20, "compose": 40}[state]
    prefix = _ids(24, seed)
    chunks = [_ids(CHUNK, seed + 1), _ids(CHUNK - 5, seed + 2), _ids(CHUNK + 11, seed + 3)]
    question = _ids(12, seed + 4)
    order = [chunks[2], chunks[0], chunks[1]]
    first = ask(server, prefix, chunks, question, state=state)   # registers P and the chunks
    # P is in no radix-tree path yet: its own registration at offset 0 serves its exact KV
    assert _details(first)["chunks_hit"] == 3, _details(first)
    got = ask(server, prefix, order, question, state=state)
    details = _details(got)
    assert details["chunks_hit"] == 3 and details["chunks_missed"] == 0
    assert details["reused_tokens"] == sum(map(len, chunks)) and details["state_source"] == state
    assert details["recomputed_tokens"] == len(question)

    entries = [R.register(model, layout, c, transitions=state == "compose") for c in order]
    ref = R.assemble(model, layout, entries, question, parse_selector("none"), state, prefix_ids=prefix)
    n = len(prefix) + sum(map(len, chunks)) + len(question)
    ref_ids, ref_lp = R.greedy(model, ref.cache, ref.logits[-1], n, NEW)
    assert got["output_ids"] == ref_ids
    torch.testing.assert_close(torch.tensor(_logprobs(got)), torch.tensor(ref_lp), atol=LOGPROB_ATOL, rtol=0)


EPIC_K = 12


@pytest.mark.parametrize(("arch", "state"), [(arch, state) for arch in ARCHS for state in ("predecessor", "zero")]
                         + [("nemotron-h", "compose")])
def test_epic_heads_recomputed_in_context_match_the_reference_path(served, reference_models, arch, state):
    """EPIC-12 (a chunk shorter than k is recomputed whole): the heads run in the worker's
    pre-pass, each from the state rule's seed, before the question; the output is the reference
    path's `assemble(..., epic-12, state)`."""
    procs, _ = served
    server = procs[arch]
    model, layout = reference_models[arch]
    seed = {"predecessor": 50, "zero": 60, "compose": 70}[state]
    prefix = _ids(20, seed)
    chunks = [_ids(CHUNK, seed + 1), _ids(9, seed + 2), _ids(CHUNK + 11, seed + 3)]
    question = _ids(10, seed + 4)
    selector = f"epic-{EPIC_K}"
    ask(server, prefix, chunks[::-1], _ids(4, seed + 5), state=state, selector=selector)   # registers
    got = ask(server, prefix, chunks, question, state=state, selector=selector)
    heads = EPIC_K + 9 + EPIC_K
    assert _details(got) == {"chunks_hit": 3, "chunks_missed": 0, "reused_tokens": sum(map(len, chunks)) - heads,
                             "recomputed_tokens": len(question) + heads, "state_source": state,
                             "selector": selector}

    entries = [R.register(model, layout, c, transitions=state == "compose") for c in chunks]
    ref = R.assemble(model, layout, entries, question, parse_selector(selector), state, prefix_ids=prefix)
    n = len(prefix) + sum(map(len, chunks)) + len(question)
    ref_ids, ref_lp = R.greedy(model, ref.cache, ref.logits[-1], n, NEW)
    assert got["output_ids"] == ref_ids
    torch.testing.assert_close(torch.tensor(_logprobs(got)), torch.tensor(ref_lp), atol=LOGPROB_ATOL, rtol=0)
    if state != "zero":
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
