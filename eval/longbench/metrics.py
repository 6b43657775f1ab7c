"""LongBench v1 scoring: the official per-answer metrics and the rules of its eval.py.

Re-implements THUDM/LongBench `metrics.py` and the scoring rules of `eval.py`
(`scorer`, `scorer_e`) for the 21 LongBench v1 datasets:

* every metric is `metric(prediction, ground_truth, *, all_classes=...) -> float` in [0, 1];
* a sample's score is the max over its ground truths, after cutting the prediction to its
  first line for trec / triviaqa / samsum / lsht (`score_sample`);
* a dataset's score is `round(100 * mean, 2)` (`scorer`); LongBench-E splits that mean into
  the length buckets "0-4k", "4-8k" and "8k+" by each sample's `length` field (`scorer_e`).

ROUGE-L uses `rouge-score` instead of the official (unmaintained) `rouge` package and so is
close to, not identical with, the official value; `rouge_score` says how it differs. Every
other metric reproduces the official result exactly. Heavy imports (jieba, rouge_score) are
done on first use, so importing this module is cheap.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, Protocol

__all__ = [
    "BUCKETS",
    "FIRST_LINE_DATASETS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "dataset2metric",
    "f1_score",
    "length_bucket",
    "normalize_answer",
    "normalize_zh_answer",
    "qa_f1_score",
    "qa_f1_zh_score",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "score_by_bucket",
    "score_records",
    "score_sample",
    "scorer",
    "scorer_e",
]


class Metric(Protocol):
    def __call__(self, prediction: str, ground_truth: str, **kwargs: Any) -> float: ...


# Official eval.py: these datasets are few-shot prompts, so a model tends to keep generating
# further "examples"; only the first line of the prediction is scored.
FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# LongBench-E length buckets, in the official order (keys of scorer_e's result).
BUCKETS: tuple[str, str, str] = ("0-4k", "4-8k", "8k+")

_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)


# ----------------------------------------------------------------------------- tokenizers


@lru_cache(maxsize=1)
def _jieba() -> Any:
    """jieba, imported on first use with its "Building prefix dict" chatter silenced."""
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def _jieba_cut(text: str) -> list[str]:
    """Official Chinese tokenization: `list(jieba.cut(text, cut_all=False))` (precise mode)."""
    return list(_jieba().cut(text, cut_all=False))


# ----------------------------------------------------------------------------- normalizers


def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(s: str) -> str:
    """Lower-case, drop ASCII and Chinese punctuation, remove all whitespace."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


# ----------------------------------------------------------------------------- QA F1


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs: Any) -> float:
    """Token-multiset F1 of two token lists (0.0 when they share no token)."""
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """English QA F1 over whitespace tokens of `normalize_answer` (SQuAD-style)."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Chinese QA F1 over jieba tokens, each normalized by `normalize_zh_answer`; empty tokens dropped."""

    def tokens(text: str) -> list[str]:
        normalized = (normalize_zh_answer(token) for token in _jieba_cut(text))
        return [token for token in normalized if token]

    return f1_score(tokens(prediction), tokens(ground_truth))


# ----------------------------------------------------------------------------- ROUGE-L


class _WhitespaceTokenizer:
    """rouge-score tokenizer that splits on whitespace only, keeping case and non-ASCII text.

    The official `rouge` package splits words on spaces and does not lower-case; rouge-score's
    default tokenizer lower-cases and deletes every non-[a-z0-9] character, which would erase
    Chinese text entirely.
    """

    def tokenize(self, text: str) -> list[str]:
        return text.split()


@lru_cache(maxsize=1)
def _rouge_lsum_scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeLsum"], tokenizer=_WhitespaceTokenizer())


