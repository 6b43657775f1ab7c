"""The running processes of one `ClusterSpec`: start in order (the storage tier, the workers, the
router), each in its own process group with its log under `--log-dir`, each waited for until it
serves (a worker whose port was taken is started again on a fresh one); stop them all, router
first, SIGTERM then SIGKILL after a grace period."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from sglang_ext.launcher import LaunchError

from .config import ClusterSpec
from .net import free_ports, get_ok, get_text, listens_on, port_taken
from .router import router_available

READY_TIMEOUT_S = 600.0
PORT_RETRIES = 3
STOP_GRACE_S = 20.0


@dataclass
class Cluster:
    """The running processes of one ClusterSpec; `start()` returns once the router serves."""

    spec: ClusterSpec
    workers: list[subprocess.Popen] = field(default_factory=list)
    router: subprocess.Popen | None = None
    #: the Mooncake store's master and its memory (`--storage mooncake`)
    store: list[subprocess.Popen] = field(default_factory=list)

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Cluster:
        if not router_available():
            raise LaunchError("sglang-ext cluster needs SGLang's router: pip install 'sglang-hybrid-cache[scale]' "
                              "(or pip install smg)")
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        store_commands = self.spec.store_commands()   # LaunchError before anything starts
        if self.spec.storage_dir is not None:
            self.spec.storage_dir.mkdir(parents=True, exist_ok=True)
        try:
            deadline = time.monotonic() + timeout_s
            if store_commands:
                master_command, client_command = store_commands
                self.store.append(self._spawn(master_command, "mooncake-master.log"))
                self._wait(f"http://{self.spec.host}:{self.spec.mooncake_ports[1]}/metrics", deadline,
                           "Mooncake master", self.store[0], "mooncake-master.log")
                self.store.append(self._spawn(client_command, "mooncake-store.log"))
                self._wait_store_memory(deadline)
            for i in range(self.spec.workers):
                self.workers.append(self._spawn(self.spec.worker_command(i), f"worker-{i}.log"))
            for i in range(self.spec.workers):
                self._wait_worker(i, deadline)
            self.router = self._spawn(self.spec.router_command(), "router.log")
            self._wait_router(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.spec.log_dir / log_name, "w")
        env = {**os.environ, **self.spec.worker_env()}
        try:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        finally:
            log.close()

    def _wait(self, url: str, deadline: float, what: str, proc: subprocess.Popen, log_name: str,
              port: int | None = None) -> None:
        """Until `url` answers 200 from `proc`. With its `port`: a log saying the port was taken,
        or an answer there from another process's server, is `_PortTaken`."""
        while time.monotonic() < deadline:
            if port is not None and port_taken((self.spec.log_dir / log_name).read_text(errors="replace")):
                raise _PortTaken(what)
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode}; log: {self.spec.log_dir / log_name}")
            if get_ok(url):
                if port is not None and not listens_on(proc.pid, port):
                    raise _PortTaken(what)   # another process's server answered on the port
                return
            time.sleep(1.0)
        raise TimeoutError(f"{what} not ready; log: {self.spec.log_dir / log_name}")

    def _wait_store_memory(self, deadline: float) -> None:
        """Until the master counts the store client's memory (its segment is mounted)."""
        url = f"http://{self.spec.host}:{self.spec.mooncake_ports[1]}/metrics"
        while time.monotonic() < deadline:
            for proc, log in zip(self.store, ("mooncake-master.log", "mooncake-store.log")):
                if proc.poll() is not None:
                    raise RuntimeError(f"Mooncake {log.split('.')[0]} exited with code {proc.returncode}; "
                                       f"log: {self.spec.log_dir / log}")
            text = get_text(url) or ""
            if any(line.startswith("master_total_capacity_bytes") and float(line.split()[-1]) > 0
                   for line in text.splitlines()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"the Mooncake store client did not mount its memory; log: {self.spec.log_dir / 'mooncake-store.log'}")

    def _wait_worker(self, i: int, deadline: float) -> None:
        """Wait until worker i is healthy. A worker whose port was taken between choosing it and
        binding it (by another process's own internal ports) is started again on a fresh port,
        up to PORT_RETRIES times; the router, started after every worker, gets the final ports."""
        for attempt in range(PORT_RETRIES + 1):
            url = self.spec.worker_urls()[i]
            try:
                self._wait(url + "/health_generate", deadline, f"worker {i} ({url})", self.workers[i],
                           f"worker-{i}.log", port=self.spec.worker_ports[i])
                return
            except _PortTaken:
                _stop_group(self.workers[i])
                if attempt == PORT_RETRIES:
                    raise RuntimeError(f"worker {i}: its port was taken {PORT_RETRIES + 1} times; "
                                       f"log: {self.spec.log_dir / f'worker-{i}.log'}") from None
                ports = list(self.spec.worker_ports)
                taken = {self.spec.port, self.spec.metrics_port, *ports}
                ports[i] = next(p for p in free_ports(len(taken) + 1, self.spec.host) if p not in taken)
                self.spec = dataclasses.replace(self.spec, worker_ports=tuple(ports))
                self.workers[i] = self._spawn(self.spec.worker_command(i), f"worker-{i}.log")

    def _wait_router(self, deadline: float) -> None:
        """The router answers /health before it has registered its workers: ready once it lists
        them all (`GET /workers`). A router whose ports were picked here (`router_ports_picked`)
        and taken before it bound them is started again on fresh ones, up to PORT_RETRIES times."""
        assert self.router is not None
        for attempt in range(PORT_RETRIES + 1):
            try:
                self._wait(self.spec.url + "/health", deadline, f"router ({self.spec.url})", self.router, "router.log",
                           port=self.spec.port)
                break
            except _PortTaken:
                _stop_group(self.router)
                if not self.spec.router_ports_picked or attempt == PORT_RETRIES:
                    raise RuntimeError(f"router: its port {self.spec.port} (or metrics port {self.spec.metrics_port}) "
                                       f"was taken; log: {self.spec.log_dir / 'router.log'}") from None
                taken = {*self.spec.worker_ports, *self.spec.mooncake_ports, self.spec.port, self.spec.metrics_port}
                port, metrics_port = [p for p in free_ports(len(taken) + 2, self.spec.host) if p not in taken][:2]
                self.spec = dataclasses.replace(self.spec, port=port, metrics_port=metrics_port)
                self.router = self._spawn(self.spec.router_command(), "router.log")
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited with code {self.router.returncode}; log: {self.spec.log_dir / 'router.log'}")
            body = get_text(self.spec.url + "/workers")
            if body is not None and all(f"\"{url}\"" in body for url in self.spec.worker_urls()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"router did not register its workers; log: {self.spec.log_dir / 'router.log'}")

    def processes(self) -> list[subprocess.Popen]:
        """Router first, then the workers, then the storage master (the order they stop in)."""
        return [p for p in [self.router, *self.workers, *self.store] if p is not None]

    def exited(self) -> list[str]:
        """Names of the processes that have ended."""
        names = [("router", self.router), *((f"worker-{i}", p) for i, p in enumerate(self.workers)),
                 *zip(("mooncake-master", "mooncake-store"), self.store)]
        return [f"{name} (code {p.returncode})" for name, p in names if p is not None and p.poll() is not None]

    def stop(self) -> None:
        """End every process group (router first): SIGTERM, then SIGKILL after a grace period."""
        procs = self.processes()
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        self.router, self.workers, self.store = None, [], []

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _PortTaken(Exception):
    """A worker could not bind its HTTP port."""


def _stop_group(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
