"""`python -m eval.linearkv.served`'s pure parts: the spans it declares and its comparison table."""

from __future__ import annotations

from eval.linearkv.data import PicSample
from eval.linearkv.served import _ids, _spans, table


def _sample() -> PicSample:
    return PicSample("niah", 64, 0, prefix=(1, 2, 3), chunks=((4, 5), (6, 7, 8), (9,)), suffix=(10, 11),
                     answers=("x",), metric="string_match_all")


def test_spans_tile_the_chunks_between_prefix_and_question():
    s = _sample()
    assert _ids(s) == list(range(1, 12))
    assert _spans(s) == [[3, 5], [5, 8], [8, 9]]


def _rec(key: str, score: float, hit: bool, output: list[int]) -> dict:
    model, task, length, index, sel, rule = key.split("|")
    return {"key": key, "model": model, "rule": rule, "hit": hit, "score": score, "full_score": 100.0,
            "output": output, "same_as_full": True, "drift": 0.01, "stop": [0]}


def test_table_compares_hits_only_against_the_reference_items():
    keys = [f"m|niah|1024|{i}|none|predecessor" for i in range(3)]
    server = [_rec(keys[0], 100.0, True, [5, 0]), _rec(keys[1], 0.0, True, [6]), _rec(keys[2], 0.0, False, [7])]
    reference = {keys[0]: {"score": 100.0, "full_score": 100.0, "output": [5, 0], "drift": 0.02},
                 keys[1]: {"score": 100.0, "full_score": 100.0, "output": [8, 0], "drift": 0.02},
                 keys[2]: {"score": 100.0, "full_score": 100.0, "output": [7, 0], "drift": 0.02}}
    row = table(server, reference).splitlines()[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 2 scored items (the miss is left out); server 50 vs reference 100; outputs equal on 1 of 2
    assert cells[3:8] == ["2", "2 / 3", "100.0", "50.0", "-50.0"]
    assert cells[10] == "50 %"


def test_table_has_a_row_per_selector():
    keys = ["m|niah|1024|0|none|predecessor", "m|niah|1024|0|epic-16|predecessor"]
    server = [{**_rec(k, 100.0, True, [5, 0]), "selector": k.split("|")[4]} for k in keys]
    reference = {k: {"score": 100.0, "full_score": 100.0, "output": [5, 0], "drift": 0.02} for k in keys}
    rows = table(server, reference).splitlines()[2:4]
    assert [r.split("|")[2].strip() for r in rows] == ["epic-16", "none"]
