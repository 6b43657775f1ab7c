"""Tail-Replay on SGLang's storage tier (HiCache L3, the file backend) in the real CPU server
.

Two Tail-Replay servers share one storage directory (`--hicache-storage-backend file`): the writer
computes prefixes, HiCache writes them through to its host tier and on to storage; the reader has
never seen them and prefetches them from storage (SGLang's prefetch, `wait_complete` so that an idle
server does not cut it short). Storage holds attention KV only, of strictly exact nodes only: the
reader rebuilds the linear state by replay. Both run `keep_checkpoints: false` (the tree holds
attention KV only: every hit is a replay plan, on the writer's device tier as on the reader).

- A stored prefix is served on the reader with the plan, tokens and logprobs the writer serves the
  same request with from its device tier.
- An `exactness: "exact"` request that replays the stored KV equals transformers' full prefill.
- KV computed after an approximate replay never reaches storage (its pages carry no provenance, and
  the reader would read them as exact): the reader's hit stops where the writer's exact KV ends.
- Stored prefixes are kept apart per tenant (`extra_key`): SGLang seeds the storage keys with it.
- The same over the Mooncake store (its master and a standalone client holding its memory).

SGLang's strict idle pool check runs on both servers on the way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest
import requests

from eval.harness import ServerProcess, start_servers, stop_servers
from eval.reference import greedy_reference, load_reference_model
from sglang_ext.cluster import free_ports, mooncake_extra_config, mooncake_master_command, mooncake_store_command
from tests.e2e.serving import LOGPROB_ATOL, STRICT_CHECK_ENV, assert_matches_reference, greedy, random_prompt, sanity_check_seconds, wait_for_idle_check

PROMPT, NEW = 300, 6
ARGS = ["--dtype", "float32", "--radix-cache-backend", "tail_replay", "--enable-hierarchical-cache", "--enable-streaming-session",
        "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
        "--max-total-tokens", "2048", "--max-mamba-cache-size", "8",
        "--tail-replay-config", json.dumps({"keep_checkpoints": False})]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3-next")


class FileStore:
    """SGLang's file backend: one file per page (the CPU server's page size is 1)."""

    def __init__(self, path):
        self.path = path

    def server_args(self) -> tuple[list[str], dict[str, str]]:
        return ["--hicache-storage-backend", "file"], {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.path)}

    def stored(self) -> int:
        return len(os.listdir(self.path))


class MooncakeStore:
    """The Mooncake store (TCP transport, no metadata server): its master and a standalone client
    holding its memory run for the module; the servers are clients that lend it none."""

    def __init__(self, logs):
        self.rpc_port, self.metrics_port, client_port = free_ports(3)
        self.procs = [self.spawn(mooncake_master_command(self.rpc_port, self.metrics_port), logs / "mooncake_master.log")]
        self.wait_for(lambda: self.metric("master_key_count") >= 0)          # the master serves
        self.procs.append(self.spawn(mooncake_store_command(f"127.0.0.1:{self.rpc_port}", client_port, 128 << 20),
                                     logs / "mooncake_store.log"))
        self.wait_for(lambda: self.metric("master_total_capacity_bytes") > 0)   # the memory is mounted

    @staticmethod
    def spawn(command, log) -> subprocess.Popen:
        return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def metric(self, name: str) -> float:
        try:
            text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        except requests.RequestException:
            return -1.0
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(found.group(1)) if found else -1.0

    def wait_for(self, ready, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert all(p.poll() is None for p in self.procs), "the Mooncake master or store client exited"
            assert time.monotonic() < deadline, "the Mooncake store did not come up"
            time.sleep(0.3)

    def server_args(self) -> tuple[list[str], dict[str, str]]:
        config = mooncake_extra_config(f"127.0.0.1:{self.rpc_port}", self.metrics_port)
        return ["--hicache-storage-backend", "mooncake",
                "--hicache-storage-backend-extra-config", json.dumps(config)], {}

    def stored(self) -> int:
        """Objects the master holds (at least one per stored page)."""
        return int(self.metric("master_key_count"))

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_pair(model_dir, store, logs) -> list[ServerProcess]:
    args, env = store.server_args()
    env = {**STRICT_CHECK_ENV, **env}
    pair = [ServerProcess(str(model_dir), ARGS + args, log_path=logs / f"{role}.log", env=env)
            for role in ("writer", "reader")]
    return start_servers(pair)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return FileStore(tmp_path_factory.mktemp("hicache_file_store"))


@pytest.fixture(scope="module")
def servers(model_dir, store, tmp_path_factory):
    """(writer, reader), side by side over one storage directory."""
    pair = start_pair(model_dir, store, tmp_path_factory.mktemp("tr_storage_logs"))
    try:
        yield tuple(pair)
    finally:
        stop_servers(pair)


@pytest.fixture(scope="module")
def mooncake(model_dir, tmp_path_factory):
    """(writer, reader, store) over one Mooncake store."""
    logs = tmp_path_factory.mktemp("tr_mooncake_logs")
    store = MooncakeStore(logs)
    try:
        pair = start_pair(model_dir, store, logs)
        try:
            yield (*pair, store)
        finally:
            stop_servers(pair)
    finally:
        store.stop()


def details(result) -> dict:
    return result["meta_info"].get("cached_tokens_details") or {}


def plan(result) -> dict:
    summary = dict(details(result)["tail_replay"])
    for key in ("bound", "state_bound", "state_bound_per_layer"):
        summary.pop(key, None)
    return summary


def logprobs(result) -> list[float]:
    return [x[0] for x in result["meta_info"]["output_token_logprobs"]]


def write_and_wait(server, store, ids, new_pages: int | None = None, **kwargs) -> dict:
    """Serve `ids` on the writer, then wait until `new_pages` (default: the prompt's) more pages are
    in storage (one file per page: the CPU server's page size is 1) and no more arrive."""
    before = store.stored()
    new_pages = len(ids) if new_pages is None else new_pages
    result = server.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW, "temperature": 0},
                             return_logprob=True, **kwargs)
    deadline, last, steady_since = time.monotonic() + 60, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = store.stored()
        if now != last:
            last, steady_since = now, time.monotonic()
        elif now >= before + new_pages and time.monotonic() - steady_since > 1.0:
            return result
        time.sleep(0.2)
    raise AssertionError(f"storage got {store.stored() - before} of {new_pages} pages in 60 s")


