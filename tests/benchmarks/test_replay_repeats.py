"""benchmarks/replay_repeats.py: per-run comparison with the baseline and medians over runs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.replay_repeats import main, summarize


def _run(folder: Path, wall: dict[str, float], cpu: dict[str, float], recs: dict[str, list[dict]]) -> Path:
    folder.mkdir()
    rows = []
    for i, (label, rs) in enumerate(recs.items()):
        rows.append({"server": label, "wall_s": wall[label], "reuse_of_ideal": 0.5,
                     "process_cpu_ms_per_request": {"sglang::scheduler": cpu[label]},
                     "vs_baseline": {"exact_hits_lost": 0}})
        with gzip.open(folder / f"requests-{i}-{label}.jsonl.gz", "wt") as handle:
            handle.writelines(json.dumps({"index": j, **r}) + "\n" for j, r in enumerate(rs))
    (folder / "report.json").write_text(json.dumps({"servers": rows}))
    return folder


def _rec(cached: int, ttft: float, detail: dict | None = None) -> dict:
    return {"ok": True, "cached_tokens": cached, "ttft_s": ttft, "tail_replay": detail}


def test_ratios_on_same_reuse_and_medians(tmp_path):
    pressed = {"exact": False, "bound": 0.2, "kv_exact": False, "pressure": {"pressed_by": ["token_usage"]}}
    calm = {"exact": True, "bound": 0.0, "pressure": {"pressed_by": []}}
    runs = []
    for k, (wall, ttft) in enumerate([(10.0, 0.2), (20.0, 0.4), (40.0, 0.1)]):
        runs.append(_run(tmp_path / f"r{k}", {"stock": 10.0, "tr": wall}, {"stock": 100.0, "tr": 110.0}, {
            "stock": [_rec(0, 0.1), _rec(64, 0.1), _rec(64, 0.1)],
            # request 1 reuses more than stock: left out of the same-reuse TTFT
            "tr": [_rec(0, ttft, calm), _rec(128, 9.0, pressed), _rec(64, ttft, calm)]}))
    summary = summarize(runs, "stock")
    first = summary["per_run"][str(runs[0])]["tr"]
    assert first["same_reuse_requests"] == 2 and first["ttft_p50_same_reuse_x"] == pytest.approx(2.0)
    assert first["throughput_x"] == pytest.approx(1.0) and first["scheduler_cpu_x"] == pytest.approx(1.1)
    assert (first["kv_exact"], first["approximate"], first["pressed"], first["pressed_approximate"]) == (2, 1, 1, 1)
    median = summary["median"]["tr"]
    assert median["runs"] == 3 and median["throughput_x"] == pytest.approx(0.5)
    assert median["ttft_p50_same_reuse_x"] == pytest.approx(2.0)
    assert summary["median"]["stock"]["kv_exact"] == 3
    renamed = summarize(runs, "stock", alias={"tr": "tail-replay"}, servers=["tail-replay"])
    assert set(renamed["median"]) == {"stock", "tail-replay"}
    assert summarize(runs, "stock", servers=[])["median"].keys() == {"stock"}


def test_a_missing_baseline_is_named(tmp_path):
    run = _run(tmp_path / "r", {"tr": 1.0}, {"tr": 1.0}, {"tr": [_rec(0, 0.1)]})
    with pytest.raises(SystemExit, match="no server labelled 'stock'"):
        summarize([run], "stock")


def test_a_malformed_alias_is_named(tmp_path):
    run = _run(tmp_path / "r", {"stock": 1.0}, {"stock": 1.0}, {"stock": [_rec(0, 0.1)]})
    with pytest.raises(SystemExit, match="--alias 'tr': write LABEL=NAME"):
        main(["--runs", str(run), "--baseline", "stock", "--alias", "tr", "--out", str(tmp_path / "out")])
