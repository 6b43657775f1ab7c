"""PD disaggregation keeps the exactness label (no PD run, no RDMA: CPU only). The label's row
(`label_transfer`): every label shape round trips bit for bit, and a row that is missing, another
request's or damaged fails closed. SGLang's real `MetadataBuffers` under the patch
(`patches/tail_replay/disagg.py`): the prefill side's `set_buf`, a byte copy of every buffer
`get_buf_infos` lists (what a transfer engine does, row to row, stopping at the shorter list), and
the decode side's commit: the decode server's `answer_label` is the prefill server's; without the
label's buffer on either side, or with zeros, it is `exact: false`."""

from __future__ import annotations

import ctypes
import json
import math
from dataclasses import replace
from types import SimpleNamespace

from sglang_ext import patches

patches.apply_patches("cpu")  # before any SGLang import

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.utils import MetadataBuffers  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from sglang_ext.patches.tail_replay import disagg  # noqa: E402
from sglang_ext.tail_replay import label_transfer as lt  # noqa: E402
from sglang_ext.tail_replay.config import TailReplayConfig  # noqa: E402
from sglang_ext.tail_replay.metrics import answer_label  # noqa: E402
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan  # noqa: E402
from sglang_ext.tail_replay.provenance.bounds import TAINT, CarryBound  # noqa: E402
from sglang_ext.tail_replay.provenance.forward import StateBound  # noqa: E402
from sglang_ext.tail_replay.request import RECORD_ATTR, TailReplayRequest, record_of  # noqa: E402

PROMPT = 101
ROOM = 0x5EADBEEF12345678   # SGLang's bootstrap rooms are random 63-bit values
UNLABELLED = {"kind": "transferred_unlabelled", "exact": False, "kv_exact": False, "bound": None}


@pytest.fixture(autouse=True)
def first_rank():
    """`answer_label` counts on the replica's first rank: the ranks faked as a one-rank server."""
    with get_parallel().override(attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, tp_size=1,
                                 moe_tp_size=1, moe_ep_size=1, moe_dp_size=1, pp_rank=0, pp_size=1):
        yield


@pytest.fixture
def labelling(monkeypatch):
    """Both servers serve with Tail-Replay (the meta seam's rule, read from the server args)."""
    monkeypatch.setattr(disagg, "_labels_here", lambda: True)


# ------------------------------------------------------------------------------- records, labels


def _exact_reading_taint() -> TailReplayRequest:
    record = TailReplayRequest(config=TailReplayConfig.of(exactness="exact_first"))
    record.begin_match(PROMPT)
    record.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 100, 100, 100), None, TAINT)
    return record


def _strictly_exact() -> TailReplayRequest:
    record = TailReplayRequest(config=TailReplayConfig.of(exactness="exact"))
    record.begin_match(PROMPT)
    record.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 96, 96, 96))
    return record


def _approximate(per_layer: int = 3) -> TailReplayRequest:
    """A pressed request's approximate hit, audited, with the state bound from its tail's gates."""
    from sglang_ext.tail_replay.pressure import PressurePolicy

    config = TailReplayConfig.of(exactness="exact_unless_pressed", pressure=PressurePolicy(token_usage=0.8),
                              pressed_by=("token_usage", "mamba_usage"))
    record = TailReplayRequest(config=config)
    record.begin_match(PROMPT)
    record.set_plan(ReplayPlan(HitKind.APPROXIMATE, 100, 90, 90, pressure="approximate", planned_bound=0.004),
                    CarryBound(90, math.log(0.25)))
    record.acc.bound = StateBound(0.03125, tuple(0.03125 / (i + 1) for i in range(per_layer)))
    record.audit = "sampled"
    return record


def _miss() -> TailReplayRequest:
    record = TailReplayRequest(config=TailReplayConfig())
    record.begin_match(PROMPT)
    record.set_plan(ReplayPlan(HitKind.MISS, 0, 0, 0))
    return record


def _assembled() -> TailReplayRequest:
    record = _miss()
    record.drop_plan("assembled")
    return record


RECORDS = {"exact_reading_taint": _exact_reading_taint, "strictly_exact": _strictly_exact,
           "approximate": _approximate, "miss": _miss, "assembled": _assembled, "no_record": lambda: None}


# ------------------------------------------------------------------------------- the row, pure


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_every_label_shape_round_trips_bit_for_bit(name):
    label = answer_label(RECORDS[name](), PROMPT)
    words = lt.encode_label(label, ROOM)
    assert words is not None and len(words) == lt.ROW_WORDS
    decoded = lt.decode_label(words, ROOM)
    assert decoded == label
    assert json.dumps(decoded) == json.dumps(label)   # same keys, same order, the same float bits
    assert lt.decode_side_label(words, ROOM) == label


