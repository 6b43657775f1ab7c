"""The LinearKV evaluation's workloads: chunks recur across prompts, facts sit in different chunks."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval.linearkv.data import NEEDLE, Builder

TOKENIZER = Path(__file__).resolve().parents[2] / "trained_models" / "gdn-ruler" / "tokenizer.json"


@pytest.fixture(scope="module")
def builder():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    return Builder(tok, chunk_tokens=128, pool_size=24, seed=0), tok


def test_niah_chunks_recur_at_other_offsets_and_one_chunk_holds_each_needle(builder):
    b, tok = builder
    samples = [b.sample("niah_mk", 1024, i) for i in range(3)]
    for s in samples:
        assert 900 <= s.n_tokens <= 1024
        texts = [tok.decode(list(c)) for c in s.chunks]
        holders = [t for t in texts if "special magic numbers for" in t]
        assert len(holders) == 4                                   # four needles, four different chunks
        assert sum(s.answers[0] in t for t in texts) == 1
    offsets: dict[tuple, set[int]] = {}
    for s in [b.sample("niah", 1024, i) for i in range(5)]:
        at = len(s.prefix)
        for c in s.chunks:
            offsets.setdefault(c, set()).add(at)
            at += len(c)
    assert any(len(o) > 1 for o in offsets.values())              # a shared chunk at two offsets
    assert b.sample("niah", 1024, 1) == b.sample("niah", 1024, 1)  # deterministic


def test_qa_supporting_paragraphs_are_separate_chunks(builder):
    b, tok = builder
    s = b.sample("qa", 1024, 0)
    item = b._qa_items[0]
    gold_chunks = [c for c in s.chunks if any(tok.decode(list(c)).strip() == g.strip() for g in item.gold)]
    assert len(gold_chunks) == len(item.gold) >= 2
    assert s.answers == item.answers and s.n_tokens <= 1024
    assert tok.decode(list(s.suffix)).rstrip().endswith("Answer:")
    assert NEEDLE.format(type_v="numbers", key="k", value="1") not in tok.decode(list(s.prefix))
