"""Continuation perplexity (eval/quality/perplexity.py): sample cutting, log-prob parsing, summary math
on hand-computed cases. The live-server path is in test_quality_server.py."""

from __future__ import annotations

import math

import pytest

from eval import corpus
from eval.quality import perplexity


def _row(key, config, logprobs, group="1K", replayed=0):
    return {"key": key, "config": config, "group": group, "logprobs": logprobs, "nll": -sum(logprobs) / len(logprobs),
            "replayed_tokens": replayed}


def test_summary_on_a_hand_computed_case(monkeypatch):
    monkeypatch.setattr(perplexity, "POSITION_BUCKET", 2)
    rows = [_row("a", "full", [-1.0, -2.0, -3.0]), _row("a", "tr-5", [-1.5, -2.5, -3.0], replayed=10),
            _row("b", "full", [-1.0, -1.0, -1.0]), _row("b", "tr-5", [-2.0, -1.0, -1.0], replayed=20)]
    table = perplexity.summarize(rows)["1K"]
    # deltas a: [0.5, 0.5, 0]; b: [1.0, 0, 0] -> mean 2/6
    assert table["tr-5"]["delta_nats"] == pytest.approx(2 / 6)
    assert table["tr-5"]["ppl_ratio"] == pytest.approx(math.exp(2 / 6))
    assert table["tr-5"]["curve"] == pytest.approx([(0.5 + 0.5 + 1.0 + 0.0) / 4, 0.0])
    assert table["tr-5"]["replayed"] == 15 and table["tr-5"]["samples"] == 2
    assert table["full"]["delta_nats"] == 0.0 and table["full"]["ppl_ratio"] == 1.0
    assert table["tr-5"]["nll"] == pytest.approx((7 / 3 + 4 / 3) / 2)


def test_rows_without_a_full_reference_are_left_out():
    rows = [_row("a", "full", [-1.0]), _row("a", "tr-5", [-2.0]), _row("b", "tr-5", [-9.0])]
    assert perplexity.summarize(rows)["1K"]["tr-5"]["delta_nats"] == pytest.approx(1.0)


def test_continuation_logprobs_skip_the_documents_last_token_and_refuse_gaps():
    meta = {"input_token_logprobs": [[None, 7, None], [-0.5, 8, None], [-1.25, 9, None]]}
    assert perplexity.continuation_logprobs(meta, 2) == [-0.5, -1.25]
    with pytest.raises(RuntimeError, match="expected 3 continuation"):
        perplexity.continuation_logprobs(meta, 3)
    with pytest.raises(RuntimeError, match="1 missing"):
        perplexity.continuation_logprobs({"input_token_logprobs": [[None, 1], [None, 2]]}, 1)


def test_samples_are_contiguous_held_out_text_of_the_asked_lengths():
    encode = lambda text: [ord(c) for c in text]   # noqa: E731  (one id per character)
    samples = perplexity.make_samples(encode, [300], 40, 2, sources=("essays", "squad"))
    assert [s.key for s in samples] == ["perplexity/essays/300-0", "perplexity/essays/300-1",
                                        "perplexity/squad/300-0", "perplexity/squad/300-1"]
    essay = " ".join(corpus.essay_sentences("eval"))
    for s in samples:
        assert len(s.doc_ids) == 300 and len(s.cont_ids) == 40 and s.group == "0.3K"
        if s.source == "essays":   # the continuation is the text that follows the document
            assert "".join(map(chr, s.doc_ids + s.cont_ids)) in essay
    assert samples == perplexity.make_samples(encode, [300], 40, 2, sources=("essays", "squad"))   # seeded
    with pytest.raises(ValueError, match="unknown perplexity source 'wiki'"):
        perplexity.make_samples(encode, [10], 5, 1, sources=("wiki",))
