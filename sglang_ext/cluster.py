"""`sglang-ext cluster`: SGLang's router in front of N patched workers, as one command.

    sglang-ext cluster --workers 4 --policy cache_aware --port 30000 --log-dir logs/ \\
        -- --model-path M --radix-cache-backend tail_replay

Everything after `--` goes to every worker (`sglang-ext serve`, so the CPU launcher's defaults
and every extension flag work); the cluster gives each worker its own `--host` / `--port`. The
router is SGLang's own (`smg launch`, pip `smg`; the `scale` extra), never a home-made one. It
routes HTTP workers with its approximate prefix tree over the request's text or token ids; it
reads workers' KV events only for gRPC workers (docs/deployment.md).

`--storage file|mooncake` gives the workers one shared storage tier (SGLang's HiCache L3: the
workers get `--enable-hierarchical-cache --hicache-storage-backend ...`): the file backend in
`--storage-dir`, or the Mooncake store, whose master (`mooncake_master`, pip
`mooncake-transfer-engine` / `-non-cuda`) the cluster starts first (TCP transport, no metadata
server; each worker lends it `--storage-segment-mb` of memory).

Each process runs in its own process group with its log under `--log-dir`; SIGINT / SIGTERM, or
any process dying, stops them all (router first, then the workers, then the storage master), and
the command exits.
Nothing here knows a wing: the cluster only launches processes and waits for them to be ready.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sglang_ext.launcher import LaunchError

#: `smg launch --policy` values (smg 1.13)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load",
                   "consistent_hashing", "prefix_hash")
#: worker flags the cluster sets itself
OWNED_WORKER_FLAGS = ("--host", "--port", "--base-gpu-id")
#: `--storage` values: a storage tier (SGLang's `--hicache-storage-backend`) shared by the workers
STORAGE_BACKENDS = ("none", "file", "mooncake")
#: worker flags the cluster sets itself with `--storage`
OWNED_STORAGE_FLAGS = ("--hicache-storage-backend", "--hicache-storage-backend-extra-config")
READY_TIMEOUT_S = 600.0
PORT_RETRIES = 3
STOP_GRACE_S = 20.0


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports (all held open until every one is chosen, so none repeats)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _mooncake_binary(name: str) -> str:
    binary = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if binary is None:
        raise LaunchError(f"--storage mooncake needs the Mooncake store's {name}: pip install "
                          "mooncake-transfer-engine (GPU) or mooncake-transfer-engine-non-cuda (CPU; needs the "
                          "system library libibverbs1 even for TCP)")
    return binary


def mooncake_master_command(rpc_port: int, metrics_port: int) -> list[str]:
    """The Mooncake store's master on this machine (the binary of pip `mooncake-transfer-engine` /
    `mooncake-transfer-engine-non-cuda`); LaunchError naming the package when it is missing."""
    return [_mooncake_binary("mooncake_master"), "-rpc_port", str(rpc_port), "-metrics_port", str(metrics_port)]


def mooncake_store_command(master: str, port: int, segment_bytes: int, host: str = "127.0.0.1") -> list[str]:
    """A standalone Mooncake store client that lends the store `segment_bytes` of its memory: the
    store's data lives there, so it outlives the servers (a server that restarts finds what it, or
    another, stored). TCP transport, peer-to-peer handshakes."""
    return [_mooncake_binary("mooncake_client"), "-master_server_address", master, "-metadata_server", "P2PHANDSHAKE",
            "-protocol", "tcp", "-global_segment_size", f"{segment_bytes >> 20} MB", "-host", host, "-port", str(port)]


def mooncake_extra_config(master: str, metrics_port: int, segment_bytes: int = 0, protocol: str = "tcp") -> dict:
    """SGLang's `--hicache-storage-backend-extra-config` for the Mooncake store at `master`
    (host:port): TCP transport and peer-to-peer handshakes (no metadata server). A server lends the
    store `segment_bytes` of its memory (0: none, the store's memory is a standalone client's,
    `mooncake_store_command`; what a server lends is lost when it stops)."""
    return {"master_server_address": master, "master_metrics_port": metrics_port,
            "metadata_server": "P2PHANDSHAKE", "protocol": protocol, "device_name": "",
            "global_segment_size": segment_bytes}


@dataclass(frozen=True)
class ClusterSpec:
    """What `sglang-ext cluster` starts (validated: `parse_cluster_args`)."""

    workers: int
    policy: str
    host: str
    port: int
    worker_args: tuple[str, ...]
    log_dir: Path
    router_args: tuple[str, ...] = ()
    worker_ports: tuple[int, ...] = ()
    #: the router's Prometheus port (smg's default, 29000 on every interface, is taken by the
    #: second cluster on a machine)
    metrics_port: int = 0
    #: GPUs per worker on a multi-GPU node: worker i gets `--base-gpu-id i * gpus_per_worker`
    #: (0: not set, every worker starts from SGLang's default GPU 0)
    gpus_per_worker: int = 0
    #: the workers' shared storage tier (STORAGE_BACKENDS)
    storage: str = "none"
    #: file backend: its directory
    storage_dir: Path | None = None
    #: Mooncake store: the master's RPC and metrics ports and the store client's port, and the
    #: memory that client lends the store (the workers lend none: the store outlives them)
    mooncake_ports: tuple[int, int, int] = (0, 0, 0)
    storage_segment_mb: int = 512

    def worker_urls(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.worker_ports]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def worker_command(self, i: int) -> list[str]:
        gpus = ["--base-gpu-id", str(i * self.gpus_per_worker)] if self.gpus_per_worker else []
        return [sys.executable, "-m", "sglang_ext", "serve", *self.worker_args,
                "--host", self.host, "--port", str(self.worker_ports[i]), *gpus, *self.storage_args()]

    def storage_args(self) -> list[str]:
        """The workers' storage-tier flags (none without `--storage`)."""
        if self.storage == "none":
            return []
        hicache = [] if "--enable-hierarchical-cache" in self.worker_args else ["--enable-hierarchical-cache"]
        if self.storage == "file":
            return [*hicache, "--hicache-storage-backend", "file"]
        config = mooncake_extra_config(f"{self.host}:{self.mooncake_ports[0]}", self.mooncake_ports[1])
        return [*hicache, "--hicache-storage-backend", "mooncake",
                "--hicache-storage-backend-extra-config", json.dumps(config)]

    def worker_env(self) -> dict[str, str]:
        """Environment the workers get on top of the cluster's (the file backend's directory)."""
        if self.storage == "file":
            return {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.storage_dir)}
        return {}

    def store_commands(self) -> list[list[str]]:
        """The Mooncake store's master and its memory (a standalone client), started in this order
        before the workers; none for other storage."""
        if self.storage != "mooncake":
            return []
        rpc, metrics, client = self.mooncake_ports
        return [mooncake_master_command(rpc, metrics),
                mooncake_store_command(f"{self.host}:{rpc}", client, self.storage_segment_mb << 20, self.host)]

    def router_command(self) -> list[str]:
        return [sys.executable, "-m", "smg", "launch", "--worker-urls", *self.worker_urls(),
                "--policy", self.policy, "--host", self.host, "--port", str(self.port),
                "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
                *self.router_args]


