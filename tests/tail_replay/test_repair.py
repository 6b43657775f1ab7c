"""Exact repair's pure parts (`sglang_ext.tail_replay.repair`: when a request is repaired, what is
recomputed, the repair run's overrides and config keys) and the tokenizer side's reading of a batch
output (`patches/tail_replay/repair.py`'s `_repairs_due`) on duck-typed objects, with
no server (the served path: tests/e2e/test_tail_replay_server.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_ext.patches.tail_replay import audit as tail_replay_audit
from sglang_ext.patches.tail_replay import repair as tail_replay_repair
from sglang_ext.tail_replay.config import BACKGROUND_PARAM_KEY, DEFAULTS, TailReplayConfigError, config_from_dict
from sglang_ext.tail_replay.repair import (
    REPAIR_KEY,
    SHARED_REPAIR_KEY,
    branch_repair_due,
    repair_due,
    repair_overrides,
    repair_sequence,
    shared_repair_due,
)
from sglang_ext.tail_replay.request_fields import background_mark, check_request, request_overrides

ON = config_from_dict({"repair": True})


def _marked(overrides: dict) -> dict:
    """custom_params of a background run as the scheduler sees it (the tokenizer process marks it)."""
    return {BACKGROUND_PARAM_KEY: background_mark(overrides)}


def test_off_by_default():
    assert DEFAULTS.knobs.repair is False
    assert not repair_due(DEFAULTS, exact=False, finished=True)


@pytest.mark.parametrize(("exact", "finished", "due"), [(False, True, True), (True, True, False),
                                                         (False, False, False), (True, False, False)])
def test_only_a_finished_answer_that_was_not_exact_is_repaired(exact, finished, due):
    assert repair_due(ON, exact=exact, finished=finished) is due


@pytest.mark.parametrize("overrides", [{"repair_of": "r1"}, {"audit_of": "r1"}, {"exactness": "exact"}])
def test_background_runs_and_the_exact_mode_are_never_repaired(overrides):
    config = ON.replaced(**overrides)
    assert not repair_due(config, exact=False, finished=True)


def test_the_sequence_is_what_sglang_caches_for_a_finished_request():
    assert repair_sequence([1, 2, 3], [7, 8, 9]) == [1, 2, 3, 7, 8]
    assert repair_sequence([1, 2, 3], [7]) == [1, 2, 3]
    assert repair_sequence([1, 2, 3], []) == [1, 2, 3]


def test_repair_run_overrides_are_a_valid_request_that_is_exact_and_not_repaired_again():
    config = request_overrides(ON, _marked(repair_overrides("rid-7")))
    assert config.strict and config.repair_of == "rid-7" and config.background
    assert config.knobs.keep_checkpoints == ON.knobs.keep_checkpoints   # the server's way of keeping states
    assert not repair_due(config, exact=False, finished=True)


def test_config_keys():
    assert config_from_dict({"repair": True}).knobs.repair is True
    with pytest.raises(TailReplayConfigError, match="'repair_of': is set by the server.*a server config cannot"):
        config_from_dict({"repair_of": "x"})
    with pytest.raises(TailReplayConfigError, match="'repair'.*wrong type"):
        config_from_dict({"repair": 1})
    with pytest.raises(TailReplayConfigError, match="'repair': is refused on this server: per-request audit and repair "
                                                    "are off \\(server config key 'allow_request_audit_repair' is false"):
        check_request(ON, {"tail_replay": {"repair": True}})
    allowing = config_from_dict({"allow_request_audit_repair": True})
    assert check_request(allowing, {"tail_replay": {"repair": True}}).knobs.repair is True
    with pytest.raises(TailReplayConfigError, match="'repair_of': is set by the server.*a request cannot"):
        check_request(allowing, {"tail_replay": {"repair_of": "someone-else"}})


def test_a_request_turns_shared_state_repair_off_freely_but_on_only_where_the_server_allows_it():
    """Each shared-state repair buys an extra exact prefill: `repair_shared: true` from a request
    needs `allow_request_audit_repair` (also where the server has it off); `false` is always allowed."""
    off = config_from_dict({"repair_shared": False})
    for base in (DEFAULTS, off):
        assert check_request(base, {"tail_replay": {"repair_shared": False}}).knobs.repair_shared is False
        with pytest.raises(TailReplayConfigError, match="'repair_shared': true is refused on this server: per-request "
                                                        "audit and repair are off \\(server config key "
                                                        "'allow_request_audit_repair' is false"):
            check_request(base, {"tail_replay": {"repair_shared": True}})
    allowing = config_from_dict({"allow_request_audit_repair": True, "repair_shared": False})
    assert check_request(allowing, {"tail_replay": {"repair_shared": True}}).knobs.repair_shared is True


def _output(details, reasons, rids):
    return SimpleNamespace(cached_tokens_details=details, finished_reasons=reasons, rids=rids)


def test_tokenizer_side_removes_the_key_from_every_entry_and_sends_only_finished_ones():
    states = {rid: SimpleNamespace(obj=f"obj-{rid}") for rid in ("a", "b", "c", "d")}
    details = [{"device": 1, "tail_replay": {"exact": False}, REPAIR_KEY: [1, 2, 5]},
               {"device": 0, REPAIR_KEY: [3]},                        # aborted
               {"device": 0, REPAIR_KEY: [4]},                        # not finished (never sent so, but safe)
               None]
    reasons = [{"type": "length"}, {"type": "abort", "message": "client gone"}, None, {"type": "stop"}]
    due = tail_replay_repair._repairs_due(_output(details, reasons, ["a", "b", "c", "d"]), states)
    assert due == [("a", [1, 2, 5], "obj-a", "answer")]
    assert all(REPAIR_KEY not in entry for entry in details if entry)
    assert details[0] == {"device": 1, "tail_replay": {"exact": False}}


def test_tokenizer_side_skips_a_request_whose_state_is_gone():
    details = [{REPAIR_KEY: [1, 2]}]
    assert tail_replay_repair._repairs_due(_output(details, [{"type": "stop"}], ["gone"]), {}) == []
    assert details == [{}]


def test_tokenizer_side_sends_a_shared_state_repair_beside_an_answers():
    states = {"a": SimpleNamespace(obj="obj-a"), "b": SimpleNamespace(obj="obj-b")}
    details = [{"device": 1, SHARED_REPAIR_KEY: [1, 2], REPAIR_KEY: [1, 2, 3, 4]}, {SHARED_REPAIR_KEY: [7]}]
    due = tail_replay_repair._repairs_due(_output(details, [{"type": "stop"}, {"type": "abort"}], ["a", "b"]), states)
    assert due == [("a", [1, 2], "obj-a", "shared_state"), ("a", [1, 2, 3, 4], "obj-a", "answer")]
    assert details == [{"device": 1}, {}]   # the keys never reach a client, aborted or not


def test_tokenizer_side_sends_a_shared_state_repair_with_a_running_requests_first_output():
    """The branch rule's ask travels with the request's first output (a streamed first token):
    the shared prefix is sent at once, while the request decodes; an answer's repair is not (it
    waits for the finish)."""
    states = {"a": SimpleNamespace(obj="obj-a")}
    details = [{"device": 1, SHARED_REPAIR_KEY: [1, 2, 3], REPAIR_KEY: [9]}]
    due = tail_replay_repair._repairs_due(_output(details, [None], ["a"]), states)
    assert due == [("a", [1, 2, 3], "obj-a", "shared_state")]
    assert details == [{"device": 1}]


# ---------------------------------------------------------------- shared-state repair

KEEPS = {"approximate": True, "branches_here": True, "keeps_branch_states": True}


def test_the_request_that_creates_a_branch_asks_at_its_own_match_under_the_extra_buffer():
    assert branch_repair_due(DEFAULTS, **KEEPS)


@pytest.mark.parametrize("off", ["approximate", "branches_here", "keeps_branch_states"])
def test_the_branch_rule_needs_an_approximate_plan_a_branch_and_stocks_branch_states(off):
    """An exact plan keeps its own branch-point state (as stock's miss does); a match that ends at
    a leaf's end (a conversation's own next turn) or where the prompt ends creates no branch;
    without the extra buffer stock keeps no branch-point state, so nothing is asked at the branch."""
    assert not branch_repair_due(DEFAULTS, **{**KEEPS, off: False})


@pytest.mark.parametrize("overrides", [{"repair_shared": False}, {"repair_of": "r1"}, {"audit_of": "r1"}])
def test_the_branch_rule_is_off_with_shared_repair_and_for_background_runs(overrides):
    assert not branch_repair_due(DEFAULTS.replaced(**overrides), **KEEPS)


def test_shared_state_repair_is_on_by_default_for_an_approximate_state_conversations_branch_from():
    assert DEFAULTS.knobs.repair_shared is True
    assert shared_repair_due(DEFAULTS, bound=0.3, branches=2)
    assert shared_repair_due(DEFAULTS, bound=0.3, branches=5)


@pytest.mark.parametrize(("bound", "branches"), [(0.3, 1), (0.3, 0), (0.0, 2), (DEFAULTS.server.exact_threshold, 3)])
def test_a_conversations_own_state_or_an_exact_one_is_not_shared_state_repaired(bound, branches):
    assert not shared_repair_due(DEFAULTS, bound=bound, branches=branches)


@pytest.mark.parametrize("overrides", [{"repair_shared": False}, {"repair_of": "r1"}, {"audit_of": "r1"}])
def test_shared_state_repair_off_and_background_runs_never_ask(overrides):
    assert not shared_repair_due(DEFAULTS.replaced(**overrides), bound=0.3, branches=2)


def test_shared_state_repair_run_overrides_are_exact_background_and_ask_for_nothing():
    config = request_overrides(DEFAULTS, _marked(repair_overrides("rid-8", "shared_state")))
    assert config.strict and config.background and config.repair_of == "rid-8"
    assert config.repair_kind == "shared_state" and not config.knobs.repair_shared and not config.knobs.repair
    assert repair_overrides("rid-8")["repair_kind"] == "answer"


def test_repair_kind_is_checked_and_only_the_server_sets_it():
    with pytest.raises(TailReplayConfigError, match="'repair_kind'.*must be one of"):
        background_mark(repair_overrides("r", "branch"))
    for custom in ({"tail_replay": {"repair_kind": "answer"}}, _marked(repair_overrides("r"))):
        with pytest.raises(TailReplayConfigError, match="is set by the server on its own background runs; a request "
                                                        "cannot set it"):
            check_request(DEFAULTS, custom)
    with pytest.raises(TailReplayConfigError, match="'repair_kind': is set by the server.*a server config cannot"):
        config_from_dict({"repair_kind": "answer"})
    with pytest.raises(TailReplayConfigError, match="'repair_shared'.*wrong type"):
        config_from_dict({"repair_shared": "yes"})
    assert config_from_dict({"repair_shared": False}).knobs.repair_shared is False


@pytest.mark.parametrize("field", ["image_data", "video_data", "audio_data", "input_embeds"])
def test_a_request_whose_input_is_not_in_its_ids_is_never_repaired(field):
    """A repair re-sends the scheduler's token ids: for a multimodal request (placeholder tokens)
    or embeddings they are not its input, and the run would store other KV as exact under the
    same key. A session turn's ids are its whole history: repaired as any request."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    plain = GenerateReqInput(input_ids=[5, 6, 7], extra_key="t")
    assert tail_replay_repair.repair_request(None, "r1", [5, 6, 7, 8], plain).input_ids == [5, 6, 7, 8]
    session = GenerateReqInput(input_ids=[7], session_params={"id": "s"})
    assert tail_replay_repair.repair_request(None, "r2", [5, 6, 7, 8], session, "shared_state") is not None
    other = SimpleNamespace(**{field: [[0.5]] if field == "input_embeds" else ["x.png"]}, input_ids=[1, 2])
    assert tail_replay_repair.repair_request(None, "r3", [1, 2, 3], other) is None
    assert tail_replay_audit.reference_request(None, "r4", session) is None   # the audit's own guard stays
