"""`sglang-ext cluster` argument handling: what it starts, and bad options refused by name
(no process is started here; tests/scale/test_cluster_server.py runs the real thing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sglang_ext.cluster import ROUTER_POLICIES, STORAGE_BACKENDS, parse_cluster_args
from sglang_ext.launcher import LaunchError

WORKER = ["--model-path", "/m", "--radix-cache-backend", "tail_replay"]


def test_commands_of_a_two_worker_cluster():
    spec = parse_cluster_args(["--workers", "2", "--policy", "round_robin", "--port", "31000",
                               "--worker-ports", "31001,31002", "--metrics-port", "31003",
                               "--log-dir", "/tmp/x", "--router-arg=--cache-threshold=0.3", "--", *WORKER])
    assert spec.worker_urls() == ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]
    assert spec.worker_command(1) == [sys.executable, "-m", "sglang_ext", "serve", *WORKER,
                                      "--host", "127.0.0.1", "--port", "31002"]
    assert spec.router_command() == [
        sys.executable, "-m", "smg", "launch", "--worker-urls", "http://127.0.0.1:31001", "http://127.0.0.1:31002",
        "--policy", "round_robin", "--host", "127.0.0.1", "--port", "31000",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "31003", "--cache-threshold=0.3"]
    assert spec.log_dir == Path("/tmp/x")


def test_the_routers_metrics_stay_on_loopback_unless_the_operator_says_otherwise():
    public = parse_cluster_args(["--host", "0.0.0.0", "--port", "0", "--", *WORKER])
    command = public.router_command()
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--prometheus-host") + 1] == "127.0.0.1"
    assert public.metrics_url == f"http://127.0.0.1:{public.metrics_port}/metrics"
    shared = parse_cluster_args(["--host", "0.0.0.0", "--metrics-host", "0.0.0.0", "--port", "0", "--", *WORKER])
    command = shared.router_command()
    assert command[command.index("--prometheus-host") + 1] == "0.0.0.0"
    assert shared.metrics_url == f"http://127.0.0.1:{shared.metrics_port}/metrics"   # read here on loopback
    internal = parse_cluster_args(["--metrics-host", "10.0.0.7", "--port", "0", "--", *WORKER])
    assert internal.router_command()[internal.router_command().index("--prometheus-host") + 1] == "10.0.0.7"
    assert internal.metrics_url == f"http://10.0.0.7:{internal.metrics_port}/metrics"
    assert parse_cluster_args(["--metrics-host", "::1", "--port", "0", "--", *WORKER]).metrics_url.startswith("http://[::1]:")


def test_gpus_per_worker_sets_each_workers_first_gpu():
    spec = parse_cluster_args(["--workers", "2", "--gpus-per-worker", "4", "--port", "0", "--", *WORKER, "--tp-size", "4"])
    assert spec.worker_command(0)[-2:] == ["--base-gpu-id", "0"]
    assert spec.worker_command(1)[-2:] == ["--base-gpu-id", "4"]
    assert "--base-gpu-id" not in parse_cluster_args(["--port", "0", "--", *WORKER]).worker_command(1)


def test_defaults_pick_free_distinct_ports():
    spec = parse_cluster_args(["--workers", "3", "--port", "0", "--", *WORKER])
    assert spec.policy == "cache_aware" and spec.policy in ROUTER_POLICIES
    ports = [spec.port, spec.metrics_port, *spec.worker_ports]
    assert len(set(ports)) == 5 and all(p > 0 for p in ports)


def test_file_storage_gives_every_worker_the_host_tier_and_one_directory():
    spec = parse_cluster_args(["--workers", "2", "--port", "0", "--storage", "file", "--log-dir", "/tmp/c", "--", *WORKER])
    assert spec.worker_command(1)[-3:] == ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    assert spec.worker_env() == {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/tmp/c/storage"}
    assert spec.store_commands() == []
    given = parse_cluster_args(["--port", "0", "--storage", "file", "--storage-dir", "/data/kv", "--",
                                *WORKER, "--enable-hierarchical-cache", "--hicache-ratio", "4"])
    assert given.worker_command(0).count("--enable-hierarchical-cache") == 1
    assert given.worker_env() == {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/data/kv"}
    plain = parse_cluster_args(["--port", "0", "--", *WORKER])
    assert plain.storage == "none" and "--hicache-storage-backend" not in plain.worker_command(0)
    assert plain.worker_env() == {} and STORAGE_BACKENDS == ("none", "file", "mooncake")


def test_mooncake_storage_starts_its_master_and_memory_and_points_every_worker_at_it():
    spec = parse_cluster_args(["--workers", "2", "--port", "0", "--storage", "mooncake", "--storage-segment-mb", "64",
                               "--", *WORKER])
    rpc, metrics, client = spec.mooncake_ports
    assert len({rpc, metrics, client, spec.port, spec.metrics_port, *spec.worker_ports}) == 7
    master, store = spec.store_commands()
    assert Path(master[0]).name == "mooncake_master" and master[1:] == ["-rpc_port", str(rpc), "-metrics_port", str(metrics)]
    assert Path(store[0]).name == "mooncake_client" and store[1:] == [
        "-master_server_address", f"127.0.0.1:{rpc}", "-metadata_server", "P2PHANDSHAKE", "-protocol", "tcp",
        "-global_segment_size", "64 MB", "-host", "127.0.0.1", "-port", str(client)]
    command = spec.worker_command(0)
    at = command.index("--hicache-storage-backend")
    assert command[at - 1:at + 2] == ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    config = json.loads(command[command.index("--hicache-storage-backend-extra-config") + 1])
    assert config == {"master_server_address": f"127.0.0.1:{rpc}", "master_metrics_port": metrics,
                      "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
                      "global_segment_size": 0}   # the workers lend none: the store outlives them
    assert spec.worker_env() == {}


@pytest.mark.parametrize("argv, names", [
    (["--storage", "s3", "--", *WORKER], "--storage 's3'"),
    (["--storage", "mooncake", "--storage-segment-mb", "0", "--", *WORKER], "--storage-segment-mb 0"),
    (["--storage-dir", "/x", "--", *WORKER], "--storage-dir is for --storage file"),
    (["--storage", "file", "--", *WORKER, "--hicache-storage-backend", "nixl"], "--hicache-storage-backend is set"),
    (["--storage", "mooncake", "--", *WORKER, "--hicache-storage-backend-extra-config={}"],
     "--hicache-storage-backend-extra-config is set"),
    (["--workers", "2", *WORKER], "'--'"),
    (["--workers", "0", "--", *WORKER], "--workers 0"),
    (["--policy", "sticky", "--", *WORKER], "--policy 'sticky'"),
    (["--", "--radix-cache-backend", "tail_replay"], "--model-path"),
    (["--", *WORKER, "--port", "5"], "--port is set by the cluster"),
    (["--", *WORKER, "--host=0.0.0.0"], "--host is set by the cluster"),
    (["--workers", "2", "--worker-ports", "1,x", "--", *WORKER], "--worker-ports '1,x'"),
    (["--workers", "3", "--worker-ports", "31001,31002", "--", *WORKER], "2 port(s) for --workers 3"),
    (["--port", "31001", "--workers", "2", "--worker-ports", "31001,31002", "--", *WORKER], "must all differ"),
    (["--workers", "two", "--", *WORKER], "--workers"),
    (["--worker", "2", "--", *WORKER], "unknown option(s) ['--worker', '2']"),
    (["--", *WORKER, "--base-gpu-id", "1"], "--base-gpu-id is set by the cluster"),
    (["--gpus-per-worker", "-1", "--", *WORKER], "--gpus-per-worker -1"),
    (["--metrics-host", " ", "--", *WORKER], "--metrics-host"),
    (["--router-arg=--prometheus-host=0.0.0.0", "--", *WORKER], "the cluster sets it; use the cluster's --metrics-host"),
    (["--router-arg=--prometheus-port=9000", "--", *WORKER], "use the cluster's --metrics-port"),
    (["--router-arg=--host=0.0.0.0", "--", *WORKER], "--router-arg --host: the cluster sets it"),
])
def test_bad_options_are_refused_by_name(argv, names):
    with pytest.raises(LaunchError, match="sglang-ext cluster") as err:
        parse_cluster_args(argv)
    assert names in str(err.value)
