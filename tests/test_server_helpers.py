"""eval.harness helpers that need no server."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time

import pytest

from eval.harness import QUIET_STOP_ENV, ServerProcess, sigterm_deferred, sigterm_unwinds, stop_servers


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


def test_a_port_another_server_answers_on_is_not_taken_for_this_one(tmp_path):
    """Another server started beside this one can take its port and answer /health_generate there
    before this one binds (its own log still says nothing): the harness asks which process
    listens, and relaunches on a fresh port instead of serving the caller from the other server."""
    import subprocess

    from sglang_ext.cluster import free_port, listens_on

    port = free_port()
    other = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(port), "ok"])

    class Fake(ServerProcess):
        launches: list[int] = []

        def command(self):   # the first launch only sleeps (its bind would fail); then a server
            self.launches.append(self.port)
            if len(self.launches) == 1:
                return [sys.executable, "-c", "import time; time.sleep(60)"]
            return [sys.executable, "-c", FAKE_SERVER, str(self.port), "ok"]

    server = Fake("unused", log_path=tmp_path / "fake.log", port=port)
    try:
        deadline = time.monotonic() + 30
        while not listens_on(other.pid, port):
            assert time.monotonic() < deadline, "the other server did not start"
            time.sleep(0.05)
        server.start(timeout_s=60)
        assert Fake.launches[0] == port and server.port != port and len(Fake.launches) == 2
        assert listens_on(server.proc.pid, server.port) and not listens_on(server.proc.pid, port)
    finally:
        server.stop()
        other.kill()
        other.wait()


class _Sleeper(ServerProcess):
    """A stand-in server: a Python process that records its environment, then sleeps (ignoring
    SIGTERM when asked), in its own process group like a real one."""

    def __init__(self, out, ignore_term=False):
        super().__init__("unused", env={"SLEEPER_OUT": str(out)})
        self.ignore_term = ignore_term

    def command(self) -> list[str]:
        code = ("import json, os, signal, sys, time\n"
                "json.dump(dict(os.environ), open(os.environ['SLEEPER_OUT'], 'w'))\n"
                + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if self.ignore_term else "")
                + "time.sleep(60)\n")
        return [sys.executable, "-c", code]


def _wait_for(path):
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_stop_servers_ends_every_group_and_servers_start_without_crash_diagnostics(tmp_path):
    servers = [_Sleeper(tmp_path / "a.json"), _Sleeper(tmp_path / "b.json", ignore_term=True)]
    for server in servers:
        server.launch()
    envs = [_wait_for(tmp_path / name) for name in ("a.json", "b.json")]
    # SGLang would read a group SIGTERM as a crash and sleep 5 s for a py-spy dump
    assert all(env[var] == "0" for env in envs for var in QUIET_STOP_ENV)
    pids = [server.proc.pid for server in servers]
    servers[1].finish_stop = functools.partial(ServerProcess.finish_stop, servers[1], grace_s=0.5)
    stop_servers(servers)
    assert all(server.proc is None for server in servers)
    for pid in pids:   # both groups are gone: SIGTERM for one, SIGKILL after the grace for the other
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_a_callers_environment_wins_over_the_quiet_stop_default(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "1")
    server = _Sleeper(tmp_path / "c.json")
    server.launch()
    try:
        assert _wait_for(tmp_path / "c.json")["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    finally:
        server.stop()


def test_a_taken_port_is_read_from_uvicorns_log_and_from_sglangs_routers():
    from sglang_ext.cluster.net import port_taken

    assert port_taken("ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): address already in use")
    assert port_taken("Error starting router: Failed to bind the HTTP listener on 127.0.0.1:1: "
                      "Address already in use (os error 98)")
    assert not port_taken("Failed to bind the HTTP listener on 127.0.0.1:1: Permission denied")
    assert not port_taken("Uvicorn running on http://127.0.0.1:1")
