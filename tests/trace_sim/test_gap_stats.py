"""Gap statistics of agentic sessions (the numbers behind docs/saecache.md section 5)."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest

from eval.trace_sim.gap_stats import gap_stats, main


def _request(t: float, stop: str, out: int, ids: list[int]) -> dict:
    return {"t": t, "stop": stop, "out": out, "hash_ids": ids}


def _conversation() -> dict:
    """Gaps after tool calls: 2, 8, 4 s; one end of turn, 100 s; the third prompt diverges."""
    return {"requests": [
        _request(0.0, "tool_use", 10, [1, 2]),
        _request(2.0, "tool_use", 10, [1, 2, 3]),
        _request(10.0, "tool_use", 10, [1, 9]),
        _request(14.0, "end_turn", 10, [1, 9, 4]),
        {"agent_id": "a1", "t": 20.0, "stop": "tool_use", "out": 1, "hash_ids": [7]},  # sub-agent: skipped
        _request(114.0, "tool_use", 10, [1, 9, 4, 5]),
    ]}


def test_spread_correlation_and_divergence_on_a_hand_trace():
    stats = gap_stats([_conversation()])
    logs = [math.log(2.0), math.log(8.0), math.log(4.0)]
    tool = stats["after"]["tool_use"]
    assert tool["gaps"] == 3
    assert tool["log_gap_sd"] == pytest.approx(float(np.std(logs)))
    assert tool["log_gap_sd_within_output_size_class"] is None  # fewer than 5 gaps per class
    assert tool["consecutive_log_gap_correlation"] is None  # two pairs only
    assert stats["after"]["end_turn"]["gaps"] == 1
    assert stats["pairs_of_requests"] == 4
    assert stats["diverging_share"] == pytest.approx(1 / 4)  # [1,2,3] -> [1,9]


def test_command_reads_the_files_and_refuses_a_bad_stride(tmp_path, capsys):
    folder = tmp_path / "kv-cache-tester"
    folder.mkdir()
    with gzip.open(folder / "trace_0001.json.gz", "wt") as handle:
        json.dump(_conversation(), handle)
    main(["--traces-root", str(tmp_path)])
    assert json.loads(capsys.readouterr().out)["after"]["tool_use"]["gaps"] == 3
    with pytest.raises(SystemExit):
        main(["--traces-root", str(tmp_path), "--every", "0"])
    assert "--every must be >= 1" in capsys.readouterr().err
