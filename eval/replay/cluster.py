"""A server spec run as `sglang-ext cluster` (`--workers > 1`): SGLang's router in front of N
workers, behind the interface the replay uses for one server (`eval.harness.ServerProcess`)."""

from __future__ import annotations

from pathlib import Path


class ClusterProcess:
    """One server spec as `sglang-ext cluster` (router + `workers` workers), with the
    ServerProcess interface the replay uses (`url`, `launch`, `wait_ready`, `stop`)."""

    def __init__(self, model: str, worker_args: list[str], workers: int, policy: str, log_dir: Path) -> None:
        from sglang_ext.cluster import Cluster, parse_cluster_args

        argv = ["--workers", str(workers), "--policy", policy, "--port", "0", "--log-dir", str(log_dir),
                "--", "--model-path", model, *worker_args]
        self.cluster = Cluster(parse_cluster_args(argv))
        self.url = self.cluster.spec.url

    @property
    def worker_urls(self) -> list[str]:
        """The workers' URLs as started (a worker whose port was taken gets a fresh one)."""
        return self.cluster.spec.worker_urls()

    @property
    def router_metrics_url(self) -> str:
        """The router's Prometheus endpoint (`sglang-ext cluster` starts it with one)."""
        return f"http://{self.cluster.spec.host}:{self.cluster.spec.metrics_port}/metrics"

    def launch(self) -> ClusterProcess:
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> ClusterProcess:
        self.cluster.start(timeout_s)
        return self

    def pids(self) -> list[int]:
        return [p.pid for p in self.cluster.processes()]

    def signal_stop(self) -> None:
        """`stop_servers`' first step: the cluster stops whole here (router first, then every
        worker and the store, each its own process group); `finish_stop` has nothing left."""
        self.cluster.stop()

    def finish_stop(self, grace_s: float = 20.0) -> None:
        return None

    def stop(self) -> None:
        self.cluster.stop()


def server_pids(server) -> list[int]:
    """Every process of a ServerProcess or a ClusterProcess."""
    return server.pids() if isinstance(server, ClusterProcess) else [server.proc.pid]


def server_worker_urls(server) -> list[str]:
    """The URLs that serve the requests' prefills: a cluster's workers, or the one server."""
    return server.worker_urls if isinstance(server, ClusterProcess) else [server.url]
