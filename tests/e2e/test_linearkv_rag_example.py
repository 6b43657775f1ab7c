"""docs/examples/linearkv_rag.py (SGLang frontend language, `run_batch`) against a live linearkv
server (tiny Qwen3-Next, server-wide separator): later programs are served from the chunk cache,
the separator mode gives the same answer as the same prompt sent as token ids with chunk spans,
and /metrics counts the hits the programs' meta_info reports; on the same server, a chunk request
asking for input logprobs from inside its chunks is served as a plain prompt (it crashed the
scheduler before). One server for the module.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import requests
from transformers import AutoTokenizer

from eval.harness import ServerProcess
from tests.e2e.serving import metric_total

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "linearkv_rag.py"
K = 3


def _example():
    spec = importlib.util.spec_from_file_location("linearkv_rag_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # its dataclasses resolve their module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory, example):
    model = tiny_model_factory("qwen3-next")
    config = {"separator": example.SEPARATOR, "state": "predecessor"}
    args = ["--dtype", "float32", "--radix-cache-backend", "linearkv", "--linearkv-config", json.dumps(config),
            "--max-running-requests", "4", "--enable-metrics"]
    log = tmp_path_factory.mktemp("linearkv_rag") / "server.log"
    with ServerProcess(str(model), args, log_path=log) as server:
        results = example.run(server.url, rounds=2, k=K, num_threads=4, max_tokens=8)
        yield server, model, results, _metrics_after(server, sum(r.linearkv["chunks_hit"] for r in results))


def _metrics_after(server: ServerProcess, hits: int) -> str:
    """/metrics once the counters include `hits` chunk hits (a request is counted when its row is
    released, just after its reply), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        text = requests.get(f"{server.url}/metrics", timeout=30).text
        if metric_total(text, "sglang_ext:linearkv_chunks_hit_total") >= hits or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def test_later_programs_hit_every_passage(served, example):
    server, model, results, _ = served
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    assert len(results) == 2 * len(example.QUESTIONS)
    second = [r for r in results if r.round == 1]
    for res in second:
        lkv = res.linearkv
        question = "Question: " + res.question + "\nAnswer:"
        assert lkv["chunks_hit"] == K and lkv["chunks_missed"] == 0, (res.question, lkv)
        assert lkv["reused_tokens"] == sum(len(_ids(tokenizer, p, False)) for p in res.passages), lkv
        assert lkv["recomputed_tokens"] == len(_ids(tokenizer, question, False)), lkv
        assert lkv["state_source"] == "predecessor"
    # every program declared K chunks: each was either served from the cache or missed
    for res in results:
        assert res.linearkv["chunks_hit"] + res.linearkv["chunks_missed"] == K, res.linearkv


def test_separator_mode_equals_token_spans(served, example):
    """The frontend's text prompt and the same prompt as input_ids + chunk spans give one answer."""
    server, model, results, _ = served
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    res = next(r for r in results if r.round == 1)
    ids, spans = _spans_request(tokenizer, example, res)
    out = server.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                          "custom_params": {"linearkv": {"chunks": spans}}})
    assert out["meta_info"]["cached_tokens_details"]["linearkv"]["chunks_hit"] == K
    assert out["text"] == res.answer


def _spans_request(tokenizer, example, res):
    segments = [_ids(tokenizer, example.SYSTEM, True)] + [_ids(tokenizer, p, False) for p in res.passages] \
        + [_ids(tokenizer, "Question: " + res.question + "\nAnswer:", False)]
    ids, spans, pos = [t for seg in segments for t in seg], [], len(segments[0])
    for seg in segments[1:-1]:
        spans.append([pos, pos + len(seg)])
        pos += len(seg)
    return ids, spans


def test_input_logprobs_inside_the_chunks_are_a_full_prefill(served, example):
    """SGLang caps the prefix match at logprob_start_len; chunks behind the cap cannot be reused,
    so the request runs as a plain prompt: 200, every input logprob, those of a full prefill."""
    server, model, results, _ = served
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids, spans = _spans_request(tokenizer, example, results[-1])
    sampling = {"max_new_tokens": 2, "temperature": 0}
    got = server.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                          sampling_params={**sampling, "custom_params": {"linearkv": {"chunks": spans}}})
    full = server.generate(input_ids=ids, return_logprob=True, logprob_start_len=0, sampling_params=sampling)
    lkv = got["meta_info"]["cached_tokens_details"]["linearkv"]
    assert lkv["chunks_hit"] == 0 and lkv["chunks_missed"] == K, lkv
    assert lkv["recomputed_tokens"] == len(ids) and lkv["reused_tokens"] == 0, lkv   # the whole prompt ran
    lp = [x[0] for x in got["meta_info"]["input_token_logprobs"]]
    ref = [x[0] for x in full["meta_info"]["input_token_logprobs"]]
    assert len(lp) == len(ids) and lp[0] is None
    assert max(abs(a - b) for a, b in zip(lp[1:], ref[1:])) < 1e-4
    assert got["output_ids"] == full["output_ids"]


def test_metrics_count_the_programs_hits(served):
    _, _, results, text = served
    assert metric_total(text, "sglang_ext:linearkv_chunks_hit_total") == sum(r.linearkv["chunks_hit"] for r in results)
    assert metric_total(text, "sglang_ext:linearkv_chunks_missed_total") == \
        sum(r.linearkv["chunks_missed"] for r in results)
    assert metric_total(text, "sglang_ext:linearkv_reused_tokens_total") == \
        sum(r.linearkv["reused_tokens"] for r in results)
