"""LongBench v1 scoring rules: THUDM/LongBench `eval.py` (`scorer`, `scorer_e`), re-implemented
for its 21 datasets, over the per-answer metrics of `eval.longbench.metrics`:

* each dataset has one metric (`dataset2metric`);
* a sample's score is the max over its ground truths, after cutting the prediction to its
  first line for trec / triviaqa / samsum / lsht (`score_sample`);
* a dataset's score is `round(100 * mean, 2)` (`scorer`); LongBench-E splits that mean into
  the length buckets "0-4k", "4-8k" and "8k+" by each sample's `length` field (`scorer_e`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from eval.longbench.metrics import (
    Metric,
    classification_score,
    code_sim_score,
    count_score,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)

__all__ = [
    "BUCKETS",
    "FIRST_LINE_DATASETS",
    "dataset2metric",
    "length_bucket",
    "score_by_bucket",
    "score_records",
    "score_sample",
    "scorer",
    "scorer_e",
]

# Official eval.py: these datasets are few-shot prompts, so a model tends to keep generating
# further "examples"; only the first line of the prediction is scored.
FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# LongBench-E length buckets, in the official order (keys of scorer_e's result).
BUCKETS: tuple[str, str, str] = ("0-4k", "4-8k", "8k+")

dataset2metric: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def _metric_for(dataset: str) -> Metric:
    try:
        return dataset2metric[dataset]
    except KeyError:
        valid = ", ".join(dataset2metric)
        raise ValueError(f"unknown LongBench dataset {dataset!r}; valid names: {valid}") from None


def score_sample(
    dataset: str,
    prediction: str,
    answers: Sequence[str],
    all_classes: Sequence[str] | None = None,
) -> float:
    """One sample's score in [0, 1], by the rule of the official eval.py.

    For trec, triviaqa, samsum and lsht only the first line of the prediction counts
    (`prediction.lstrip('\\n').split('\\n')[0]`); the score is the max of the dataset's metric
    over all ground-truth answers (0.0 if there are none).
    """
    metric = _metric_for(dataset)
    if isinstance(answers, str):
        raise TypeError(f"answers must be a list of strings, got the string {answers!r}")
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for ground_truth in answers:
        score = max(score, metric(prediction, ground_truth, all_classes=all_classes))
    return float(score)


def _check_same_length(**columns: Sequence[Any]) -> int:
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"inputs differ in length: {lengths}")
    return next(iter(lengths.values()))


def _per_sample_classes(
    all_classes: Sequence[str] | Sequence[Sequence[str] | None] | None, n: int
) -> list[Sequence[str] | None]:
    """Accept one class list for the whole dataset (as the official eval.py does) or one per sample."""
    if all_classes is None:
        return [None] * n
    if all(isinstance(item, str) for item in all_classes):
        return [all_classes] * n  # type: ignore[list-item]
    if len(all_classes) != n:
        raise ValueError(f"all_classes has {len(all_classes)} per-sample entries for {n} predictions")
    return list(all_classes)  # type: ignore[arg-type]


def scorer(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | Sequence[Sequence[str] | None] | None = None,
) -> float:
    """Dataset score as in the official eval.py: `round(100 * mean(sample scores), 2)`."""
    n = _check_same_length(predictions=predictions, answers=answers)
    if n == 0:
        raise ValueError(f"no predictions to score for {dataset!r}")
    classes = _per_sample_classes(all_classes, n)
    total = sum(score_sample(dataset, p, a, c) for p, a, c in zip(predictions, answers, classes))
    return round(100 * total / n, 2)


def length_bucket(length: int) -> str:
    """LongBench-E bucket of a sample's `length` field: <4000 "0-4k", <8000 "4-8k", else "8k+"."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def score_by_bucket(scores: Iterable[float], lengths: Iterable[int]) -> dict[str, float]:
    """Aggregate per-sample scores (in [0, 1]) into LongBench-E buckets, each `round(100 * mean, 2)`.

    Like the official `np.mean([])`, a bucket without samples is NaN.
    """
    grouped: dict[str, list[float]] = {bucket: [] for bucket in BUCKETS}
    for score, length in zip(scores, lengths, strict=True):
        grouped[length_bucket(length)].append(score)
    return {
        bucket: round(100 * sum(values) / len(values), 2) if values else math.nan
        for bucket, values in grouped.items()
    }


def scorer_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Sequence[str] | Sequence[Sequence[str] | None] | None = None,
) -> dict[str, float]:
    """LongBench-E dataset score per length bucket, as the official eval.py's `scorer_e`."""
    n = _check_same_length(predictions=predictions, answers=answers, lengths=lengths)
    classes = _per_sample_classes(all_classes, n)
    scores = [score_sample(dataset, p, a, c) for p, a, c in zip(predictions, answers, classes)]
    return score_by_bucket(scores, lengths)


def score_records(dataset: str, records: Iterable[Mapping[str, Any]]) -> list[float]:
    """Per-sample scores of prediction records shaped like the official pred/*.jsonl lines.

    Each record needs `pred` and `answers`; `all_classes` is read per record when present.
    """
    out: list[float] = []
    for index, record in enumerate(records):
        missing = [key for key in ("pred", "answers") if key not in record]
        if missing:
            raise ValueError(f"prediction record {index} for {dataset!r} lacks {', '.join(missing)}")
        out.append(score_sample(dataset, record["pred"], record["answers"], record.get("all_classes")))
    return out

