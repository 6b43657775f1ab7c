"""SGLang's router (`smg launch`, pip `smg`; the `scale` extra): its policies, whether it is
installed, and its command line. The cluster never routes itself."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

#: `smg launch --policy` values (smg 1.13)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load",
                   "consistent_hashing", "prefix_hash")


def router_available() -> bool:
    return importlib.util.find_spec("smg") is not None


def router_command(worker_urls: Sequence[str], policy: str, host: str, port: int, metrics_host: str,
                   metrics_port: int, extra: Sequence[str] = ()) -> list[str]:
    """`smg launch` serving on `host:port` in front of `worker_urls`, its Prometheus endpoint on
    `metrics_host:metrics_port`, then the operator's `extra` arguments."""
    return [sys.executable, "-m", "smg", "launch", "--worker-urls", *worker_urls,
            "--policy", policy, "--host", host, "--port", str(port),
            "--prometheus-host", metrics_host, "--prometheus-port", str(metrics_port), *extra]
