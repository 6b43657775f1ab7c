"""eval.harness helpers that need no server."""

from __future__ import annotations

import os
import signal
import time

import pytest

from eval.harness import sigterm_deferred, sigterm_unwinds


def test_sigterm_unwinds_through_finally_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    stopped = []
    with pytest.raises(SystemExit) as exit_info:
        with sigterm_unwinds():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                stopped.append("servers")
    assert exit_info.value.code == 143 and stopped == ["servers"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_during_cleanup_waits_for_it_then_exits():
    before = signal.getsignal(signal.SIGTERM)
    steps = []
    with pytest.raises(SystemExit) as exit_info:
        with sigterm_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            steps.append("first server stopped")
            steps.append("second server stopped")
    assert exit_info.value.code == 143 and steps == ["first server stopped", "second server stopped"]
    assert signal.getsignal(signal.SIGTERM) is before


FAKE_SERVER = r'''
import http.server, sys, time
port = int(sys.argv[1])
if sys.argv[2] == "taken":
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): address already in use",
          flush=True)
    time.sleep(600)   # uvicorn then hangs in shutdown, as SGLang's server did
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def test_a_server_whose_port_was_taken_is_relaunched_on_a_fresh_port(tmp_path):
    """The port picked by free_port() can be taken (by another server's internal port) before the
    server binds it: the harness sees the bind error in the log and relaunches on a fresh port,
    instead of waiting out the start-up timeout."""
    import sys

    from eval.harness import ServerProcess

    class Fake(ServerProcess):
        launches: list[int] = []

        def command(self):
            self.launches.append(self.port)
            return [sys.executable, "-c", FAKE_SERVER, str(self.port), "taken" if len(self.launches) == 1 else "ok"]

    server = Fake("unused", log_path=tmp_path / "fake.log")
    started = time.monotonic()
    try:
        server.start(timeout_s=60)
        assert len(Fake.launches) == 2 and Fake.launches[0] != Fake.launches[1]
        assert server.port == Fake.launches[1]
        assert time.monotonic() - started < 30
    finally:
        server.stop()
