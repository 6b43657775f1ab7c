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

Modules: `config` (options -> `ClusterSpec`), `router` (smg's command line), `storage` (the
Mooncake store's commands and config), `processes` (`Cluster`: start, wait, stop), `net` (ports,
HTTP probes), `command` (`run_cluster`).
"""

from __future__ import annotations

from .command import run_cluster
from .config import OWNED_STORAGE_FLAGS, OWNED_WORKER_FLAGS, STORAGE_BACKENDS, ClusterSpec, parse_cluster_args
from .net import free_port, free_ports, listens_on, port_taken
from .processes import PORT_RETRIES, READY_TIMEOUT_S, STOP_GRACE_S, Cluster
from .router import ROUTER_POLICIES, router_available
from .storage import mooncake_extra_config, mooncake_master_command, mooncake_store_command

__all__ = ["OWNED_STORAGE_FLAGS", "OWNED_WORKER_FLAGS", "PORT_RETRIES", "READY_TIMEOUT_S", "ROUTER_POLICIES",
           "STOP_GRACE_S", "STORAGE_BACKENDS", "Cluster", "ClusterSpec", "free_port", "free_ports",
           "mooncake_extra_config", "mooncake_master_command", "mooncake_store_command", "parse_cluster_args",
           "listens_on", "port_taken", "router_available", "run_cluster"]
