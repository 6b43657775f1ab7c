"""`sglang-ext cluster`, the command: start the cluster, print where it serves, wait for SIGINT /
SIGTERM or any process's death, stop everything and exit (0 on a signal, 1 on a death)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence

from .config import parse_cluster_args
from .processes import Cluster


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
              f"{storage[started_spec.storage]}; router metrics on {started_spec.metrics_host}:"
              f"{started_spec.metrics_port}", flush=True)
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