def other_than(token: int, candidate: int) -> int:
    return candidate if candidate != token else candidate + 1


def check_stored_prefix_is_served_as_the_writers_device_hit(writer, reader, store, seed: int) -> None:
    shared = random_prompt(PROMPT, seed=seed)
    first = write_and_wait(writer, store, shared)
    ids = shared + [other_than(first["output_ids"][0], 7)] + random_prompt(7, seed=seed + 1)   # branches at PROMPT
    device_hit = greedy(writer, ids, NEW)
    storage_hit = greedy(reader, ids, NEW)

    assert plan(device_hit)["kind"] == "approximate" and plan(device_hit)["matched_tokens"] == PROMPT
    assert plan(storage_hit) == plan(device_hit)               # the same plan over stored KV
    assert details(storage_hit)["device"] == details(storage_hit)["host"] == 0
    assert details(storage_hit)["storage"] == plan(storage_hit)["reused_tokens"] > 0
    assert storage_hit["output_ids"] == device_hit["output_ids"]
    assert logprobs(storage_hit) == logprobs(device_hit)


def check_clean_pools(servers) -> None:
    for server in servers:
        before = sanity_check_seconds(server)
        greedy(server, random_prompt(40, seed=71), NEW)
        wait_for_idle_check(server, before)
        assert server.proc.poll() is None
        log = server.log_text()
        assert "memory leak" not in log and "Traceback" not in log
    assert "HiCache prefetch success" in servers[1].log_text()


def test_a_stored_prefix_is_served_as_the_writers_device_hit(servers, store):
    check_stored_prefix_is_served_as_the_writers_device_hit(*servers, store, seed=31)


def test_a_server_holding_part_of_a_prefix_fetches_the_rest_from_storage(servers, store):
    """SGLang's prefetch starts where the tree's own match ends (its node and hash chain), not where
    a plan's prefix does (up to W tokens short of it): else the stored pages are never found. (SGLang
    fetches at least 256 tokens, its default prefetch threshold.)"""
    writer, reader = servers
    held, length = 200, 600
    shared = random_prompt(length, seed=81)
    greedy(reader, shared[:held] + random_prompt(8, seed=82), NEW)   # the reader holds [0, 200)
    first = write_and_wait(writer, store, shared, new_pages=length - held)
    result = greedy(reader, shared + [other_than(first["output_ids"][0], 15)] + random_prompt(7, seed=83), NEW)
    assert plan(result)["matched_tokens"] == length            # its own 200, and 400 from storage
    assert details(result)["storage"] > 0


