"""The streaming client and the concurrency limit, against a small local HTTP server that speaks
SGLang's streaming /generate format (SSE `data:` lines, `[DONE]`)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eval.replay.client import replay_requests
from eval.replay.servers import flush_cache, stream_generate
from eval.replay.tokens import ScaledRequest


class _Handler(BaseHTTPRequestHandler):
    in_flight = 0
    max_in_flight = 0
    arrivals: list[int] = []    # first input id of each /generate, in the order the server read them
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    flush_refusals = 0
    flushes = 0

    def do_POST(self):
        if self.path == "/flush_cache":     # SGLang refuses while a request is still queued
            _Handler.flushes += 1
            ok = _Handler.flushes > _Handler.flush_refusals
            self.send_response(200 if ok else 400)
            self.end_headers()
            self.wfile.write(b"Cache flushed." if ok else b"Flush cache failed.")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = body["input_ids"]
        with _Handler.lock:
            _Handler.arrivals.append(ids[0])
        if ids[0] == 0:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad input_ids"}')
            return
        with _Handler.lock:
            _Handler.in_flight += 1
            _Handler.max_in_flight = max(_Handler.max_in_flight, _Handler.in_flight)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["sampling_params"]["max_new_tokens"]
            for k in range(n):
                time.sleep(0.05)
                meta = {"prompt_tokens": len(ids), "cached_tokens": len(ids) // 2,
                        "cached_tokens_details": {"device": len(ids) // 2, "host": 0}}
                chunk = {"output_ids": list(range(k + 1)), "meta_info": meta}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            with _Handler.lock:
                _Handler.in_flight -= 1


@pytest.fixture()
def fake_server():
    _Handler.in_flight = _Handler.max_in_flight = _Handler.flushes = _Handler.flush_refusals = 0
    _Handler.arrivals = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_stream_generate_measures_first_token_and_keeps_last_meta(fake_server):
    resp = stream_generate(fake_server, [5, 6, 7, 8], new_tokens=3)
    assert resp.ok and resp.meta_info["cached_tokens"] == 2 and resp.output_ids == (0, 1, 2)
    assert 0.04 < resp.ttft_s < resp.latency_s and resp.latency_s > 0.14
    bad = stream_generate(fake_server, [0, 1], new_tokens=1)
    assert not bad.ok and "HTTP 400" in bad.error and "bad input_ids" in bad.error
    down = stream_generate("http://127.0.0.1:9", [5], new_tokens=1, timeout_s=2)
    assert not down.ok and "ConnectionError" in down.error


def test_concurrency_limit_and_record_order(fake_server):
    reqs = [ScaledRequest(i, float(i), -1, 1, (i + 1,) * (i + 2)) for i in range(9)]
    reqs[4] = ScaledRequest(4, 4.0, -1, 1, (0, 0))   # this one fails with HTTP 400
    records, wall = replay_requests(fake_server, reqs, new_tokens=2, concurrency=3, desc="t")
    assert [r["index"] for r in records] == list(range(9))
    assert 2 <= _Handler.max_in_flight <= 3
    assert [r["ok"] for r in records].count(False) == 1 and not records[4]["ok"]
    assert records[4]["cached_tokens"] == 0 and records[4]["ttft_s"] is None
    assert records[8]["prompt_tokens"] == 10 and records[8]["cached_tokens"] == 5
    assert wall < 9 * 0.1   # overlapped, not one at a time
    # they reached the server in the trace's order, the refused one included
    assert _Handler.arrivals == [i + 1 if i != 4 else 0 for i in range(9)]


def test_requests_sent_together_arrive_in_order(fake_server):
    """Eight threads start at once; each request waits until the server accepted the one before."""
    reqs = [ScaledRequest(i, 0.0, i, 1, (i + 1,) * 64) for i in range(24)]
    records, _ = replay_requests(fake_server, reqs, new_tokens=1, concurrency=8, desc="t")
    assert all(r["ok"] for r in records) and _Handler.max_in_flight >= 2
    assert _Handler.arrivals == [i + 1 for i in range(24)]


def test_flush_cache_retries_while_the_server_refuses_then_names_the_refusal(fake_server):
    _Handler.flush_refusals = 2
    flush_cache(fake_server)
    assert _Handler.flushes == 3
    _Handler.flushes, _Handler.flush_refusals = 0, 10**6
    with pytest.raises(RuntimeError, match=r"flush_cache refused \(400\) for 0.5 s: Flush cache failed"):
        flush_cache(fake_server, wait_s=0.5)
    assert _Handler.flushes >= 2


def test_an_open_loop_replay_sends_on_the_seeded_schedule_and_counts_from_it(fake_server):
    from eval.replay.goodput import arrivals_at, unit_gaps
    from eval.replay.runner import open_loop_goodput

    reqs = [ScaledRequest(i, 0.0, i, 1, (i + 1,) * 8) for i in range(12)]
    records, wall = replay_requests(fake_server, reqs, new_tokens=1, concurrency=1, desc="t", rate=40.0, seed=5)
    schedule = arrivals_at(unit_gaps(12, 5), 40.0)
    assert all(r["ok"] for r in records) and wall >= schedule[-1]
    assert _Handler.max_in_flight >= 2                 # open loop: not held to --concurrency 1
    assert _Handler.arrivals == [i + 1 for i in range(12)]
    assert all(0.0 <= r["send_lag_s"] < 0.5 and r["ttft_s"] >= 0.05 for r in records)
    goodput = open_loop_goodput(records, 40.0, slo_s=1.0)
    assert goodput["share_within_slo"] == 1.0 and goodput["goodput_per_s"] == 40.0
    records[0]["ok"] = False
    assert open_loop_goodput(records, 40.0, slo_s=1.0)["share_within_slo"] == 11 / 12
    assert open_loop_goodput(records, None, slo_s=1.0) is None