def test_the_labels_that_matter_are_what_the_test_expects():
    """The shapes above are the interesting ones (not all fail-closed labels)."""
    assert answer_label(_strictly_exact(), PROMPT)["exact"] is True
    assert answer_label(_strictly_exact(), PROMPT)["kv_exact"] is True
    taint = answer_label(_exact_reading_taint(), PROMPT)
    assert taint["exact"] is True and taint["kv_exact"] is False and taint["bound"] == TAINT
    approximate = answer_label(_approximate(), PROMPT)
    assert approximate["exact"] is False and approximate["bound"] == pytest.approx(0.25)
    assert approximate["state_bound_per_layer"] and approximate["pressure"]["pressed_by"] == ["token_usage", "mamba_usage"]
    assert approximate["audit"] == "sampled"


def test_a_row_that_is_not_this_requests_fails_closed():
    words = lt.encode_label(answer_label(_strictly_exact(), PROMPT), ROOM)
    assert lt.decode_label(words, ROOM)["exact"] is True
    not_ours = [None, [0] * lt.ROW_WORDS, words[:-1], [*words, 0], [float(w) for w in words]]
    for row in not_ours:
        assert lt.decode_label(row, ROOM) is None
        assert lt.decode_side_label(row, ROOM) == UNLABELLED
    assert lt.decode_label(words, ROOM + 1) is None           # another request's row (a stale slot)
    assert lt.decode_label(words, None) is None
    assert lt.decode_side_label(words, ROOM + 1) == UNLABELLED
    top = 2**64 - 5                                           # uint64 rooms past int64 still compare
    assert lt.decode_label(lt.encode_label(answer_label(None, PROMPT), top), top)["kind"] == "untracked"
    assert lt.decode_label(lt.encode_label(answer_label(None, PROMPT), top), top - 2**63) is None


def test_a_damaged_row_fails_closed_whichever_bit():
    words = lt.encode_label(answer_label(_approximate(), PROMPT), ROOM)
    for position in range(lt.ROW_WORDS):
        for bit in (0, 17, 62):
            damaged = list(words)
            damaged[position] ^= 1 << bit
            assert lt.decode_label(damaged, ROOM) is None, (position, bit)


def test_an_inconsistent_row_fails_closed_even_with_a_good_crc():
    """A row written by a buggy writer: kv_exact with a bound > 0, exact without a bound."""
    label = answer_label(_exact_reading_taint(), PROMPT)
    for bad in ({**label, "kv_exact": True}, {**label, "bound": None}, {**label, "bound": float("nan")}):
        words = lt.encode_label(bad, ROOM)
        assert words is None or lt.decode_label(words, ROOM) is None, bad


def test_a_row_of_another_version_is_not_read():
    words = lt.encode_label(answer_label(_strictly_exact(), PROMPT), ROOM)
    other = list(words)
    other[1] = lt.VERSION + 1
    other[-1] = lt._crc(other)
    assert lt.decode_label(other, ROOM) is None


def test_a_label_this_version_cannot_carry_is_not_encoded():
    label = answer_label(_strictly_exact(), PROMPT)
    assert lt.encode_label({**label, "new_field": 1}, ROOM) is None   # unknown key: zeros, fail closed
    assert lt.encode_label({**label, "kind": "new_kind"}, ROOM) is None
    assert lt.encode_label({**label, "exact": 1}, ROOM) is None
    many = answer_label(_approximate(per_layer=lt.MAX_LAYERS + 1), PROMPT)
    decoded = lt.decode_label(lt.encode_label(many, ROOM), ROOM)
    assert decoded == {**many, "state_bound_per_layer": None}        # the max is kept, the list is not
    fits = answer_label(_approximate(per_layer=lt.MAX_LAYERS), PROMPT)
    assert lt.decode_label(lt.encode_label(fits, ROOM), ROOM) == fits


def test_a_retransferred_request_never_becomes_exact_again():
    exact = answer_label(_strictly_exact(), PROMPT)
    approximate = answer_label(_approximate(), PROMPT)
    merged = lt.merge_labels(approximate, exact)
    assert merged["exact"] is False and merged["kv_exact"] is False and merged["bound"] == approximate["bound"]
    assert lt.merge_labels(exact, approximate) == approximate
    assert lt.merge_labels(UNLABELLED, exact) == UNLABELLED
    assert lt.merge_labels(exact, UNLABELLED) == UNLABELLED
    assert lt.merge_labels(None, exact) == exact