def _split_sentences(text: str) -> list[str]:
    """Sentence split of the official `rouge` package: on every '.', whitespace collapsed."""
    return [" ".join(part.split()) for part in text.split(".") if part.strip()]


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F-measure, summary level, as computed by the official `rouge` package (approximately).

    Official: `Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]`
    (pltrdy `rouge`), 0.0 whenever it raises. That package splits both texts into sentences on
    '.', tokenizes on whitespace (case kept) and computes the summary-level union-LCS F1.
    Here the same sentence split and tokenization feed rouge-score's `rougeLsum` (the
    summary-level union-LCS of ROUGE-1.5.5). Remaining difference: the `rouge` package counts
    *distinct* words (Python sets) for the union LCS and for both lengths, rouge-score counts
    tokens with multiplicity, so texts that repeat words score somewhat differently. Also, the
    official code scores 0.0 when `rouge` hits Python's recursion limit on a sentence of
    roughly 1000+ words; rouge-score has no such limit.
    """
    prediction_sentences = _split_sentences(prediction)
    reference_sentences = _split_sentences(ground_truth)
    if not prediction_sentences or not reference_sentences:
        return 0.0  # the official `rouge` package raises "Hypothesis is empty." here -> 0.0
    scores = _rouge_lsum_scorer().score("\n".join(reference_sentences), "\n".join(prediction_sentences))
    return float(scores["rougeLsum"].fmeasure)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Chinese ROUGE-L: both texts are jieba-tokenized, joined with spaces, then `rouge_score`."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


# ----------------------------------------------------------------------------- classification


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Classification accuracy (trec, lsht): 1/k when the true class is among k classes named.

    Every class name of `all_classes` that occurs as a substring of the prediction is a match;
    matches that are a strict substring of the ground truth are discarded (so "Location" does
    not count against "Other location"). The score is 1/len(matches) if the ground truth is
    among the matches, else 0.0.

    Two quirks of the official code are kept on purpose so that scores agree:
    * the discarding loop removes items from the list it iterates over, so of two adjacent
      discardable matches only the first is removed;
    * its difflib "closest class" fallback sits behind `if em_match_list != 0:`, which is
      always true for a list, so it never runs: a prediction naming no class scores 0.0.
    """
    all_classes = kwargs.get("all_classes")
    if not all_classes:
        raise ValueError("classification_score needs a non-empty `all_classes` list of class names")
    em_match_list = [class_name for class_name in all_classes if class_name in prediction]
    for match_term in em_match_list:  # mutating while iterating: deliberate, see docstring
        if match_term in ground_truth and match_term != ground_truth:
            em_match_list.remove(match_term)
    if ground_truth in em_match_list:
        return 1.0 / len(em_match_list)
    return 0.0


# ----------------------------------------------------------------------------- synthetic tasks


def _share_of_numbers_equal(prediction: str, target: str) -> float:
    """Share of the integers written in `prediction` that equal `target` (0.0 if it has none)."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for number in numbers if number == target) / len(numbers)


def _paragraph_id(ground_truth: str, pattern: str) -> str:
    matches = re.findall(pattern, ground_truth)
    if not matches:
        raise ValueError(
            f"ground truth {ground_truth!r} does not match {pattern!r}; cannot find the paragraph number"
        )
    return matches[0]


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_retrieval_en: share of the numbers in the prediction equal to N of "Paragraph N"."""
    return _share_of_numbers_equal(prediction, _paragraph_id(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_retrieval_zh: share of the numbers in the prediction equal to N of "段落N"."""
    return _share_of_numbers_equal(prediction, _paragraph_id(ground_truth, r"段落(\d+)"))


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_count: share of the numbers in the prediction equal to the ground-truth count."""
    return _share_of_numbers_equal(prediction, str(ground_truth))


# ----------------------------------------------------------------------------- code


def _first_code_line(prediction: str) -> str:
    """First line (leading newlines skipped) with no '`', '#' or '//'; "" if there is none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """lcc / repobench-p: similarity of the first code line of the prediction, in [0, 1].

    Official: `fuzzywuzzy.fuzz.ratio(line, ground_truth) / 100`. fuzzywuzzy as LongBench installs
    it (no python-Levenshtein) computes `int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))`
    after its guards (equal strings -> 100, an empty string -> 0); this is that computation,
    with the standard library only. Note that `rapidfuzz.fuzz.ratio` (and fuzzywuzzy *with*
    python-Levenshtein) uses the LCS-based Indel ratio instead, which is >= difflib's
    Ratcliff-Obershelp ratio and differs on about a third of code-line pairs.
    """
    line = _first_code_line(prediction)
    if line == ground_truth:
        return 1.0  # fuzzywuzzy's check_for_equivalence, also covers "" == ""
    if not line or not ground_truth:
        return 0.0  # fuzzywuzzy's check_empty_string
    ratio = difflib.SequenceMatcher(None, line, ground_truth).ratio()
    return int(round(100 * ratio)) / 100


# ----------------------------------------------------------------------------- dataset rules

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