def parse_cluster_args(argv: Sequence[str]) -> ClusterSpec:
    """`[CLUSTER OPTIONS] -- WORKER ARGS`; raises LaunchError naming a bad option."""
    argv = list(argv)
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        raise LaunchError("sglang-ext cluster: put the workers' arguments after '--' "
                          "(e.g. sglang-ext cluster --workers 2 -- --model-path M)")
    cut = argv.index("--") if "--" in argv else len(argv)
    own, worker_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="sglang-ext cluster", exit_on_error=False, allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=2, help="worker servers behind the router")
    parser.add_argument("--policy", default="cache_aware", help=f"router policy: {', '.join(ROUTER_POLICIES)}")
    parser.add_argument("--host", default="127.0.0.1", help="host of the router and the workers")
    parser.add_argument("--port", type=int, default=30000, help="the router's port (0: a free one)")
    parser.add_argument("--worker-ports", default=None,
                        help="comma-separated worker ports (default: free ports)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="the router's Prometheus port (default: a free one)")
    parser.add_argument("--gpus-per-worker", type=int, default=0,
                        help="on a multi-GPU node: worker i gets --base-gpu-id i*N (N = its --tp-size x --dp-size)")
    parser.add_argument("--log-dir", default="cluster-logs", help="router.log and worker-<i>.log go here")
    parser.add_argument("--storage", default="none",
                        help=f"a storage tier (HiCache L3) shared by the workers: {', '.join(STORAGE_BACKENDS)}")
    parser.add_argument("--storage-dir", default=None, help="--storage file: its directory (default: LOG_DIR/storage)")
    parser.add_argument("--storage-segment-mb", type=int, default=512,
                        help="--storage mooncake: the store's memory, in MiB (a standalone store client holds it)")
    parser.add_argument("--router-arg", action="append", default=[],
                        help="one more `smg launch` argument (repeat; e.g. --router-arg=--cache-threshold=0.3)")
    if "-h" in own or "--help" in own:
        parser.print_help()
        raise SystemExit(0)
    try:
        ns, unknown = parser.parse_known_args(own)
    except argparse.ArgumentError as exc:
        raise LaunchError(f"sglang-ext cluster: {exc}") from None
    if unknown:
        raise LaunchError(f"sglang-ext cluster: unknown option(s) {unknown}; the workers' arguments go after '--'")
    if ns.workers < 1:
        raise LaunchError(f"sglang-ext cluster --workers {ns.workers}: needs at least 1 worker")
    if ns.gpus_per_worker < 0:
        raise LaunchError(f"sglang-ext cluster --gpus-per-worker {ns.gpus_per_worker}: must be >= 0")
    if ns.policy not in ROUTER_POLICIES:
        raise LaunchError(f"sglang-ext cluster --policy {ns.policy!r}: use one of {ROUTER_POLICIES}")
    if not any(a == "--model-path" or a.startswith("--model-path=") for a in worker_args):
        raise LaunchError("sglang-ext cluster: the workers' arguments (after '--') need --model-path")
    for flag in OWNED_WORKER_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in worker_args):
            raise LaunchError(f"sglang-ext cluster: {flag} is set by the cluster for each worker; "
                              f"leave it out of the workers' arguments (use the cluster's --host / --worker-ports / "
                              f"--gpus-per-worker)")
    if ns.storage not in STORAGE_BACKENDS:
        raise LaunchError(f"sglang-ext cluster --storage {ns.storage!r}: use one of {STORAGE_BACKENDS}")
    if ns.storage_segment_mb < 1:
        raise LaunchError(f"sglang-ext cluster --storage-segment-mb {ns.storage_segment_mb}: must be >= 1")
    if ns.storage_dir is not None and ns.storage != "file":
        raise LaunchError(f"sglang-ext cluster --storage-dir is for --storage file (got --storage {ns.storage})")
    if ns.storage != "none":
        for flag in OWNED_STORAGE_FLAGS:
            if any(a == flag or a.startswith(flag + "=") for a in worker_args):
                raise LaunchError(f"sglang-ext cluster: {flag} is set by the cluster with --storage {ns.storage}; "
                                  "leave it out of the workers' arguments")
    if ns.worker_ports:
        try:
            ports = tuple(int(p) for p in ns.worker_ports.split(","))
        except ValueError:
            raise LaunchError(f"sglang-ext cluster --worker-ports {ns.worker_ports!r}: expected integers") from None
        if len(ports) != ns.workers:
            raise LaunchError(f"sglang-ext cluster --worker-ports: {len(ports)} port(s) for --workers {ns.workers}")
    else:
        ports = ()
    picked = iter(free_ports(ns.workers + 5, ns.host))   # distinct from each other
    ports = ports or tuple(next(picked) for _ in range(ns.workers))
    port = ns.port or next(picked)
    metrics_port = ns.metrics_port or next(picked)
    if len({port, metrics_port, *ports}) != len(ports) + 2:
        raise LaunchError(f"sglang-ext cluster: router port {port}, metrics port {metrics_port} and worker "
                          f"ports {list(ports)} must all differ")
    mooncake_ports = (next(picked), next(picked), next(picked)) if ns.storage == "mooncake" else (0, 0, 0)
    storage_dir = Path(ns.storage_dir or Path(ns.log_dir) / "storage") if ns.storage == "file" else None
    return ClusterSpec(ns.workers, ns.policy, ns.host, port, tuple(worker_args), Path(ns.log_dir),
                       tuple(ns.router_arg), ports, metrics_port, ns.gpus_per_worker, ns.storage, storage_dir,
                       mooncake_ports, ns.storage_segment_mb)


