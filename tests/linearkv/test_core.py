"""LinearKV pure core: chunk store errors, selectors' exact ids, state rules' choices."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.linearkv import (
    STATE_RULES,
    ChunkEntry,
    ChunkReferenceError,
    ChunkStore,
    LinearLayerState,
    chunk_id,
    get_state_rule,
    parse_selector,
)
from sglang_ext.linearkv.initializers import LayerChunks, Seed


def _entry(model_id="m", ids=(1, 2, 3), dtype=torch.float32, kv_dtype=None):
    kv_dtype = kv_dtype or dtype
    kv = {3: (torch.zeros(2, len(ids), 4, dtype=kv_dtype), torch.zeros(2, len(ids), 4, dtype=kv_dtype))}
    lin = {0: LinearLayerState(torch.ones(2, 4, 4), torch.ones(8, 4), torch.eye(4).expand(2, 4, 4))}
    return ChunkEntry(chunk_id(model_id, ids), model_id, tuple(ids), dtype, kv, lin)


def test_chunk_id_depends_on_model_and_content():
    assert chunk_id("a", [1, 2]) == chunk_id("a", [1, 2])
    assert chunk_id("a", [1, 2]) != chunk_id("b", [1, 2])
    assert chunk_id("a", [1, 2]) != chunk_id("a", [2, 1])
    assert chunk_id("a", [12]) != chunk_id("a", [1, 2])


def test_store_roundtrip_and_bad_references_name_the_chunk():
    store = ChunkStore("m", torch.float32)
    e = _entry()
    assert store.add(e) == e.chunk_id and store.get(e.chunk_id) is e and store.lookup([1, 2, 3]) is e
    with pytest.raises(ChunkReferenceError, match="'nope'.*unknown id"):
        store.get("nope")
    other = _entry(model_id="other-model")
    with pytest.raises(ChunkReferenceError, match=f"{other.chunk_id}.*belongs to model 'other-model'"):
        store.get(other)
    with pytest.raises(ChunkReferenceError, match="belongs to model 'other-model'"):
        store.add(other)
    wrong = _entry(ids=(4, 5), dtype=torch.float64)
    with pytest.raises(ChunkReferenceError, match=f"{wrong.chunk_id}.*dtype torch.float64"):
        store.get(wrong)
    mixed = _entry(ids=(6,), kv_dtype=torch.bfloat16)
    with pytest.raises(ChunkReferenceError, match=f"{mixed.chunk_id}.*layer 3 KV dtype"):
        store.add(mixed)
    forged = ChunkEntry("deadbeef", "m", (1,), torch.float32, {}, {})
    with pytest.raises(ChunkReferenceError, match="deadbeef.*does not match"):
        store.add(forged)
    with pytest.raises(ChunkReferenceError, match="expected a chunk id"):
        store.get(42)


def test_selectors_pick_exact_ids():
    chunks, suffix = [(2, 7), (7, 9), (9, 20)], (20, 23)
    assert parse_selector("none").plan(chunks, suffix) == [20, 21, 22]
    assert parse_selector("epic-3").plan(chunks, suffix) == [2, 3, 4, 7, 8, 9, 10, 11, 20, 21, 22]
    assert parse_selector("epic-0").plan(chunks, suffix) == [20, 21, 22]
    dev = torch.zeros(23)
    dev[[5, 12, 13, 19]] = torch.tensor([3.0, 1.0, 5.0, 2.0])
    dev[21] = 100.0                                   # question tokens are never candidates
    blend = parse_selector("cacheblend-0.15")        # floor(0.15 * 18) = 2
    assert blend.ratio == pytest.approx(0.15) and parse_selector("cacheblend-15") == blend
    assert blend.select(dev, chunks, suffix) == [5, 13, 20, 21, 22]
    assert parse_selector("cacheblend-0.2").select(dev, chunks, suffix) == [5, 13, 19, 20, 21, 22]
    assert parse_selector("cacheblend-0").select(dev, chunks, suffix) == [20, 21, 22]
    with pytest.raises(ValueError, match="check layer"):
        blend.plan(chunks, suffix)
    for bad in ("epic", "epic--1", "cacheblend-x", "cacheblend-150", "random-3", "none-1"):
        with pytest.raises(ValueError, match="bad selector"):
            parse_selector(bad)
    names = [parse_selector(s).name for s in ("none", "epic-16", "cacheblend-0.15")]
    assert names == ["none", "epic-16", "cacheblend-15"]


def test_state_rules_choose_the_documented_seed():
    def st(x):
        return LinearLayerState(torch.full((1, 2, 2), float(x)), torch.full((3, 4), float(x)), torch.full((1,), 0.5))

    chunks = LayerChunks("mamba2", [st(1), st(2), st(4)])
    pred = get_state_rule("predecessor")
    assert float(pred.seed(chunks, 0).state.abs().sum()) == 0          # no prefix: zero
    assert float(pred.seed(chunks, 2).state[0, 0, 0]) == 2 and float(pred.seed(chunks, 3).conv[0, 0]) == 4
    comp = get_state_rule("compose")                                   # h <- 0.5 h + s
    assert float(comp.seed(chunks, 1).state[0, 0, 0]) == 1
    assert float(comp.seed(chunks, 3).state[0, 0, 0]) == pytest.approx(0.25 * 1 + 0.5 * 2 + 4)
    assert float(comp.seed(chunks, 3).conv[0, 0]) == 4
    assert float(get_state_rule("packed-first").seed(chunks, 3).state[0, 0, 0]) == 1
    assert float(get_state_rule("packed-mean").seed(chunks, 0).state[0, 0, 0]) == pytest.approx(7 / 3)
    assert float(get_state_rule("packed-last").seed(chunks, 0).state[0, 0, 0]) == 4
    prefixed = LayerChunks("mamba2", chunks.chunks, Seed(torch.full((1, 2, 2), 8.0), torch.zeros(3, 4)))
    assert float(pred.seed(prefixed, 0).state[0, 0, 0]) == 8
    assert float(comp.seed(prefixed, 1).state[0, 0, 0]) == pytest.approx(0.5 * 8 + 1)
    assert float(get_state_rule("zero").seed(prefixed, 3).state.abs().sum()) == 0
    with pytest.raises(ValueError, match="unknown state initializer 'nope'"):
        get_state_rule("nope")
    with pytest.raises(ValueError, match="span index 4"):
        pred.seed(chunks, 4)
    assert {"zero", "predecessor", "compose"} <= set(STATE_RULES)
