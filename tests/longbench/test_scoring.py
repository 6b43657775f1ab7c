"""LongBench v1 scoring rules (the official eval.py) against hand-computed values: which metric
each dataset uses, the first-line rule, the max over answers, the dataset score and LongBench-E's
length buckets."""

from __future__ import annotations

import math

import pytest

from eval.longbench import metrics as m
from eval.longbench import scoring as s
from eval.longbench.config import DATASETS


def test_dataset2metric_covers_all_v1_datasets():
    assert set(s.dataset2metric) == set(DATASETS)
    assert len(DATASETS) == 21
    assert s.dataset2metric["multifieldqa_zh"] is m.qa_f1_zh_score
    assert s.dataset2metric["dureader"] is m.rouge_zh_score
    assert s.dataset2metric["lsht"] is m.classification_score
    assert s.dataset2metric["repobench-p"] is m.code_sim_score


TREC_CLASSES = ["Abbreviation", "Animal", "City", "Country", "Number of something"]


def test_first_line_rule_trec():
    # correct first line, junk after (which names another class): only "City" is scored -> 1.0
    good = "\nCity\nQuestion: What barks?\nType: Animal"
    assert s.score_sample("trec", good, ["City"], TREC_CLASSES) == 1.0
    # the same text without the rule would name City and Animal -> 1/2
    assert m.classification_score(good, "City", all_classes=TREC_CLASSES) == 0.5
    # junk first line, the right class only later -> 0.0
    bad = "Question: Which town?\nType: City"
    assert s.score_sample("trec", bad, ["City"], TREC_CLASSES) == 0.0


def test_no_first_line_rule_for_other_datasets():
    # hotpotqa keeps the whole prediction: [paris is answer] vs [paris]: P = 1/3, R = 1 -> F1 = 0.5
    assert s.score_sample("hotpotqa", "Paris\nis the answer", ["Paris"]) == pytest.approx(0.5)
    # triviaqa cuts at the first line -> exact match
    assert s.score_sample("triviaqa", "Paris\nis the answer", ["Paris"]) == 1.0


def test_score_sample_is_max_over_answers():
    # vs "Paris": [city of paris] -> P = 1/3, R = 1 -> 0.5; vs "City of Paris": exact -> 1.0
    assert s.score_sample("hotpotqa", "city of paris", ["Paris", "City of Paris"]) == 1.0
    assert s.score_sample("hotpotqa", "city of paris", ["Paris"]) == pytest.approx(0.5)


def test_score_sample_rejects_unknown_dataset_and_string_answers():
    with pytest.raises(ValueError, match="valid names: narrativeqa"):
        s.score_sample("narrative_qa", "x", ["x"])
    with pytest.raises(TypeError, match="list of strings"):
        s.score_sample("hotpotqa", "x", "x")


def test_scorer_rounds_percent():
    # per sample: 1.0, 0.5, 0.0 -> mean 0.5 -> 50.0
    assert s.scorer("passage_count", ["3", "3 4", "5"], [["3"], ["3"], ["3"]]) == 50.0
    # 1, 0, 0 -> 33.333... -> 33.33
    assert s.scorer("passage_count", ["3", "4", "5"], [["3"], ["3"], ["3"]]) == 33.33


def test_scorer_classes_per_dataset_or_per_sample():
    assert s.scorer("trec", ["City", "Animal"], [["City"], ["City"]], TREC_CLASSES) == 50.0
    assert s.scorer("trec", ["City", "Animal"], [["City"], ["Animal"]], [TREC_CLASSES, TREC_CLASSES]) == 100.0


# ----------------------------------------------------------------------------- LongBench-E


def test_length_buckets_boundaries():
    assert [s.length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 100_000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]


def test_scorer_e_buckets():
    preds = ["3", "4", "3 4", "3", "3", "9"]
    answers = [["3"]] * 6
    lengths = [100, 3999, 4000, 7999, 8000, 20000]
    # 0-4k: [1, 0] -> 50.0; 4-8k: [0.5, 1] -> 75.0; 8k+: [1, 0] -> 50.0
    assert s.scorer_e("passage_count", preds, answers, lengths) == {"0-4k": 50.0, "4-8k": 75.0, "8k+": 50.0}


def test_score_by_bucket_empty_bucket_is_nan_and_rounding():
    result = s.score_by_bucket([1.0, 0.0, 0.0, 2 / 3], [10, 20, 30, 9000])
    assert result["0-4k"] == 33.33
    assert result["8k+"] == 66.67
    assert math.isnan(result["4-8k"])  # like the official np.mean([])


def test_scorer_e_length_mismatch_is_reported():
    with pytest.raises(ValueError, match="differ in length"):
        s.scorer_e("passage_count", ["3"], [["3"]], [1, 2])
