"""The storage tier (HiCache L3) after a restart, on a real trace: each server is replayed twice,
as two processes one after the other over the same store (the second starts with empty device and
host tiers, so what it reuses beyond its own traffic comes from storage). Stock SGLang and
Tail-Replay over SGLang's file backend, and Tail-Replay over the Mooncake store (its master and a
standalone client holding its memory run for the whole benchmark: the store outlives the servers).

    .venv/bin/python benchmarks/replay_storage.py --out docs/results/replay-kv48-heldout-l3

Every server: the held-out agentic replay of docs/deployment.md's host-tier table (600 requests,
48 conversations not in the repository's data, 16 greedy output tokens, `extra_buffer`), a device
KV pool of 9,216 tokens, `--hicache-ratio 4`, the storage prefetch waiting for its pages
(`--hicache-storage-prefetch-policy wait_complete`). Arguments after the known ones go to
`python -m eval.replay` (e.g. `--requests 100` for a short run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eval.replay.cli import main as replay_main  # noqa: E402
from sglang_ext.cluster import free_ports, mooncake_extra_config, mooncake_master_command, mooncake_store_command  # noqa: E402

REPLAY = ["--trace", "kv-cache-tester", "--sessions", "48", "--skip-sessions", "48", "--session-gap-s", "10",
          "--requests", "600", "--tokens-per-block", "1", "--max-total-tokens", "9216", "--max-mamba-cache-size", "32",
          "--new-tokens", "16", "--boot", "each"]
COMMON = "--mamba-radix-cache-strategy extra_buffer --enable-hierarchical-cache --hicache-ratio 4 " \
         "--hicache-storage-prefetch-policy wait_complete"


def _metric(port: int, name: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return -1.0
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return -1.0


@contextlib.contextmanager
def mooncake_store(log_dir: Path, segment_mb: int):
    """The Mooncake store's master and its memory; yields (master address, metrics port)."""
    rpc, metrics, client = free_ports(3)
    procs = []
    try:
        for command, log, ready in (
                (mooncake_master_command(rpc, metrics), "mooncake_master.log", "master_key_count"),
                (mooncake_store_command(f"127.0.0.1:{rpc}", client, segment_mb << 20), "mooncake_store.log",
                 "master_total_capacity_bytes")):
            procs.append(subprocess.Popen(command, stdout=open(log_dir / log, "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
            deadline = time.monotonic() + 60
            while _metric(metrics, ready) <= (0 if ready == "master_total_capacity_bytes" else -1):
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Mooncake store did not come up; see {log_dir / log}")
                time.sleep(0.3)
        yield f"127.0.0.1:{rpc}", metrics
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--segment-mb", type=int, default=2048, help="the Mooncake store's memory")
    args, replay_args = parser.parse_known_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)   # each pair names its own directory
    scratch = Path(tempfile.mkdtemp(prefix="replay-storage-"))
    try:
        with mooncake_store(out, args.segment_mb) as (master, metrics_port):
            def file_store(name: str) -> str:
                config = json.dumps({"file_storage_path": str(scratch / name)}, separators=(",", ":"))
                return f"--hicache-storage-backend file --hicache-storage-backend-extra-config '{config}'"

            mooncake = json.dumps(mooncake_extra_config(master, metrics_port), separators=(",", ":"))
            mooncake = f"--hicache-storage-backend mooncake --hicache-storage-backend-extra-config '{mooncake}'"
            servers = []
            for label, kind, storage in (("stock-file", "stock", file_store("stock")),
                                         ("tr-file", "tail_replay", file_store("tail_replay")),
                                         ("tr-mooncake", "tail_replay", mooncake)):
                servers += [f"{label}-1={kind} {COMMON} {storage}", f"{label}-2={kind} {COMMON} {storage}"]
            return replay_main([*REPLAY, "--servers", *servers, "--baseline", "stock-file-2", "--out", str(out),
                                *replay_args])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
