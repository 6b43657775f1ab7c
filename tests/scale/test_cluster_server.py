"""`sglang-ext cluster` end to end: SGLang's router (smg, cache-aware) in front of two patched
Tail-Replay workers sharing a Mooncake store (`--storage mooncake`: the cluster starts its master
and a client holding its memory),
started by the one command a user runs.

- A conversation's later turns land on the worker that holds its prefix: every turn reuses at
  least the whole previous prompt (`meta_info.cached_tokens`), and both workers take traffic.
- A prefix one worker computed is served to the other from the store.
- A worker whose port is taken when it starts is started again on a fresh port.
- SIGTERM to the command stops the router, every worker and the store (their ports close) and it
  exits 0.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests

from sglang_ext.cluster import free_port

CONVERSATIONS, TURNS, FIRST, STEP, NEW = 4, 3, 200, 60, 4
READY = re.compile(r"router (http://\S+) \(policy (\S+)\) -> workers (.+); logs in .*; storage: Mooncake store, "
                   r"master 127.0.0.1:(\d+) \(metrics port (\d+)\); router metrics on 127.0.0.1:(\d+)")
PROMPT_TOKENS = re.compile(r"^sglang:prompt_tokens_total\{[^}]*\} (\S+)$", re.M)


def _kill_listeners(ports: list[int]) -> None:
    """Fallback clean-up: end the process group of anything still serving on `ports`."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any(str(p) in cmdline for p in ports) and "--port" in cmdline:
            try:
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster_logs")
    w0, w1 = free_port(), free_port()
    # the router's ports are the cluster's to pick (`--port 0`): one taken before the router binds it
    # (by another server started beside it) is replaced, as a worker's is
    command = [sys.executable, "-m", "sglang_ext", "cluster", "--workers", "2", "--policy", "cache_aware",
               "--port", "0", "--worker-ports", f"{w0},{w1}",
               "--log-dir", str(logs), "--storage", "mooncake", "--storage-segment-mb", "64",
               "--", "--model-path", str(tiny_model_factory("qwen3-next")),
               "--radix-cache-backend", "tail_replay", "--dtype", "float32"]
    out = open(logs / "command.log", "w+")
    squatter = socket.socket()   # holds worker 1's port: the cluster must start it on a fresh one
    squatter.bind(("127.0.0.1", w1))
    squatter.listen()
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ports = [w0, w1]
    try:
        deadline, match = time.monotonic() + 600, None
        while match is None:
            assert proc.poll() is None, f"cluster exited ({proc.returncode}): {(logs / 'command.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "cluster not ready in 600 s"
            time.sleep(1)
            match = READY.search((logs / "command.log").read_text())
        squatter.close()
        workers = match.group(3).split(", ")
        metrics_port = int(match.group(6))
        ports += [int(url.rsplit(":", 1)[1]) for url in [*workers, match.group(1)]] + [metrics_port]
        master = (int(match.group(4)), int(match.group(5)))
        ports += list(master)
        yield {"proc": proc, "url": match.group(1), "policy": match.group(2), "workers": workers,
               "requested": [f"http://127.0.0.1:{w0}", f"http://127.0.0.1:{w1}"], "logs": logs, "master": master,
               "router_metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        squatter.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        _kill_listeners(ports)
        out.close()


def _generate(url: str, ids: list[int]) -> dict:
    resp = requests.post(f"{url}/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()


def _prompt_tokens(worker_url: str) -> float:
    text = requests.get(f"{worker_url}/metrics", timeout=30).text
    return sum(float(v) for v in PROMPT_TOKENS.findall(text))


def test_a_taken_worker_port_is_replaced(cluster):
    assert cluster["workers"][0] == cluster["requested"][0]
    assert cluster["workers"][1] != cluster["requested"][1]


def test_conversations_follow_their_prefix(cluster):
    assert cluster["policy"] == "cache_aware" and len(cluster["workers"]) == 2
    rng = random.Random(3)
    prompts = {c: [rng.randrange(10, 500) for _ in range(FIRST)] for c in range(CONVERSATIONS)}
    for turn in range(TURNS):
        for c, ids in prompts.items():
            out = _generate(cluster["url"], ids)
            cached = out["meta_info"]["cached_tokens"]
            if turn:
                previous = len(ids) - NEW - STEP
                assert cached >= previous, (c, turn, cached, previous, out["meta_info"])
            ids += out["output_ids"] + [rng.randrange(10, 500) for _ in range(STEP)]
    served = [_prompt_tokens(w) for w in cluster["workers"]]
    assert all(s > 0 for s in served), served


def test_the_replay_reads_the_routers_prediction_for_each_request(cluster):
    """One request at a time, the replay reads the router's cache-aware decision around each
    (eval/replay/router.py): a first prompt the router has never seen is predicted cold, and a
    conversation's next turn, which the router sends to the worker holding its previous prompt,
    is predicted to reuse that prompt's share, and is served from the cache."""
    from eval.replay.client import replay_requests
    from eval.replay.router import RouterCounters, prediction_summary
    from eval.replay.tokens import ScaledRequest

    rng = random.Random(11)
    first = [rng.randrange(10, 500) for _ in range(240)]
    second = first + [rng.randrange(10, 500) for _ in range(80)]
    reqs = [ScaledRequest(i, float(i), 0, 0, tuple(ids)) for i, ids in enumerate((first, second))]
    before = RouterCounters.parse(requests.get(cluster["router_metrics"], timeout=10).text)
    records, _ = replay_requests(cluster["url"], reqs, NEW, 1, "router", router_metrics=cluster["router_metrics"])
    assert all(r["ok"] for r in records), records
    cold, warm = (r["router"] for r in records)
    assert cold["branch"] == "expected_wait_fallback" and cold["match_ratio"] < 0.3   # below --cache-threshold
    assert warm["branch"] == "tree_match" and warm["match_ratio"] >= 0.7   # 240 of 320 tokens seen
    assert records[1]["cached_tokens"] >= 192
    after = RouterCounters.parse(requests.get(cluster["router_metrics"], timeout=10).text)
    summary = prediction_summary(records, after.since(before))
    assert summary["decisions"] == 2 and summary["per_request"] == 2


def _stored_objects(metrics_port: int) -> int:
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return int(float(re.search(r"^master_key_count (\S+)$", text, re.M).group(1)))


def test_a_prefix_one_worker_computed_is_served_to_the_other_from_the_store(cluster):
    first, second = cluster["workers"]
    rng = random.Random(5)
    ids = [rng.randrange(10, 500) for _ in range(400)]
    before = _stored_objects(cluster["master"][1])
    _generate(first, ids)
    deadline = time.monotonic() + 60
    while _stored_objects(cluster["master"][1]) < before + len(ids):   # at least one object per page
        assert time.monotonic() < deadline, "the first worker's prefix did not reach the store in 60 s"
        time.sleep(0.5)
    time.sleep(1.0)
    out = _generate(second, ids + [rng.randrange(10, 500) for _ in range(8)])
    assert out["meta_info"]["cached_tokens_details"]["storage"] > 0, out["meta_info"]
    assert out["meta_info"]["cached_tokens_details"]["tail_replay"]["matched_tokens"] >= len(ids)


def test_sigterm_stops_router_workers_and_the_store(cluster):
    proc = cluster["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    for url in [cluster["url"], *cluster["workers"], f"http://127.0.0.1:{cluster['master'][1]}"]:
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{url}/health", timeout=5)


def test_a_worker_that_dies_at_start_stops_the_cluster(tmp_path):
    """A worker that cannot start (an argument SGLang refuses) ends the command with exit 1 and a
    line naming the worker and its log; nothing is left running."""
    ports = [free_port() for _ in range(2)]
    result = subprocess.run(
        [sys.executable, "-m", "sglang_ext", "cluster", "--workers", "2", "--port", "0",
         "--worker-ports", ",".join(map(str, ports)), "--log-dir", str(tmp_path),
         "--", "--model-path", str(tmp_path), "--no-such-sglang-flag"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "sglang-ext cluster: error: worker 0" in result.stderr and "worker-0.log" in result.stderr
    assert "--no-such-sglang-flag" in (tmp_path / "worker-0.log").read_text()
    assert not [p for p in psutil.process_iter(["cmdline"])
                if any(str(port) in (p.info.get("cmdline") or []) for port in ports)]
