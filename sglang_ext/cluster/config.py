"""What `sglang-ext cluster` starts: its options (`parse_cluster_args`, bad ones refused by name)
and the validated result (`ClusterSpec`: ports, each process's command line and environment)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.launcher import LaunchError

from .net import free_ports
from .router import ROUTER_POLICIES, router_command
from .storage import mooncake_extra_config, mooncake_master_command, mooncake_store_command

#: worker flags the cluster sets itself
OWNED_WORKER_FLAGS = ("--host", "--port", "--base-gpu-id")
#: `--storage` values: a storage tier (SGLang's `--hicache-storage-backend`) shared by the workers
STORAGE_BACKENDS = ("none", "file", "mooncake")
#: worker flags the cluster sets itself with `--storage`
OWNED_STORAGE_FLAGS = ("--hicache-storage-backend", "--hicache-storage-backend-extra-config")
#: router flags the cluster sets itself (`--router-arg` may not): its own options say where
OWNED_ROUTER_FLAGS = {"--worker-urls": "--workers / --worker-ports", "--policy": "--policy", "--host": "--host",
                      "--port": "--port", "--prometheus-host": "--metrics-host",
                      "--prometheus-port": "--metrics-port"}
#: the router's metrics listen here unless `--metrics-host` says otherwise
LOOPBACK = "127.0.0.1"
#: addresses that listen on every interface (a client on this machine reads them on loopback)
WILDCARD_HOSTS = ("0.0.0.0", "::")


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
    #: the address the router's Prometheus endpoint listens on: loopback unless the operator
    #: says otherwise (`--metrics-host`): its cache-aware match ratios are keyed by request text,
    #: not tenant, so whoever reads them learns what other tenants' prompts begin with
    metrics_host: str = LOOPBACK
    #: the router's and its metrics' ports were picked here (`--port 0`, no `--metrics-port`): a
    #: router whose port was taken before it bound is started again on fresh ones
    router_ports_picked: bool = False

    def worker_urls(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.worker_ports]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Where this machine reads the router's Prometheus endpoint."""
        host = LOOPBACK if self.metrics_host in WILDCARD_HOSTS else self.metrics_host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.metrics_port}/metrics"

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
        return router_command(self.worker_urls(), self.policy, self.host, self.port, self.metrics_host,
                              self.metrics_port, self.router_args)


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
    parser.add_argument("--metrics-host", default=LOOPBACK,
                        help="the address the router's Prometheus endpoint listens on (default: loopback, "
                             "whatever --host is: its cache-aware match ratios reveal what other tenants' "
                             "prompts begin with; docs/deployment.md)")
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
    if not ns.metrics_host.strip():
        raise LaunchError(f"sglang-ext cluster --metrics-host {ns.metrics_host!r}: give an address (default {LOOPBACK})")
    if ns.policy not in ROUTER_POLICIES:
        raise LaunchError(f"sglang-ext cluster --policy {ns.policy!r}: use one of {ROUTER_POLICIES}")
    if not any(a == "--model-path" or a.startswith("--model-path=") for a in worker_args):
        raise LaunchError("sglang-ext cluster: the workers' arguments (after '--') need --model-path")
    for flag in OWNED_WORKER_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in worker_args):
            raise LaunchError(f"sglang-ext cluster: {flag} is set by the cluster for each worker; "
                              f"leave it out of the workers' arguments (use the cluster's --host / --worker-ports / "
                              f"--gpus-per-worker)")
    for router_flag, instead in OWNED_ROUTER_FLAGS.items():
        if any(a == router_flag or a.startswith(router_flag + "=") for a in ns.router_arg):
            raise LaunchError(f"sglang-ext cluster --router-arg {router_flag}: the cluster sets it; "
                              f"use the cluster's {instead}")
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
                       mooncake_ports, ns.storage_segment_mb, ns.metrics_host,
                       router_ports_picked=not ns.port and not ns.metrics_port)
