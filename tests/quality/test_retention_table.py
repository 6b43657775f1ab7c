"""The retention table's arithmetic on a hand-computed case (no server)."""

from __future__ import annotations

import json
import math

import pytest

from eval.quality import cli, retention


def _ppl(config, key, group, logprobs, replayed, cached):
    return {"key": key, "config": config, "group": group, "logprobs": logprobs, "replayed_tokens": replayed,
            "cached_tokens": cached}


def _write_samples(folder, rows):
    """A run folder as the quality runner leaves it: samples.jsonl, one row per line."""
    folder.mkdir()
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [
    _ppl("full", "a", "1K", [-1.0, -2.0], 0, 0), _ppl("full", "b", "4K", [-1.0, -1.0], 0, 0),
    # tr-5: 1K sample +0.2 / 0 nats, 4K sample 0 / -0.2 (cancels in the mean, not in |delta|)
    _ppl("tr-5", "a", "1K", [-1.2, -2.0], 51, 972), _ppl("tr-5", "b", "4K", [-1.0, -0.8], 204, 3891),
    _ppl("tr-auto-0.01", "a", "1K", [-1.1, -2.1], 133, 890), _ppl("tr-auto-0.01", "b", "4K", [-1.0, -1.0], 133, 3962),
    _ppl("tr-auto-0.1", "c", "4K", [-9.0, -9.0], 67, 4028),     # no full reference for "c": left out
]


def test_perplexity_columns_by_hand():
    cols = retention.perplexity_columns(ROWS)
    assert set(cols) == {"full", "tr-5", "tr-auto-0.01"}
    five = cols["tr-5"]
    assert five["replayed"] == pytest.approx(127.5) and five["reused"] == pytest.approx(2431.5)
    assert five["replayed_by_group"] == {"1K": 51, "4K": 204}
    assert five["ppl_by_group"]["1K"] == pytest.approx(math.exp(0.1))
    assert five["ppl_by_group"]["4K"] == pytest.approx(math.exp(-0.1))
    assert five["ppl_ratio"] == pytest.approx(1.0) and five["abs_delta"] == pytest.approx(0.1)
    assert five["abs_by_group"] == pytest.approx({"1K": 0.1, "4K": 0.1})
    auto = cols["tr-auto-0.01"]
    assert auto["replayed"] == 133 and auto["ppl_by_group"] == pytest.approx({"1K": math.exp(0.1), "4K": 1.0})
    assert auto["abs_delta"] == pytest.approx(0.05) and auto["abs_by_group"] == pytest.approx({"1K": 0.1, "4K": 0.0})
    assert cols["full"]["ppl_ratio"] == 1.0 and cols["full"]["abs_delta"] == 0.0


def test_table_rows_in_report_order_with_ruler_columns(tmp_path, capsys):
    ruler = [{"key": k, "config": c, "group": "4K", "dataset": "niah_single_2", "score": s, "prediction": p,
              "cached_tokens": 0 if c == "full" else 3900, "replayed_tokens": 0 if c == "full" else 100,
              "output_ids": [1, 2], "output_logprobs": [-0.5, -0.5] if c == "full" else [-0.6, -0.5]}
             for k in ("x", "y") for c, s, p in (("full", 100.0, "7"), ("tr-5", 100.0, "7" if k == "x" else "8"))]
    _write_samples(tmp_path / "ppl", ROWS)
    _write_samples(tmp_path / "ruler", ruler)
    assert cli.main(["retention", "--perplexity", str(tmp_path / "ppl"), "--ruler", str(tmp_path / "ruler"),
                     "--out", str(tmp_path / "table.md")]) == 0
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| full", "| tr-5", "| tr-auto-0.01"]
    assert lines[3].endswith("| 1.0000 | 1.00e-01 | 1.00e-01 | 1.00e-01 | 100.0 | 50 | 0.0500 | 100 |")
    assert lines[4].endswith("| - | - | - | - |") and "| 133 | 133 | 133 |" in lines[4]
    assert capsys.readouterr().out.strip() == (tmp_path / "table.md").read_text().strip()


def test_longbench_columns_agreement_drift_replayed(tmp_path):
    """LongBench-format columns: share of predictions equal to full prefill, drift, replayed tokens;
    a configuration the run lacks gets "-"."""
    lb = [{"key": k, "config": c, "group": "0-4k", "dataset": "hotpotqa", "score": 0.0, "prediction": p,
           "cached_tokens": 0 if c == "full" else 3500, "replayed_tokens": r,
           "output_ids": [1, 2], "output_logprobs": lp}
          for k, c, p, r, lp in (("x", "full", "a b", 0, [-0.5, -0.5]), ("y", "full", "c", 0, [-1.0, -1.0]),
                                 ("x", "tr-5", "a b", 180, [-0.7, -0.5]), ("y", "tr-5", "d", 190, [-1.0, -1.0]))]
    _write_samples(tmp_path / "ppl", ROWS)
    _write_samples(tmp_path / "lb", lb)
    assert cli.main(["retention", "--perplexity", str(tmp_path / "ppl"), "--longbench", str(tmp_path / "lb"),
                     "--out", str(tmp_path / "table.md")]) == 0
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert lines[0].endswith("| LongBench-format same output % | LongBench-format logprob drift "
                             "| LongBench-format replayed |") and "RULER" not in lines[0]
    assert lines[2].endswith("| 100.0 | 0.0000 | 0 |")
    assert lines[3].startswith("| tr-5 |") and lines[3].endswith("| 50.0 | 0.0500 | 185 |")
    assert lines[4].startswith("| tr-auto-0.01 |") and lines[4].endswith("| - | - | - |")
