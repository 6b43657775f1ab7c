"""Natural-text windows for the language-modelling part of the training mix.

Sources are the training splits of `eval.corpus` (first 85% of the essays; SQuAD / HotpotQA
articles not held out), so nothing the held-out perplexity or RULER evaluation reads is
trained on. HotpotQA rows share Wikipedia paragraphs across questions, so a training paragraph
that also occurs in the held-out split is dropped (exact match) to keep the two disjoint.

Each source is one token stream (the essays as one text; the QA paragraphs in a fixed seeded
order, joined by blank lines); a window is `length` consecutive tokens of one stream, so a
window is a pure function of the rng state.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

SOURCES = ("essays", "squad", "hotpotqa")


def train_passages(source: str) -> list[str]:
    """The training-split passages of `source`, minus any passage also in the held-out split."""
    from eval import corpus

    if source == "essays":
        return [" ".join(corpus.essay_sentences("train"))]
    if source not in SOURCES:
        raise ValueError(f"unknown text source {source!r}; choose from {', '.join(SOURCES)}")
    qa = corpus.squad if source == "squad" else corpus.hotpotqa
    held_out = set(qa("eval").paragraphs)
    return list(dict.fromkeys(p for p in qa("train").paragraphs if p not in held_out))


class TextPool:
    """Token streams of natural training text, built once per process (encoding takes seconds)."""

    def __init__(self, tokenizer: Any, passages: Mapping[str, Sequence[str]] | None = None, seed: int = 0) -> None:
        """`passages`: source -> passages (default: `train_passages` of every source)."""
        chosen = passages if passages is not None else {s: train_passages(s) for s in SOURCES}
        self.streams: dict[str, list[int]] = {}
        for source, items in chosen.items():
            order = list(items)
            random.Random(f"text-{seed}-{source}").shuffle(order)
            ids: list[int] = []
            for enc in tokenizer.encode_batch([p + "\n\n" for p in order]):
                ids += enc.ids
            if not ids:
                raise ValueError(f"text source {source!r} has no tokens")
            self.streams[source] = ids

    def window(self, length: int, rng: random.Random) -> list[int]:
        """`length` consecutive tokens of one stream (the whole stream if it is shorter)."""
        stream = self.streams[rng.choice(sorted(self.streams))]
        start = rng.randrange(0, max(1, len(stream) - length + 1))
        return stream[start:start + length]
