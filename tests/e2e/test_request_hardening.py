"""Serving hardening against live servers: malformed request fields are that request's HTTP 400,
overrides the server has no room for are refused, refused flag combinations stop the start-up
with one clear line, the summary line is logged, and the plain-SGLang plugin path works.

Two servers, booted side by side for the module:
- "pure" (patched launcher): Tail-Replay with `keep_checkpoints: false`, so the state pool holds
  one slot per running request (2 here), and 64-token prefill chunks. Without the refusal, a
  single request overriding `keep_checkpoints: true` with a prompt longer than one chunk crashed
  this server (measured with 100-600-token prompts): at the chunk boundary the request stores a
  checkpoint into the tree, which needs a fresh state slot, and finds none ->
  `AssertionError: Can not alloc mamba cache` in the scheduler (docs/gpu_deployment.md).
  It also runs streaming sessions, and audits and repairs every approximate answer (its own
  background runs). SGLang's strict idle pool check is on (its default): a leaked KV slot raises
  in the scheduler.
- "plugin": SGLang's own launcher (`python -m sglang.launch_server`) with the extension coming
  only from its `sglang.srt.plugins` entry point; see `PluginServer`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from eval.harness import ServerProcess, start_servers, stop_servers
from sglang_ext.env import PATCH_MODE_VAR, TAIL_REPLAY_CONFIG_VAR
from sglang_ext.launcher import CPU_DEFAULTS
from sglang_ext.tail_replay import DEFAULTS, user_settings
from tests.e2e.serving import metric_total, random_prompt, sanity_check_seconds, wait_for_idle_check

CONFIG = {"budget": 1 / 16, "min_replay_tokens": 1, "min_match_tokens": 16}
#: the pure server also audits and repairs every approximate answer (its own background runs)
PURE_CONFIG = {**CONFIG, "keep_checkpoints": False, "audit_rate": 1.0, "repair": True}
SLOTS = 2
CHUNK = 64
#: above the CPU default (0.1): SGLang measures free host memory before and after loading the
#: weights, and other processes allocating meanwhile on a shared machine must not fail the boot
#: (the pools are capped by --max-total-tokens / --max-mamba-cache-size anyway)
MEM = ["--mem-fraction-static", "0.5"]
LONG = 3 * CHUNK + 8     # a prompt spanning three prefill chunks

#: a `sitecustomize` for the plugin server's processes (every Python process reads it at start):
#: applies ONLY the CPU patch set, the stand-in for a GPU machine's own kernels, which must come
#: before SGLang imports sgl_kernel (earlier than any plugin runs). No extension seam is applied
#: here, and nothing else in these processes registers the tail_replay backend or applies a seam.
SITECUSTOMIZE = '''
import os
if os.environ.get("SGLANG_EXT_TEST_CPU_BOOTSTRAP") == "1":
    from sglang_ext.patches import CPU_PATCHES, apply_cpu_patches
    assert apply_cpu_patches() == list(CPU_PATCHES)   # no extension seam from here
'''


class PluginServer(ServerProcess):
    """`python -m sglang.launch_server` (SGLang's launcher, not `sglang-ext serve`) with the
    Tail-Replay config in `SGLANG_EXT_TAIL_REPLAY_CONFIG` and no `SGLANG_EXT_PATCH_MODE`.

    What it proves: on SGLang's own launch path, the installed `sglang.srt.plugins` entry point
    (`sglang_ext.plugin:register`) alone makes `--radix-cache-backend tail_replay` work end to end
    (its hook on `ServerArgs.resolve_once` validates the config in the main process, applies the
    extension's seams there and hands the mode to the scheduler and detokenizer it spawns), and
    request checks and the summary line behave as under the launcher.
    What it does not prove: `sglang serve` itself on a GPU. On this CPU machine the CPU patch set
    must be applied before SGLang imports `sgl_kernel`, which is before plugins load, so a
    `sitecustomize` (SITECUSTOMIZE) applies it, and the CPU defaults the launcher would add are
    passed as flags. SGLang's GPU kernels, CUDA graphs and the overlap scheduler are not run.
    """

    boot_dir: Path | None = None

    def command(self) -> list[str]:
        cpu_flags = [x for flag, value in CPU_DEFAULTS.items() if flag not in self.extra_args
                     for x in ([flag] if value is None else [flag, value])]
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", "127.0.0.1", "--port", str(self.port), *cpu_flags, *self.extra_args]

    def launch(self) -> PluginServer:
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=plugin_env(self.boot_dir, CONFIG))
        return self


def plugin_env(boot_dir: Path, config) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != PATCH_MODE_VAR}
    root = str(Path(__file__).resolve().parents[2])
    return {**environ, "PYTHONPATH": os.pathsep.join([str(boot_dir), root]), "OMP_NUM_THREADS": "1",
            "SGLANG_EXT_TEST_CPU_BOOTSTRAP": "1", "SGLANG_USE_CPU_ENGINE": "1",
            TAIL_REPLAY_CONFIG_VAR: config if isinstance(config, str) else json.dumps(config)}


@pytest.fixture(scope="module")
def boot_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin_boot")
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory, boot_dir):
    logs = tmp_path_factory.mktemp("hardening_logs")
    model = str(tiny_model_factory("qwen3-next"))
    pure = ServerProcess(model, ["--dtype", "float32", "--radix-cache-backend", "tail_replay",
                                 "--tail-replay-config", json.dumps(PURE_CONFIG),
                                 "--chunked-prefill-size", str(CHUNK), "--max-mamba-cache-size", str(SLOTS),
                                 "--max-running-requests", str(SLOTS), "--enable-streaming-session", *MEM],
                         log_path=logs / "pure.log")
    plugin = PluginServer(model, ["--dtype", "float32", "--radix-cache-backend", "tail_replay",
                                  "--chunked-prefill-size", str(CHUNK), *MEM], log_path=logs / "plugin.log")
    plugin.boot_dir = boot_dir
    procs = {"pure": pure, "plugin": plugin}
    start_servers(list(procs.values()))
    try:
        yield procs
    finally:
        stop_servers(list(procs.values()))


def post(server, sampling_params, ids=(1, 2, 3), **extra):
    return requests.post(f"{server.url}/generate", timeout=120, json={
        "input_ids": list(ids), "sampling_params": {"max_new_tokens": 1, **sampling_params}, **extra})


def still_serving(server) -> bool:
    result = post(server, {"temperature": 0}, ids=random_prompt(LONG, seed=77))
    return result.status_code == 200 and result.json()["meta_info"]["completion_tokens"] == 1


@pytest.mark.parametrize("custom, needle", [
    ("x", "sampling_params.custom_params must be a JSON object, got str"),
    (["x"], "sampling_params.custom_params must be a JSON object, got list"),
    (7, "sampling_params.custom_params must be a JSON object, got int"),
    ({"tail_replay": "x"}, "sampling_params.custom_params['tail_replay'] must be a JSON object, got str"),
    ({"tail_replay": [0.1]}, "sampling_params.custom_params['tail_replay'] must be a JSON object, got list"),
    ({"tail_replay": {"window": 3}}, "'window': unknown key"),
    ({"tail_replay": {"min_match_tokens": 3.5}}, "'min_match_tokens': has the wrong type"),
    ({"tail_replay": {"budget": -1}}, "'budget': must be in [0, 1]"),
    ({"tail_replay": {"max_replay_tokens": 0, "min_replay_tokens": 5}}, "'max_replay_tokens': must be >="),
])
def test_malformed_request_field_is_a_400_naming_it(servers, custom, needle):
    server = servers["pure"]
    resp = post(server, {"custom_params": custom})
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    assert still_serving(server)


def test_malformed_field_in_a_stream_or_a_batch(servers):
    server = servers["pure"]
    stream = post(server, {"custom_params": "x"}, stream=True)
    assert stream.status_code == 200        # SGLang's streaming answer: an error event, then [DONE]
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400
    assert "sampling_params.custom_params must be a JSON object" in events[-1]["error"]["message"]
    batch = requests.post(f"{server.url}/generate", timeout=120, json={
        "input_ids": [[1, 2, 3], [4, 5, 6]],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 1, "custom_params": [1]}]})
    assert batch.status_code == 400 and "custom_params must be a JSON object, got list" in batch.text
    assert still_serving(server)


#: the server's own bookkeeping, as a client might send it: (custom_params, what the 400 says)
SERVER_ONLY_FIELDS = [
    ({"tail_replay": {"audit_of": "tail-replay-audit-0"}},
     "'audit_of': is set by the server on its own background runs; a request cannot set it"),
    ({"tail_replay": {"repair_of": "tail-replay-repair-0"}},
     "'repair_of': is set by the server on its own background runs; a request cannot set it"),
    ({"tail_replay": {"repair_kind": "shared_state"}},
     "'repair_kind': is set by the server on its own background runs; a request cannot set it"),
    ({"tail_replay_background": {"repair_of": "x", "repair_kind": "answer"}},
     "custom_params['tail_replay_background'] is set by the server on its own background runs"),
    ({"tail_replay": {"audit": True}}, "'audit': is refused on this server: per-request audit and repair are off "
                                       "(server config key 'allow_request_audit_repair' is false)"),
    ({"tail_replay": {"repair": True}}, "'repair': is refused on this server: per-request audit and repair are off "
                                        "(server config key 'allow_request_audit_repair' is false)"),
    ({"tail_replay": {"repair_shared": True}}, "'repair_shared': true is refused on this server: per-request audit "
                                               "and repair are off (server config key 'allow_request_audit_repair' "
                                               "is false)"),
]
#: the Tail-Replay counters a client's request moves (traffic, repairs, audits)
COUNTERS = ("sglang_ext:tail_replay_requests_total", "sglang_ext:tail_replay_repairs_total",
            "sglang_ext:tail_replay_audits_total", "sglang_ext:tail_replay_hits_total")


def counters(server) -> dict:
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    return {**{name: metric_total(text, name) for name in COUNTERS},
            "answer_repairs": metric_total(text, "sglang_ext:tail_replay_repairs_total", 'kind="answer"')}


def settled_counters(server, quiet_s: float = 2.0, timeout_s: float = 60.0) -> dict:
    """The counters once no background run of an earlier request moves them (unchanged for quiet_s)."""
    deadline = time.monotonic() + timeout_s
    last = counters(server)
    while True:
        time.sleep(quiet_s)
        now = counters(server)
        if now == last:
            return now
        assert time.monotonic() < deadline, "the counters kept moving"
        last = now


@pytest.mark.parametrize("custom, needle", SERVER_ONLY_FIELDS)
def test_server_bookkeeping_from_a_client_is_a_400_naming_the_field(servers, custom, needle):
    """Fields the server marks its own background runs with (or that buy one: `audit` / `repair`,
    off unless the server's config allows them) are refused from a client, single, streamed or
    in a batch; no counter moves, and the server goes on serving."""
    server = servers["pure"]
    ids = random_prompt(LONG, seed=41)
    before = settled_counters(server)
    resp = post(server, {"custom_params": custom}, ids=ids)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    stream = post(server, {"custom_params": custom}, ids=ids, stream=True)
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400 and needle in events[-1]["error"]["message"]
    batch = requests.post(f"{server.url}/generate", timeout=120, json={
        "input_ids": [ids, ids[:-1]],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 1, "custom_params": custom}]})
    assert batch.status_code == 400 and needle in batch.text
    assert counters(server) == before   # refused before the scheduler: not counted, nothing sent
    assert still_serving(server)


def test_a_request_may_turn_shared_state_repair_off(servers):
    """`repair_shared: false` only saves a background run: allowed on any server (the fuzzer's
    workloads send it), where `true` needs `allow_request_audit_repair` (above)."""
    server = servers["pure"]
    resp = post(server, {"temperature": 0, "custom_params": {"tail_replay": {"repair_shared": False}}},
                ids=random_prompt(LONG, seed=45))
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == 1


def test_server_runs_its_own_background_runs_and_counts_them(servers):
    """The server's own runs still carry their mark (out of band) on a server whose clients cannot
    send it: the pure server audits (`audit_rate: 1`) and repairs (`repair: true`) every approximate
    answer; an approximate hit's audit reference run and its repair run are counted as an audit and
    a repair, and not as traffic."""
    server = servers["pure"]
    document = random_prompt(3 * CHUNK, seed=43)
    before = settled_counters(server)
    assert post(server, {"temperature": 0}, ids=document + [5]).status_code == 200
    hit = post(server, {"temperature": 0}, ids=document + random_prompt(24, seed=44))
    assert hit.status_code == 200, hit.text
    summary = hit.json()["meta_info"]["cached_tokens_details"]["tail_replay"]
    assert summary["kind"] == "approximate" and summary["exact"] is False and summary["audit"] == "sampled"
    after = settled_counters(server)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    assert delta["sglang_ext:tail_replay_requests_total"] == 2    # the two requests; no background run
    assert delta["sglang_ext:tail_replay_audits_total"] == 1      # the hit's reference run compared
    assert delta["sglang_ext:tail_replay_repairs_total"] >= 1     # the hit's repair run finished ...
    assert after["answer_repairs"] - before["answer_repairs"] == 1   # ... once
    assert not re.search(r"Traceback|background run .* failed|found no served distribution", server.log_text())


def test_recompute_in_a_streaming_session_leaks_no_kv_slot(servers):
    """`kv_mode: "recompute"` in a streaming session. The turn's prefill spans three chunks past its
    replay start, so it claims its recomputed tail [P, L) as its own at the chunk boundaries; the
    finished turn's row goes to the session, not through the release that frees those slots.
    Before the fix the slots sat below the session row's protected length, seen by neither the
    session's release nor SGLang's pool accounting: the strict idle check (SGLang's default)
    raised "memory leak detected" and the scheduler died. Now they are freed when the row goes to
    the session, which then reads the tree's exact KV there: the idle check stays clean with the
    session open, after its next turn and after it closes."""
    server = servers["pure"]
    document = random_prompt(3 * CHUNK, seed=51)
    assert post(server, {"temperature": 0}, ids=document + [7]).status_code == 200   # the document's KV
    opened = requests.post(f"{server.url}/open_session", timeout=60,
                           json={"capacity_of_str_len": 8192, "streaming": True})
    assert opened.status_code == 200, opened.text
    session = {"id": opened.json()}
    recompute = {"temperature": 0, "max_new_tokens": 4,
                 "custom_params": {"tail_replay": {"kv_mode": "recompute", "budget": 0.5}}}
    turn = post(server, recompute, ids=document + random_prompt(40, seed=52), session_params=session)
    assert turn.status_code == 200, turn.text
    summary = turn.json()["meta_info"]["cached_tokens_details"]["tail_replay"]
    assert summary["kind"] == "approximate" and summary["replayed_tokens"] == 3 * CHUNK // 2   # [96, 192) its own
    wait_for_idle_check(server, sanity_check_seconds(server))          # the session holds the row
    follow = post(server, {"temperature": 0, "max_new_tokens": 4}, ids=random_prompt(8, seed=53),
                  session_params=session)
    assert follow.status_code == 200, follow.text
    context = 3 * CHUNK + 40 + turn.json()["meta_info"]["completion_tokens"] + 8   # the session's whole context
    assert follow.json()["meta_info"]["prompt_tokens"] == context
    wait_for_idle_check(server, sanity_check_seconds(server))
    closed = requests.post(f"{server.url}/close_session", timeout=60, json={"session_id": session["id"]})
    assert closed.status_code == 200, closed.text
    wait_for_idle_check(server, sanity_check_seconds(server))
    assert still_serving(server)
    assert not re.search(r"memory leak|Traceback", server.log_text(), re.I)


def test_recompute_in_a_streaming_session_aborted_mid_decode_leaks_no_kv_slot(servers):
    """The same turn aborted while it decodes: the session gives the row back and it is released
    as any request's, its own recomputed tail included; the idle check stays clean."""
    server = servers["pure"]
    document = random_prompt(3 * CHUNK, seed=61)
    assert post(server, {"temperature": 0}, ids=document + [7]).status_code == 200
    session_id = requests.post(f"{server.url}/open_session", timeout=60,
                               json={"capacity_of_str_len": 8192, "streaming": True}).json()
    recompute = {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True,
                 "custom_params": {"tail_replay": {"kv_mode": "recompute", "budget": 0.5}}}
    rid = f"hardening-abort-{session_id}"
    with requests.post(f"{server.url}/generate", timeout=120, stream=True, json={
            "input_ids": document + random_prompt(40, seed=62), "sampling_params": recompute, "stream": True,
            "rid": rid, "session_params": {"id": session_id}}) as turn:
        lines = turn.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: {"))
        assert json.loads(first[6:])["meta_info"]["cached_tokens_details"]["tail_replay"]["replayed_tokens"] == 96
        assert requests.post(f"{server.url}/abort_request", timeout=60, json={"rid": rid}).status_code == 200
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    finish = events[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and events[-1]["meta_info"]["completion_tokens"] < 1000
    wait_for_idle_check(server, sanity_check_seconds(server))
    assert requests.post(f"{server.url}/close_session", timeout=60, json={"session_id": session_id}).status_code == 200
    wait_for_idle_check(server, sanity_check_seconds(server))
    assert still_serving(server)
    assert not re.search(r"memory leak|Traceback", server.log_text(), re.I)


def test_keep_checkpoints_override_is_refused_without_checkpoints(servers):
    server = servers["pure"]
    resp = post(server, {"custom_params": {"tail_replay": {"keep_checkpoints": True}}},
                ids=random_prompt(LONG, seed=5))
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "'keep_checkpoints': true is refused" in message and "keep_checkpoints false" in message
    # the same long prompt without the override, and a harmless override, are served
    assert post(server, {"custom_params": {"tail_replay": {"keep_checkpoints": False, "budget": 0.5}}},
                ids=random_prompt(LONG, seed=5)).status_code == 200
    assert still_serving(server)
    assert not re.search(r"Can not alloc|Traceback", server.log_text())


def test_keep_checkpoints_override_is_served_on_a_server_with_checkpoints(servers):
    server = servers["plugin"]
    ids = random_prompt(LONG, seed=6)
    first = post(server, {"temperature": 0, "custom_params": {"tail_replay": {"keep_checkpoints": True}}}, ids=ids)
    assert first.status_code == 200, first.text
    again = post(server, {"temperature": 0}, ids=ids + [9, 10])
    assert again.json()["meta_info"]["cached_tokens_details"]["tail_replay"]["kind"] == "exact_checkpoint"


def test_summary_line_names_the_config_in_force(servers):
    pure = [line for line in servers["pure"].log_text().splitlines() if "Tail-Replay config in force" in line]
    assert len(pure) == 1
    assert "budget=0.0625 min_replay_tokens=1" in pure[0] and "keep_checkpoints=False kv_mode='exact'" in pure[0]
    assert "per-request overrides refused: keep_checkpoints=true (it runs with" in pure[0]
    plugin = [line for line in servers["plugin"].log_text().splitlines() if "Tail-Replay config in force" in line]
    assert len(plugin) == 1 and "keep_checkpoints=True" in plugin[0] and plugin[0].endswith("refused: none")


def test_plain_sglang_launch_gets_tail_replay_from_the_plugin_alone(servers):
    # Only the plugin can have registered the backend and the seams used below (SGLANG_EXT_PATCH_MODE
    # unset, the bootstrap applies the CPU set only); SGLang logs nothing of its plugin loading in
    # the main process before its logger is configured, so the behaviour is the evidence.
    server = servers["plugin"]
    document = random_prompt(320, seed=8)
    post(server, {"custom_params": {"tail_replay": {"keep_checkpoints": False}}}, ids=document + [3])
    result = post(server, {"temperature": 0}, ids=document + random_prompt(40, seed=9)).json()
    summary = result["meta_info"]["cached_tokens_details"]["tail_replay"]
    assert {k: summary[k] for k in ("kind", "matched_tokens", "reused_tokens", "replayed_tokens")} == {
        "kind": "approximate", "matched_tokens": 320, "reused_tokens": 300, "replayed_tokens": 20}
    assert 0 < summary["state_bound"] <= 1   # the gate seams too
    metrics = requests.get(f"{server.url}/metrics", timeout=30).text
    assert 'sglang_ext:tail_replay_hits_total{kind="approximate"}' in metrics
    bad = post(server, {"custom_params": {"tail_replay": {"budget": 3}}})
    assert bad.status_code == 400 and "'budget': must be in [0, 1]" in bad.text


def test_bad_env_config_on_the_plain_sglang_path_is_one_clear_error(tiny_model_factory, boot_dir):
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path",
                           str(tiny_model_factory("qwen3-next")), "--radix-cache-backend", "tail_replay",
                           "--device", "cpu", "--attention-backend", "torch_native"],
                          capture_output=True, text=True, timeout=300,
                          env=plugin_env(boot_dir, '{"bugdet": 0.1}'))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "'bugdet'" in line]
    known = sorted(user_settings(DEFAULTS))   # every server config key (knob defaults and server keys)
    assert {"budget", "repair_shared", "allow_request_audit_repair", "tolerance"} <= set(known)
    assert errors == [f"sglang_ext: error: tail-replay config key 'bugdet': unknown key; known keys: {known}"]
    assert "Traceback" not in proc.stderr


def test_quantized_kv_with_exact_mode_is_refused_at_start_up(tiny_model_factory):
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "serve", "--model-path",
                           str(tiny_model_factory("qwen3-next")), "--radix-cache-backend", "tail_replay",
                           "--kv-cache-dtype", "fp8_e4m3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--kv-cache-dtype fp8_e4m3" in proc.stderr and "kv_mode 'exact'" in proc.stderr
    assert "Traceback" not in proc.stderr
