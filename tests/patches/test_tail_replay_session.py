"""`patches/tail_replay/session.py`: a finished streaming turn's own tail goes with its row to the
session, also for a turn that was retracted before it finished (SGLang's `finish_req` then
detaches `req.session` inside the call the patch wraps; found by the fuzzer's retraction path)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_ext.patches.tail_replay import session as tail_replay_session


class _Session:
    """The slice of SGLang's `StreamingSession` the wrapper reads: `slots`, `cache`, and the
    original call, which (like SGLang's for a turn retracted once) detaches `req.session`."""

    def __init__(self, detach: bool):
        self.slots = {"s1": "slot-of-s1"}
        self.cache = "cache"
        self.detach = detach

    def try_cache_finished_req(self, req):
        if self.detach:
            req.session = None
        return True


def _run(monkeypatch, detach: bool, finished: bool = True):
    handed = []
    monkeypatch.setattr(tail_replay_session, "hand_to_session", lambda cache, req, slot: handed.append((cache, slot)))
    wrapped = tail_replay_session._wrap(_Session.try_cache_finished_req)
    req = SimpleNamespace(session=SimpleNamespace(session_id="s1"), finished=lambda: finished)
    assert wrapped(_Session(detach), req) is True
    return handed


def test_the_turns_tail_goes_to_its_session_slot(monkeypatch):
    assert _run(monkeypatch, detach=False) == [("cache", "slot-of-s1")]


def test_a_turn_whose_session_was_detached_by_sglang_still_hands_its_tail_over(monkeypatch):
    assert _run(monkeypatch, detach=True) == [("cache", "slot-of-s1")]


def test_a_retracted_turn_keeps_its_tail_until_it_finishes(monkeypatch):
    assert _run(monkeypatch, detach=False, finished=False) == []