# ------------------------------------------------------------------------------- MetadataBuffers


def _buffers() -> MetadataBuffers:
    return MetadataBuffers(6, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4,
                           max_top_logprobs_num=16)


def _req(index: int, record: TailReplayRequest | None, room: int = ROOM, output_id: int = 42) -> SimpleNamespace:
    """The fields of SGLang's `Req` that `set_buf` and the label read."""
    req = SimpleNamespace(metadata_buffer_index=index, output_ids=[output_id], cached_tokens=96,
                          cached_tokens_device=96, cached_tokens_host=0, cached_tokens_storage=0,
                          get_mm_token_counts=lambda: (0, 0, 0), return_logprob=False, logprob_start_len=-1,
                          return_sampling_mask=False, hidden_states_tensor=None, bootstrap_room=room,
                          origin_input_ids=list(range(PROMPT)), sampling_params=SimpleNamespace(custom_params=None))
    if record is not None:
        setattr(req, RECORD_ATTR, record)
    return req


def _transfer(src: MetadataBuffers, src_index: int, dst: MetadataBuffers, dst_index: int) -> None:
    """A transfer engine's aux copy (mooncake / nixl `send_aux`): buffer i of the prefill's list to
    buffer i of the decode's, one row, the prefill's item length, up to the shorter list."""
    src_ptrs, _, src_items = src.get_buf_infos()
    dst_ptrs, _, dst_items = dst.get_buf_infos()
    for i in range(min(len(src_ptrs), len(dst_ptrs))):
        assert src_items[i] == dst_items[i], f"buffer {i} misaligned"   # would write past the decode's row
        ctypes.memmove(dst_ptrs[i] + src_items[i] * dst_index, src_ptrs[i] + src_items[i] * src_index, src_items[i])


def _commit(dst: MetadataBuffers, dst_index: int, room: int = ROOM, tree_cache=None) -> SimpleNamespace:
    """The decode side's commit (the patched `DecodeTransferQueue._commit_transfer_to_req`) over
    a stand-in for SGLang's body: it reads the row with `get_buf`, as SGLang does."""
    decode_req = SimpleNamespace(metadata_buffer_index=dst_index, req=_req(dst_index, None, room=room, output_id=0))
    decode_req.req.output_ids = []

    def sglang_commit(queue, dreq):
        fields = queue.metadata_buffers.get_buf(dreq.metadata_buffer_index)
        dreq.req.output_ids.append(int(fields[0][0]))
        dreq.req.transferred_room = int(fields[-1][0])

    queue = SimpleNamespace(metadata_buffers=dst, tree_cache=tree_cache)
    disagg._wrap_commit(sglang_commit)(queue, decode_req)
    return decode_req.req


def test_the_patch_adds_one_buffer_last_and_applies_once():
    buffers = _buffers()
    rows = getattr(buffers, disagg.BUFFER_ATTR)
    assert rows.shape == (6, lt.ROW_WORDS) and rows.dtype == torch.int64 and rows[0].nbytes >= 64
    ptrs, lens, items = buffers.get_buf_infos()
    assert ptrs[-1] == rows.data_ptr() and lens[-1] == rows.nbytes and items[-1] == rows[0].nbytes
    assert ptrs[-2] == buffers.bootstrap_room.data_ptr()   # SGLang's own list, unchanged, before it
    disagg.apply()                                         # idempotent
    assert len(_buffers().get_buf_infos()[0]) == len(ptrs)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_the_decode_side_answers_with_the_prefill_sides_label(name, labelling):
    prefill, decode = _buffers(), _buffers()
    record = RECORDS[name]()
    req = _req(1, record)
    prefill.set_buf(req)                                   # SGLang's prefill, last chunk
    expected = answer_label(record, PROMPT)                # the prefill server's own meta_info label
    _transfer(prefill, 1, decode, 4)                       # another row index on the decode side
    decoded = _commit(decode, 4)
    assert decoded.output_ids == [42] and decoded.transferred_room == ROOM   # SGLang's fields still line up
    carried = answer_label(record_of(decoded), PROMPT)
    assert carried == expected
    assert json.dumps(carried) == json.dumps(expected)


def test_an_exact_prefill_answer_stays_exact_and_an_approximate_keeps_its_bound(labelling):
    for make, exact, bound in ((_strictly_exact, True, 0.0), (_approximate, False, 0.25)):
        prefill, decode = _buffers(), _buffers()
        prefill.set_buf(_req(0, make()))
        _transfer(prefill, 0, decode, 0)
        label = answer_label(record_of(_commit(decode, 0)), PROMPT)
        assert label["exact"] is exact and label["bound"] == pytest.approx(bound), label


