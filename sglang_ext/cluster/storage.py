"""The cluster's shared storage tier on the Mooncake store: the commands of its master and of the
standalone client that lends it memory, and the workers' `--hicache-storage-backend-extra-config`
for it (the file backend needs nothing here: a directory, `ClusterSpec.worker_env`)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from sglang_ext.launcher import LaunchError


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
