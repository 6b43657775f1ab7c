"""LongBench v1's per-answer metrics: THUDM/LongBench `metrics.py`, re-implemented.

Every metric is `metric(prediction, ground_truth, *, all_classes=...) -> float` in [0, 1]; which
dataset uses which, and how a sample's and a dataset's scores follow from them (the rules of
LongBench's `eval.py`), is `eval.longbench.scoring`.

ROUGE-L uses `rouge-score` instead of the official (unmaintained) `rouge` package and so is
close to, not identical with, the official value; `rouge_score` says how it differs. Every
other metric reproduces the official result exactly. Heavy imports (jieba, rouge_score) are
done on first use, so importing this module is cheap.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Protocol

__all__ = [
    "Metric",
    "classification_score",
    "code_sim_score",
    "count_score",
    "f1_score",
    "normalize_answer",
    "normalize_zh_answer",
    "qa_f1_score",
    "qa_f1_zh_score",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_score",
    "rouge_zh_score",
]


class Metric(Protocol):
    def __call__(self, prediction: str, ground_truth: str, **kwargs: Any) -> float: ...


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
