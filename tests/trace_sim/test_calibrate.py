"""calibrate.py against a fake /generate endpoint that follows a known cost model."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eval.trace_sim import calibrate
from eval.trace_sim.cost_model import load_cost_model

A, B = 0.02, 1e-5
SIMULATED = {"seconds": 0.0}  # the fake server's busy time, read as the client's clock


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _FakeServer(BaseHTTPRequestHandler):
    cached: list = []

    def do_POST(self):  # noqa: N802 (http.server API)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
        if self.path == "/flush_cache":
            _FakeServer.cached = []
            return self._reply({})
        ids = tuple(json.loads(body)["input_ids"])
        hit = max((_common_prefix(ids, seq) for seq in _FakeServer.cached), default=0)
        SIMULATED["seconds"] += A + B * (len(ids) - hit)
        _FakeServer.cached.append(ids)
        self._reply({"meta_info": {"cached_tokens": hit, "prompt_tokens": len(ids)}})

    def _reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_calibrate_measures_cached_prefix_and_fits(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = tmp_path / "cost.json"
        calibrate.main(["--url", url, "--out", str(out), "--prefixes", "0,200", "--news", "100,2000",
                        "--repeats", "1"], clock=lambda: SIMULATED["seconds"])
    finally:
        server.shutdown()
    data = json.loads(out.read_text())
    assert data["source"].startswith("measured via")
    assert {p["cached_tokens"] for p in data["points"]} == {0, 200}
    model = load_cost_model(out)
    assert (model.a, model.b, model.c) == pytest.approx((A, B, 0.0), abs=1e-9)