def test_an_exact_request_over_stored_kv_equals_full_prefill(servers, store, model_dir):
    """Storage holds no state, so an exact plan over stored KV replays it all (`budget: 1.0`), once
    the KV is on the reader's device tier (a host-tier plan loads only what makes the prefix longer,
    and an exact replay's prefix is 0): the stored bytes are an exact computation."""
    writer, reader = servers
    shared = random_prompt(PROMPT, seed=41)
    first = write_and_wait(writer, store, shared)
    branch = other_than(first["output_ids"][0], 9)
    fetched = greedy(reader, shared + [branch] + random_prompt(7, seed=42), NEW)
    assert details(fetched)["storage"] > 0 and plan(fetched)["matched_tokens"] == PROMPT
    ids = shared + [other_than(branch, branch + 1)] + random_prompt(7, seed=43)
    result = reader.generate(input_ids=ids, sampling_params={
        "max_new_tokens": NEW, "temperature": 0,
        "custom_params": {"tail_replay": {"exactness": "exact", "budget": 1.0}}}, return_logprob=True)
    summary = details(result)["tail_replay"]
    assert summary["exact"] is True and summary["kind"] == "exact_replay" and summary["matched_tokens"] == PROMPT
    assert_matches_reference(result, greedy_reference(load_reference_model(model_dir), ids, NEW), atol=LOGPROB_ATOL)


def test_kv_computed_after_an_approximate_replay_stays_out_of_storage(servers, store):
    writer, reader = servers
    shared = random_prompt(PROMPT, seed=51)
    first = write_and_wait(writer, store, shared)
    turn = [other_than(first["output_ids"][0], 11)] + random_prompt(99, seed=52)
    approximate = greedy(writer, shared + turn, NEW)           # its KV [PROMPT, ...) has a bound > 0
    assert plan(approximate)["kind"] == "approximate" and details(approximate)["tail_replay"]["exact"] is False
    time.sleep(3)                                              # a write-through would have landed by now
    result = greedy(reader, shared + turn + random_prompt(8, seed=53), NEW)
    assert plan(result)["matched_tokens"] == PROMPT            # the stored prefix ends at the exact KV


def test_stored_prefixes_are_kept_apart_per_tenant(servers, store):
    writer, reader = servers
    shared = random_prompt(PROMPT, seed=61)
    first = write_and_wait(writer, store, shared, extra_key="tenant-a")
    ids = shared + [other_than(first["output_ids"][0], 13)] + random_prompt(7, seed=62)

    def send(tenant):
        return reader.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW, "temperature": 0},
                               extra_key=tenant)

    assert plan(send("tenant-b"))["matched_tokens"] == 0       # another tenant's pages are not its
    assert plan(send("tenant-a"))["matched_tokens"] == PROMPT


def test_a_streaming_session_continues_on_a_server_with_storage(servers):
    """A session's second turn matches its slot's stand-in node; the storage prefetch used to ask
    the tree about it and kill the scheduler (`patches/shared/session_storage_prefetch.py`). Both turns
    answer, the second continues the first's context, and the server stays up."""
    writer, _ = servers
    sid = "storage-session"
    requests.post(f"{writer.url}/open_session", json={"capacity_of_str_len": 1 << 16, "session_id": sid,
                                                      "streaming": True}, timeout=60).raise_for_status()
    try:
        turns = []
        for seed in (71, 72, 73):
            resp = requests.post(f"{writer.url}/generate", timeout=300, json={
                "input_ids": random_prompt(40, seed=seed), "session_params": {"id": sid},
                "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
            assert resp.status_code == 200, resp.text[:300]
            turns.append(resp.json())
        assert [t["meta_info"]["prompt_tokens"] for t in turns] == [40, 40 + NEW + 40, 2 * (40 + NEW) + 40]
    finally:
        requests.post(f"{writer.url}/close_session", json={"session_id": sid}, timeout=60)
    requests.get(f"{writer.url}/health_generate", timeout=120).raise_for_status()


def test_both_servers_end_with_clean_pools(servers):
    check_clean_pools(servers)


def test_the_mooncake_store_serves_a_stored_prefix_as_the_writers_device_hit(mooncake):
    writer, reader, store = mooncake
    check_stored_prefix_is_served_as_the_writers_device_hit(writer, reader, store, seed=91)
    check_clean_pools((writer, reader))
