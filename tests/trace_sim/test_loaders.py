"""Loaders on tiny files in the real formats, plus the first records of the real traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from eval.trace_sim.loaders import KvLoadOptions, load_kv_cache_tester, load_mooncake
from eval.trace_sim.simulate import prepare
from eval.trace_sim.trace import NO_BLOCK
from eval.trace_sim.tree import build_node_tree

REAL_TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"


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
    trace = load_mooncake(REAL_TRACES / "mooncake" / "conversation_trace.jsonl.gz", limit=20)
    assert len(trace.requests) == 20 and trace.block_tokens == 512
    assert all(r.prompt_tokens > 0 for r in trace.requests)


def test_real_kv_cache_tester_first_conversation():
    trace = load_kv_cache_tester(REAL_TRACES / "kv-cache-tester", KvLoadOptions(limit_files=1))
    assert trace.block_tokens == 64 and len(trace.requests) > 10
    assert build_node_tree(trace).token_type[0] == "system"
