"""The router's Prometheus endpoint listens on loopback unless the operator asks otherwise: its
cache-aware match-ratio histogram is keyed by request text, not tenant, so on a shared address it
tells any client what other tenants' prompts begin with (docs/deployment.md, "Tenants").

The router is started exactly as `sglang-ext cluster` starts it (`ClusterSpec.router_command()`),
with no worker behind it: its listening sockets are what is checked (smg binds them at once)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import psutil

from sglang_ext.cluster import parse_cluster_args

WORKER = ["--model-path", "/m"]


def _listening(pid: int) -> set[tuple[str, int]]:
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def _router_sockets(cluster_args: list[str], tmp_path) -> tuple[set[tuple[str, int]], object, str]:
    """(listening sockets, spec, /metrics body read on the spec's metrics URL) of the router."""
    spec = parse_cluster_args([*cluster_args, "--workers", "1", "--port", "0", "--", *WORKER])
    log = open(tmp_path / "router.log", "w")
    proc = subprocess.Popen(spec.router_command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, wanted = time.monotonic() + 60, {spec.port, spec.metrics_port}
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            sockets = _listening(proc.pid)
            if wanted <= {port for _, port in sockets}:
                break
            assert time.monotonic() < deadline, f"router not listening on {wanted}: {sockets}"
            time.sleep(0.2)
        with urllib.request.urlopen(spec.metrics_url, timeout=10) as resp:
            body = resp.read().decode()
        return sockets, spec, body
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def test_a_public_router_keeps_its_metrics_on_loopback(tmp_path):
    sockets, spec, body = _router_sockets(["--host", "0.0.0.0"], tmp_path)
    assert ("0.0.0.0", spec.port) in sockets                  # clients reach the router
    assert {ip for ip, port in sockets if port == spec.metrics_port} == {"127.0.0.1"}
    assert "smg_" in body                                      # and the operator reads its metrics here


def test_the_operator_can_publish_the_metrics_explicitly(tmp_path):
    sockets, spec, body = _router_sockets(["--host", "0.0.0.0", "--metrics-host", "0.0.0.0"], tmp_path)
    assert {ip for ip, port in sockets if port == spec.metrics_port} == {"0.0.0.0"}
    assert "smg_" in body