def test_a_stock_prefill_or_no_copy_fails_closed(labelling):
    """The decode side has the buffer, the prefill side does not (stock SGLang: its list is one
    shorter, the engine copies the common ones), or nothing was copied (the fake backend)."""
    stock, decode = _buffers(), _buffers()
    delattr(stock, disagg.BUFFER_ATTR)                     # an unpatched MetadataBuffers
    stock.set_buf(_req(2, _strictly_exact()))
    _transfer(stock, 2, decode, 3)
    req = _commit(decode, 3)
    assert req.output_ids == [42] and answer_label(record_of(req), PROMPT) == UNLABELLED
    fake = _commit(_buffers(), 5)                          # the fake backend copies nothing
    assert answer_label(record_of(fake), PROMPT) == UNLABELLED


def test_a_stock_decode_still_reads_sglangs_fields():
    """The prefill side has the buffer, the decode side does not: SGLang's own rows line up."""
    prefill, stock = _buffers(), _buffers()
    delattr(stock, disagg.BUFFER_ATTR)
    prefill.set_buf(_req(1, _strictly_exact()))
    _transfer(prefill, 1, stock, 2)
    fields = stock.get_buf(2)
    assert int(fields[0][0]) == 42 and int(fields[1][0]) == 96 and int(fields[-1][0]) == ROOM


def test_a_reused_row_carries_no_earlier_label(labelling, monkeypatch):
    """The prefill side overwrites the whole row for every request; the decode side clears it
    with SGLang's fields and reads only its own room's."""
    prefill, decode = _buffers(), _buffers()
    prefill.set_buf(_req(1, _strictly_exact()))
    _transfer(prefill, 1, decode, 1)
    assert answer_label(record_of(_commit(decode, 1, room=ROOM + 7)), PROMPT) == UNLABELLED   # not its room
    decode.clear_slot(1)
    assert not bool(getattr(decode, disagg.BUFFER_ATTR)[1].any())
    monkeypatch.setattr(disagg, "_labels_here", lambda: False)   # a prefill that does not label
    prefill.set_buf(_req(1, None, room=ROOM + 1))
    assert not bool(getattr(prefill, disagg.BUFFER_ATTR)[1].any())


def test_the_decode_side_reusing_its_own_tree_kv_is_untracked(labelling):
    """`--disaggregation-decode-enable-radix-cache`: the decode side planned a prefix from its own
    tree, whose KV of transferred requests is UNTRACKED: the answer read KV of unknown provenance."""
    prefill, decode = _buffers(), _buffers()
    prefill.set_buf(_req(0, _strictly_exact()))
    _transfer(prefill, 0, decode, 0)
    own = TailReplayRequest(config=TailReplayConfig())
    own.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 64, 64, 64))
    tree = SimpleNamespace(request_record=lambda req: own)
    req = _commit(decode, 0, tree_cache=tree)
    assert record_of(req) is None and own.carried_label is not None   # the cache's record took it
    assert answer_label(own, PROMPT) == {"kind": "untracked", "exact": False, "kv_exact": False, "bound": None}
    no_prefix = replace(own.plan, matched_tokens=0, prefix_len=0, replay_start=0)
    own.set_plan(no_prefix)
    own.carried_label = None
    _commit(decode, 0, tree_cache=tree)
    assert answer_label(own, PROMPT)["exact"] is True


def test_a_rebootstrapped_request_keeps_its_earlier_label(labelling):
    prefill, decode = _buffers(), _buffers()
    prefill.set_buf(_req(0, _approximate()))
    _transfer(prefill, 0, decode, 0)
    req = _commit(decode, 0)
    record = record_of(req)
    prefill.set_buf(_req(0, _strictly_exact()))          # the prefill recomputed it exactly
    _transfer(prefill, 0, decode, 0)
    disagg.carry_label(None, req, disagg.read_label(decode, 0))
    label = answer_label(record, PROMPT)
    assert label["exact"] is False and label["bound"] == pytest.approx(0.25)


def test_a_server_that_does_not_label_attaches_nothing(monkeypatch):
    monkeypatch.setattr(disagg, "_labels_here", lambda: False)
    prefill, decode = _buffers(), _buffers()
    prefill.set_buf(_req(0, _strictly_exact()))           # planned: the prefill side still carries it
    assert bool(getattr(prefill, disagg.BUFFER_ATTR)[0].any())
    _transfer(prefill, 0, decode, 0)
    assert record_of(_commit(decode, 0)) is None
