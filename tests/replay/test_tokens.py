"""Token synthesis and the scaling of both trace formats (tiny files in the real formats)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from eval.replay.bound import ideal_curve
from eval.replay.tokens import TOKEN_HI, TOKEN_LO, block_tokens, scale_trace
from eval.trace_sim.loaders import KvLoadOptions, load_kv_cache_tester, load_mooncake


def _lcp(a, b) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_equal_blocks_give_equal_tokens_and_stay_in_range():
    a = block_tokens(np.array([7, 8, 9]), 16, seed=0)
    b = block_tokens(np.array([7, 8, 10]), 16, seed=0)
    assert a.shape == (48,) and a.dtype == np.int64
    assert a[:32].tolist() == b[:32].tolist()           # blocks 7, 8 shared
    assert a[32:].tolist() != b[32:].tolist()           # block 9 vs 10
    assert block_tokens(np.array([7]), 16, 0).tolist() == a[:16].tolist()  # position-independent
    many = block_tokens(np.arange(2000), 8, seed=3)
    assert many.min() >= TOKEN_LO and many.max() < TOKEN_HI
    # roughly uniform: every id of the range is used
    assert len(set(many.tolist())) == TOKEN_HI - TOKEN_LO


def test_seed_changes_tokens_and_is_deterministic():
    ids = np.array([1, 2, 3])
    assert block_tokens(ids, 4, 0).tolist() == block_tokens(ids, 4, 0).tolist()
    assert block_tokens(ids, 4, 0).tolist() != block_tokens(ids, 4, 1).tolist()
    with pytest.raises(ValueError, match="tokens-per-block"):
        block_tokens(ids, 0)


def _write_jsonl_gz(path: Path, records) -> Path:
    with gzip.open(path, "wt") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def test_mooncake_scaling_keeps_prefix_chains(tmp_path):
    path = _write_jsonl_gz(tmp_path / "t.jsonl.gz", [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
        {"timestamp": 1000, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 4]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    ])
    scaled = scale_trace(load_mooncake(path), tokens_per_block=4)
    # time order: t=0, 1000, 2000, 3000; every block (the partial last one too) -> 4 tokens
    assert [r.time for r in scaled] == [0.0, 1.0, 2.0, 3.0]
    assert [r.blocks for r in scaled] == [3, 3, 2, 3]
    assert [len(r.tokens) for r in scaled] == [12, 12, 8, 12]
    assert [r.index for r in scaled] == [0, 1, 2, 3]
    s = [r.tokens for r in scaled]
    assert s[0][:8] == s[1][:8] and s[0][:4] == s[2][:4] and s[0] == s[3]
    # ideal on the tokens: the block-level shares, plus any chance agreement of distinct blocks
    ideal = ideal_curve(s).per_request
    assert ideal[0] == 0 and ideal[1] == _lcp(s[0], s[1]) >= 8 and ideal[3] == 11
    assert scale_trace(load_mooncake(path), 4, limit=2)[1].tokens == s[1]


def _conversation(tools: int, system: int, first_local: int, t0: float = 0.0):
    prefix = (tools + system) // 64
    base = list(range(first_local, first_local + prefix))
    turn1 = base + [first_local + 100, first_local + 101]
    turn2 = turn1 + [first_local + 102]
    return {
        "id": "x", "block_size": 64, "hash_id_scope": "local", "tool_tokens": tools,
        "system_tokens": system,
        "requests": [
            {"t": t0, "type": "n", "in": 64 * len(turn1), "out": 10, "hash_ids": turn1,
             "input_types": ["text"], "output_types": ["text"]},
            {"t": t0 + 5.0, "type": "n", "in": 30, "out": 10, "hash_ids": [],
             "input_types": ["text"], "output_types": ["text"]},
            {"t": t0 + 9.0, "type": "n", "in": 64 * len(turn2), "out": 20, "hash_ids": turn2,
             "input_types": ["tool_result"], "output_types": ["text"]},
        ],
    }


def test_kv_cache_tester_shared_prefix_maps_to_equal_tokens(tmp_path):
    for name, conv in (("trace_0001.json.gz", _conversation(130, 70, first_local=1)),
                       ("trace_0002.json.gz", _conversation(140, 60, first_local=500))):
        with gzip.open(tmp_path / name, "wt") as handle:
            json.dump(conv, handle)
    trace = load_kv_cache_tester(tmp_path, KvLoadOptions(arrival_gap_s=1000.0))
    scaled = scale_trace(trace, tokens_per_block=2)
    # the empty-hash turn of each conversation is skipped: 2 requests per conversation
    assert len(scaled) == 4 and [r.index for r in scaled] == [0, 1, 2, 3]
    by_session = sorted(scaled, key=lambda r: (r.session, r.time))
    assert [r.session for r in by_session] == [0, 0, 1, 1]
    assert [r.blocks for r in by_session] == [5, 6, 5, 6]
    a1, a2, b1, b2 = (r.tokens for r in by_session)
    # 3 shared tools+system blocks (different local ids in each file) -> 6 equal tokens
    assert a1[:6] == b1[:6] and a1[6:8] != b1[6:8]
    assert a2[:10] == a1 and b2[:10] == b1   # each conversation's turns are prefix chains
