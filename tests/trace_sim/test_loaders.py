"""Loaders on tiny files in the real formats, plus the first records of the committed sample of
the real traces (eval/traces) and what the documented replays select from it."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from eval.trace_sim.loaders import (
    SAMPLE_TRACE_ROOT,
    TRACES_ENV,
    KvLoadOptions,
    kv_trace_files,
    load_kv_cache_tester,
    load_mooncake,
)
from eval.trace_sim.simulate import prepare
from eval.trace_sim.trace import NO_BLOCK
from eval.trace_sim.tree import build_node_tree

REPO = Path(__file__).resolve().parents[2]


def _write_jsonl_gz(path: Path, records) -> Path:
    with gzip.open(path, "wt") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def test_mooncake_blocks_are_prefix_chained(tmp_path):
    path = _write_jsonl_gz(tmp_path / "t.jsonl.gz", [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
    ])
    trace = load_mooncake(path)
    assert trace.block_tokens == 512 and trace.n_blocks == 4
    assert trace.requests[1].time == 1.5
    assert list(trace.parent) == [NO_BLOCK, 0, 1, 0]
    assert prepare(trace).infinite_cache_hit_ratio() == 1 / 5


def _conversation(tools: int, system: int, first_local: int):
    prefix = (tools + system) // 64
    base = list(range(first_local, first_local + prefix))
    turn1 = base + [first_local + 100, first_local + 101]
    turn2 = turn1 + [first_local + 102, first_local + 103, first_local + 104]
    return {
        "id": "x", "block_size": 64, "hash_id_scope": "local", "tool_tokens": tools,
        "system_tokens": system,
        "requests": [
            {"t": 0.0, "type": "n", "in": 64 * len(turn1) + 10, "out": 100, "hash_ids": turn1,
             "input_types": ["text"], "output_types": ["thinking", "tool_use"], "stop": "tool_use"},
            {"t": 5.0, "type": "n", "in": 64 * len(turn2) + 3, "out": 20, "hash_ids": turn2,
             "input_types": ["tool_result"], "output_types": ["text"], "stop": "end_turn"},
        ],
    }


def _write_json_gz(path: Path, obj) -> None:
    with gzip.open(path, "wt") as handle:
        json.dump(obj, handle)


def test_kv_cache_tester_shares_the_tools_system_prefix(tmp_path):
    _write_json_gz(tmp_path / "trace_0001.json.gz", _conversation(130, 70, first_local=1))
    _write_json_gz(tmp_path / "trace_0002.json.gz", _conversation(140, 60, first_local=500))
    trace = load_kv_cache_tester(tmp_path, KvLoadOptions(arrival_gap_s=10.0))
    # 3 shared prefix blocks + per conversation 2 + 3 private blocks
    assert trace.n_blocks == 3 + 2 * 5
    assert len(trace.requests) == 4
    tree = build_node_tree(trace)
    assert tree.token_type[0] == "system" and tree.length[0] == 3
    first = [r for r in trace.requests if r.session == 0]
    assert first[1].time - first[0].time == 5.0
    # output of turn 1: (2+3)*64+10+100 tokens -> 6 full blocks cached, 1 beyond the prompt
    assert first[0].output_last_block != NO_BLOCK
    assert trace.parent[first[0].output_last_block] == first[0].last_block
    types = {tree.token_type[n] for n in range(len(tree.length))}
    assert {"system", "user", "tool_output"} <= types and ("reasoning" in types or "tool_call" in types)


def test_kv_cache_tester_without_output_caching(tmp_path):
    _write_json_gz(tmp_path / "trace_0001.json.gz", _conversation(130, 70, first_local=1))
    trace = load_kv_cache_tester(tmp_path, KvLoadOptions(cache_outputs=False))
    assert all(r.output_last_block == NO_BLOCK for r in trace.requests)


def test_real_mooncake_trace_first_records():
    trace = load_mooncake(SAMPLE_TRACE_ROOT / "mooncake" / "conversation_trace.jsonl.gz", limit=20)
    assert len(trace.requests) == 20 and trace.block_tokens == 512
    assert all(r.prompt_tokens > 0 for r in trace.requests)
    # the trace's first records: 6,758 and 7,322 prompt tokens (14 and 15 blocks of 512) that
    # share their first block, the system prompt nearly every request starts with
    assert [r.prompt_tokens for r in trace.requests[:2]] == [6758, 7322]
    assert list(trace.parent[:3]) == [NO_BLOCK, 0, 1]
    assert trace.requests[0].last_block == 13 and trace.parent[14] == 0


def test_real_kv_cache_tester_first_conversation():
    trace = load_kv_cache_tester(SAMPLE_TRACE_ROOT / "kv-cache-tester", KvLoadOptions(limit_files=1))
    assert trace.block_tokens == 64 and len(trace.requests) == 41   # trace_0001: 41 main turns
    assert trace.requests[0].prompt_tokens == 71175
    assert build_node_tree(trace).token_type[0] == "system"


def test_the_sample_holds_the_conversations_the_documented_replays_select():
    """`--sessions 48` (first 48 files) and `--sessions 48 --skip-sessions 48` (the held-out ones,
    `--skip-sessions 524` on the 572-file set) as eval/traces/README.md lists them."""
    names = [f.name.split(".")[0] for f in kv_trace_files(SAMPLE_TRACE_ROOT / "kv-cache-tester")]
    assert len(names) == 96
    assert (names[0], names[47], names[48], names[95]) == ("trace_0001", "trace_0061", "trace_0681", "trace_0739")
    held_out = load_kv_cache_tester(SAMPLE_TRACE_ROOT / "kv-cache-tester", KvLoadOptions(limit_files=48, skip_files=48))
    assert len({r.session for r in held_out.requests}) == 48
    for folder in ("mooncake", "kv-cache-tester"):
        assert "Apache License" in (SAMPLE_TRACE_ROOT / folder / "LICENSE").read_text()
    assert (SAMPLE_TRACE_ROOT / "mooncake" / "synthetic_trace.jsonl.gz").is_file()


def test_the_default_root_is_the_sample_unless_the_environment_names_another(tmp_path):
    probe = "from eval.trace_sim.loaders import DEFAULT_TRACE_ROOT; print(DEFAULT_TRACE_ROOT)"
    env = {k: v for k, v in os.environ.items() if k != TRACES_ENV}

    def default_root(extra: dict) -> str:
        out = subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, cwd=REPO,
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert default_root({}) == str(SAMPLE_TRACE_ROOT) and SAMPLE_TRACE_ROOT == REPO / "eval" / "traces"
    assert default_root({TRACES_ENV: str(tmp_path)}) == str(tmp_path)


def test_no_code_reads_a_folder_beside_the_repository():
    """The repository stands alone: no source, script or config names the sibling shared folder."""
    sibling = re.compile(r"\.\.(/|\"\s*[/,]\s*\")shared")   # as one path or as path parts
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.toml", "*.cfg", "*.ini", "*.yml", "*.yaml"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    offenders = [p for p in tracked if (REPO / p).is_file() and sibling.search((REPO / p).read_text(errors="replace"))]
    assert offenders == []
