"""Medians over repeated replays (eval/replay/medians.py): ratios within each run, then the median
per figure; report directories end to end."""

from __future__ import annotations

import json

import pytest

from eval.replay.medians import main, medians, run_figures


def _report(tr_mean: float, below: int, out: str) -> dict:
    def row(name, mean, reuse, below):
        return {"server": name, "reuse_of_ideal": reuse, "exact_split": {"exact": 400, "approximate": 0},
                "modeled_gpu_ttft_s": {"mean": mean, "p50": mean / 2, "p95": mean * 2},
                "vs_baseline": {"reuse_below_baseline": below, "exact_hits_lost": 0},
                "process_cpu_ms_per_request": {"sglang::scheduler": 20.0}}
    return {"command": f"python -m eval.replay --out {out}", "gpu_model": {"baseline": "stock"},
            "servers": [row("stock", 0.5, 0.7, 0), row("tr", tr_mean, 0.8, below)]}


def test_ratios_are_taken_within_each_run_then_the_median_per_figure():
    runs = [run_figures(_report(m, b, "x"), {"servers": {"stock": {"goodput_x_baseline": [1.0, 1.0]},
                                                          "tr": {"goodput_x_baseline": [g, 2 * g]}}})
            for m, b, g in ((0.40, 3, 1.2), (0.45, 9, 1.1), (0.60, 1, 1.4))]
    assert runs[0]["tr"]["modeled_ttft_x_baseline"] == pytest.approx(0.8)
    med = medians(runs)
    assert med["tr"]["modeled_ttft_x_baseline"] == pytest.approx(0.9)
    assert med["tr"]["reuse_below_baseline"] == 3 and med["tr"]["goodput_x_baseline"] == pytest.approx([1.2, 2.4])
    assert med["stock"]["modeled_ttft_x_baseline"] == 1.0 and med["tr"]["p95_x_baseline"] == pytest.approx(0.9)


def test_report_directories_end_to_end(tmp_path, capsys):
    dirs = []
    for i, mean in enumerate((0.40, 0.45, 0.60)):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "report.json").write_text(json.dumps(_report(mean, i, str(d))))
        dirs.append(str(d))
    assert main([*dirs, "--out", str(tmp_path / "m.json")]) == 0
    result = json.loads((tmp_path / "m.json").read_text())
    assert result["commands"] == ["python -m eval.replay --out"] and len(result["per_run"]) == 3
    assert result["median"]["tr"]["modeled_ttft_x_baseline"] == pytest.approx(0.9)
    assert "tr" in capsys.readouterr().out