def router_available() -> bool:
    return importlib.util.find_spec("smg") is not None


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
              port_check: bool = False) -> None:
        while time.monotonic() < deadline:
            if port_check and port_taken((self.spec.log_dir / log_name).read_text(errors="replace")):
                raise _PortTaken(what)
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode}; log: {self.spec.log_dir / log_name}")
            if _get_ok(url):
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
            text = _get_text(url) or ""
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
                           f"worker-{i}.log", port_check=True)
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
        them all (`GET /workers`)."""
        assert self.router is not None
        self._wait(self.spec.url + "/health", deadline, f"router ({self.spec.url})", self.router, "router.log")
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited with code {self.router.returncode}; log: {self.spec.log_dir / 'router.log'}")
            body = _get_text(self.spec.url + "/workers")
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


def port_taken(log: str) -> bool:
    """Whether a server's log says uvicorn could not bind its HTTP port."""
    return "error while attempting to bind" in log and "address already in use" in log


def _stop_group(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _get_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode("utf-8", "replace") if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def _get_ok(url: str) -> bool:
    return _get_text(url) is not None


def run_cluster(argv: Sequence[str]) -> int:
    """The command: start, print where it serves, wait for SIGINT / SIGTERM or a death, stop."""
    spec = parse_cluster_args(argv)
    stop_now: list[int] = []
    started = [False]

    def _request_stop(signum: int, frame: object) -> None:
        stop_now.append(signum)
        if not started[0]:   # still booting: unwind now (the `finally` stops what has started)
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, _request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = Cluster(spec)
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError) as exc:   # a process died or never got ready
            print(f"sglang-ext cluster: error: {exc}", file=sys.stderr, flush=True)
            return 1
        started[0] = True
        started_spec = cluster.spec   # as started (a worker whose port was taken has a new one)
        storage = {"none": "", "file": f"; storage: file in {started_spec.storage_dir}/",
                   "mooncake": f"; storage: Mooncake store, master {started_spec.host}:{started_spec.mooncake_ports[0]} "
                               f"(metrics port {started_spec.mooncake_ports[1]})"}
        print(f"sglang-ext cluster: router {started_spec.url} (policy {started_spec.policy}) -> workers "
              f"{', '.join(started_spec.worker_urls())}; logs in {started_spec.log_dir}/"
              f"{storage[started_spec.storage]}", flush=True)
        while not stop_now:
            dead = cluster.exited()
            if dead:
                print(f"sglang-ext cluster: {', '.join(dead)} ended; stopping the cluster", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        started[0] = True   # a second signal must not cut the shutdown short
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
