"""The demo's table (`eval.demo`): per request, besides prompt, reused tokens and latency, whether
the answer was exact and, when not, its bound, read from meta_info's `tail_replay` block (the
served end to end: `python -m eval.demo`)."""

from __future__ import annotations

from eval.demo import EXACTNESS_NOTE, Turn, exactness, format_turns


def _meta(summary: dict | None) -> dict:
    details = {"device": 10, "host": 0}
    if summary is not None:
        details["tail_replay"] = summary
    return {"prompt_tokens": 20, "cached_tokens": 10, "cached_tokens_details": details}


def test_exactness_is_read_from_the_tail_replay_block():
    assert exactness(_meta({"kind": "approximate", "exact": False, "bound": 0.0321})) == (False, 0.0321)
    assert exactness(_meta({"kind": "exact_checkpoint", "exact": True, "bound": 0.0})) == (True, 0.0)
    # the state was exact, but the request read approximate KV: not an exact answer
    assert exactness(_meta({"kind": "miss", "exact": True, "kv_exact": False, "bound": 0.0})) == (False, 0.0)


def test_an_answer_without_a_tail_replay_block_is_exact():
    assert exactness(_meta(None)) == (True, None)                       # stock SGLang
    assert exactness({"prompt_tokens": 3, "cached_tokens": 0}) == (True, None)
    assert exactness({"cached_tokens_details": None}) == (True, None)


def test_the_table_has_the_exactness_column():
    table = format_turns([Turn("turn 1", 2003, 0, 1.5),
                          Turn("turn 2", 2015, 2011, 0.25, exact=True, bound=0.0),
                          Turn("new conversation", 2003, 1900, 0.5, exact=False, bound=0.0321)])
    header, rule, *rows = table.splitlines()
    assert header == "| request | prompt tokens | reused (cached) tokens | latency (s) | exact answer |"
    assert rule == "|---|---:|---:|---:|---|"
    assert rows == ["| turn 1 | 2003 | 0 | 1.500 | yes |",
                    "| turn 2 | 2015 | 2011 | 0.250 | yes |",
                    "| new conversation | 2003 | 1900 | 0.500 | no (bound 3.2e-02) |"]


def test_the_note_says_what_the_difference_means():
    assert "a server without cache" in EXACTNESS_NOTE and "bound" in EXACTNESS_NOTE
    assert '"exact"' in EXACTNESS_NOTE
