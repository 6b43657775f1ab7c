"""Start and stop a patched SGLang server for tests, demos and benchmarks.

The server runs in its own process group on a free port; `stop()` ends the whole group
(scheduler and detokenizer children included), also when the caller failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from sglang_ext.cluster import free_port, listens_on, port_taken

STARTUP_TIMEOUT_S = 600.0
#: a server whose HTTP port was taken between `free_port()` and its bind (another server's
#: internal or HTTP port, started side by side) is relaunched on a fresh port; `port_taken` reads
#: its log, `listens_on` tells its own answer from another server's on the same port
#: (both shared with `sglang-ext cluster`, which does the same for its workers)
PORT_RETRIES = 3
#: SGLang's crash diagnostics, off for servers started here unless the caller's environment says
#: otherwise: `stop()` ends the process group, so the scheduler's exit on SIGTERM reads as a crash
#: to the server, which then sleeps 5 s for a py-spy dump before it exits (5 s per stop, no use)
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
#: how often a booting server's /health_generate is polled
POLL_S = 0.25


class PortTakenError(RuntimeError):
    """The server could not bind its HTTP port."""


@dataclass
class ServerProcess:
    model_path: str
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    #: environment variables set for this server only (on top of this process's)
    env: dict[str, str] = field(default_factory=dict)
    #: this server's Prometheus multiprocess folder (SGLang makes one in /tmp per launch and a
    #: killed server leaves it behind); removed when the server stops
    metrics_dir: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang_ext", "serve", "--model-path", self.model_path,
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> ServerProcess:
        """Start the process without waiting (several servers can then boot side by side)."""
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        env = {**QUIET_STOP_ENV, **os.environ, **self.env}
        if "PROMETHEUS_MULTIPROC_DIR" not in self.env:   # (this process's own, if SGLang set one here, is not the server's)
            self.metrics_dir = self.metrics_dir or tempfile.mkdtemp(prefix="sglang-ext-metrics-")
            env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        return self

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        """Wait until healthy; a server whose port was taken before it could bind is relaunched on
        a fresh port (up to PORT_RETRIES times). On any other failure the server is stopped."""
        for attempt in range(PORT_RETRIES + 1):
            try:
                self._wait_healthy(timeout_s)
                return self
            except PortTakenError:
                self.stop()
                if attempt == PORT_RETRIES:
                    raise
                self.port = free_port()
                self.launch()
            except BaseException:
                self.stop()
                raise
        return self

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}; log: {self.log_path}")
            if port_taken(self.log_text()):
                raise PortTakenError(f"port {self.port} was taken before the server could bind it; log: {self.log_path}")
            try:
                healthy = requests.get(f"{self.url}/health_generate", timeout=30).status_code == 200
            except requests.RequestException:
                healthy = False
            if healthy:
                if not listens_on(self.proc.pid, self.port):   # another server took the port first
                    raise PortTakenError(f"port {self.port} answers from another process's server; log: {self.log_path}")
                return
            time.sleep(POLL_S)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f}s; log: {self.log_path}")


    def stop(self) -> None:
        """End the process group: SIGTERM, then SIGKILL after a 20 s grace."""
        self.signal_stop()
        self.finish_stop()

    def signal_stop(self) -> None:
        """Send SIGTERM to the process group (`finish_stop` waits for it): several servers then
        shut down side by side."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def finish_stop(self, grace_s: float = 20.0) -> None:
        """Wait up to `grace_s` for the SIGTERM to end the server, then SIGKILL what is left."""
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def generate(self, **payload) -> dict:
        resp = requests.post(f"{self.url}/generate", json=payload, timeout=600)
        resp.raise_for_status()
        return resp.json()


def start_servers(servers: list[ServerProcess], timeout_s: float = STARTUP_TIMEOUT_S) -> list[ServerProcess]:
    """Boot several servers side by side; on any failure stop them all."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(timeout_s)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


@contextlib.contextmanager
def _sigterm_handled_by(handler):
    """Inside: SIGTERM calls `handler`; the previous handler is restored on exit. Only the main
    thread can set handlers; elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def sigterm_unwinds():
    """Inside: SIGTERM raises SystemExit(143), so `finally` blocks stop the servers a command
    started instead of orphaning them (`kill PID`; background jobs of a script ignore SIGINT)."""
    return _sigterm_handled_by(_exit_on_sigterm)


@contextlib.contextmanager
def sigterm_deferred():
    """Inside: a SIGTERM waits until the block is done (a cleanup must not be cut short), then
    raises SystemExit(143)."""
    received: list[int] = []
    with _sigterm_handled_by(lambda signum, frame: received.append(signum)):
        yield
    if received:
        raise SystemExit(128 + received[0])


@contextlib.contextmanager
def servers_running(servers: list[ServerProcess]):
    """Boot `servers`, yield them, stop them all: on return, on errors and on SIGTERM (also
    one that arrives while they are being stopped)."""
    with sigterm_unwinds():
        try:
            start_servers(servers)
            yield servers
        finally:
            with sigterm_deferred():
                stop_servers(servers)


def stop_servers(servers: list[ServerProcess]) -> None:
    """Stop several servers side by side (SIGTERM to all, then wait for each)."""
    for server in servers:
        server.signal_stop()
    for server in servers:
        server.finish_stop()
