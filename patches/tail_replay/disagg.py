"""PD disaggregation keeps Tail-Replay's answer label: the prefill server's label travels with the
transferred metadata, and the decode server, whose response the router returns, answers with it.

Under prefill-decode disaggregation the prefill server plans and computes the prompt (its record,
`sglang_ext.tail_replay.record_of`), then sends the KV, the linear state and the first output
token's metadata (`MetadataBuffers`: the prefill side writes a request's row with `set_buf`, the
transfer engine copies every buffer `get_buf_infos` lists, positionally, byte for byte; the decode
side reads the row in `DecodeTransferQueue._commit_transfer_to_req`). The decode server has no
record of how the prompt was computed, so it used to label every answer
`kind: "untracked", exact: false`.

Here `MetadataBuffers` gets one more buffer (`BUFFER_ATTR`: int64, `ROW_WORDS` words per row,
1 KiB, on the device and memory pool of SGLang's own metadata), listed LAST by `get_buf_infos` so
every transfer engine (mooncake, nixl, mori, ascend) copies it by construction, and a peer without
it (stock SGLang, or an older extension) still pairs SGLang's own buffers positionally (the
engines stop at the shorter list; SGLang logs the count mismatch once per registration).

- prefill side (`set_buf`): the row gets `encode_label(answer_label(record, ...))` (the label the
  prefill server's own meta_info would carry: the same call as `patches/tail_replay/meta.py`,
  input-logprob start included), with the request's bootstrap room; zeros where there is nothing
  to carry (a server that does not label, a label this version cannot encode). Every call
  overwrites the whole row, so a reused row never carries an earlier request's label.
- decode side (`_commit_transfer_to_req`): the row is read (`get_tail_replay_label`, beside
  `get_buf`, whose tuple SGLang unpacks positionally and which stays unchanged) before SGLang
  commits the transfer; on a server that labels, the request's record gets
  `carried_label = decode_side_label(row, room)` (merged with an earlier transfer's after a
  rebootstrap, `merge_labels`), which `answer_label` returns. Fail closed: no buffer, zeros (a
  stock prefill, the fake backend), another request's row, a damaged one: `exact: false` of kind
  "transferred_unlabelled"; a request that also reused the decode server's own tree KV
  (`--disaggregation-decode-enable-radix-cache`, a decode-side plan with a prefix): "untracked".
  `clear_slot` zeroes the row with SGLang's fields.
- the decode side's tree inserts stay fail closed (`provenance.writes`: transferred KV is
  UNTRACKED): the carried label labels the answer, not the tree.

Never run end to end here (no RDMA, no PD pair): checked on CPU with real `MetadataBuffers` and a
byte copy of every listed buffer (tests/tail_replay/test_pd_label.py).

Target (SGLang 0.5.23): `srt/disaggregation/utils.py::MetadataBuffers` (`__init__`,
`get_buf_infos`, `set_buf`, `clear_slot`; adds `get_tail_replay_label`) and
`srt/disaggregation/decode.py::DecodeTransferQueue._commit_transfer_to_req`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

TARGET = ("srt/disaggregation/utils.py: MetadataBuffers.__init__ / get_buf_infos / set_buf / clear_slot; "
          "srt/disaggregation/decode.py: DecodeTransferQueue._commit_transfer_to_req")
#: the attribute of `MetadataBuffers` holding the label rows
BUFFER_ATTR = "sglang_ext_tail_replay_label"


def _labels_here() -> bool:
    """Whether this server labels its answers: the meta seam's rule."""
    from sglang_ext.patches.tail_replay import meta as tail_replay_meta

    return tail_replay_meta.this_server_labels()


def prefill_words(req: Any) -> list[int] | None:
    """The row the prefill side writes for `req`: the label its own `meta_info` would carry
    (`tail_replay_meta.label_of`), encoded, or None (zeros)."""
    from sglang_ext.patches.tail_replay import meta as tail_replay_meta
    from sglang_ext.tail_replay import encode_label

    label = tail_replay_meta.label_of(req, _labels_here)
    return None if label is None else encode_label(label, req.bootstrap_room)


def write_label(buffers: Any, req: Any) -> None:
    """Write `req`'s row (the whole row: a label, or zeros)."""
    import torch

    rows = getattr(buffers, BUFFER_ATTR, None)
    if rows is None:
        return
    words = prefill_words(req)
    row = rows[req.metadata_buffer_index]
    if words is None:
        row.zero_()
    else:
        row.copy_(torch.tensor(words, dtype=torch.int64))


def read_label(buffers: Any, idx: int) -> list[int] | None:
    """The words of row `idx` (None: no label buffer here, or no row)."""
    rows = getattr(buffers, BUFFER_ATTR, None)
    if rows is None or idx is None or not 0 <= idx < rows.shape[0]:
        return None
    return rows[idx].tolist()


def _decode_record(tree_cache: Any, req: Any) -> Any:
    """The decode-side request's record: the cache's own (`TailReplayRadixCache.request_record`,
    its config resolved as at a match), else one with the server's config and the request's
    overrides."""
    request_record = getattr(tree_cache, "request_record", None)
    if request_record is not None:
        return request_record(req)
    from sglang_ext.tail_replay import attach, request_overrides, server_config

    return attach(req, request_overrides(server_config(), getattr(req.sampling_params, "custom_params", None)))


def carry_label(tree_cache: Any, req: Any, words: list[int] | None) -> None:
    """Decode side, the transfer committed: the request's record takes the carried label."""
    from sglang_ext.tail_replay import decode_side_label, merge_labels

    if not _labels_here():
        return
    record = _decode_record(tree_cache, req)
    reads_own_tree = record.plan is not None and record.plan.prefix_len > 0
    label = decode_side_label(words, req.bootstrap_room, reads_own_tree=reads_own_tree)
    record.carried_label = merge_labels(record.carried_label, label)


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        import torch

        from sglang_ext.tail_replay import ROW_WORDS

        pool = getattr(self, "custom_mem_pool", None)
        with torch.cuda.use_mem_pool(pool) if pool else nullcontext():   # where SGLang's rows live
            setattr(self, BUFFER_ATTR, torch.zeros((self.output_ids.shape[0], ROW_WORDS), dtype=torch.int64,
                                                   device=self.bootstrap_room.device))

    __init__._sglang_ext_patched = True  # type: ignore[attr-defined]
    return __init__


def _wrap_get_buf_infos(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_buf_infos(self: Any) -> tuple[list[int], list[int], list[int]]:
        ptrs, data_lens, item_lens = original(self)
        rows = getattr(self, BUFFER_ATTR, None)
        if rows is None:
            return ptrs, data_lens, item_lens
        return [*ptrs, rows.data_ptr()], [*data_lens, rows.nbytes], [*item_lens, rows[0].nbytes]   # last

    return get_buf_infos


def _wrap_set_buf(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_buf(self: Any, req: Any) -> None:
        original(self, req)
        write_label(self, req)

    return set_buf


def _wrap_clear_slot(original: Callable) -> Callable:
    @functools.wraps(original)
    def clear_slot(self: Any, idx: int) -> None:
        original(self, idx)
        rows = getattr(self, BUFFER_ATTR, None)
        if rows is not None:
            rows[idx] = 0

    return clear_slot


def _wrap_commit(original: Callable) -> Callable:
    @functools.wraps(original)
    def _commit_transfer_to_req(self: Any, decode_req: Any) -> Any:
        words = read_label(self.metadata_buffers, decode_req.metadata_buffer_index)   # before SGLang frees it
        result = original(self, decode_req)
        carry_label(self.tree_cache, decode_req.req, words)
        return result

    return _commit_transfer_to_req


def apply() -> None:
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers

    if getattr(MetadataBuffers.__init__, "_sglang_ext_patched", False):
        return
    MetadataBuffers.__init__ = _wrap_init(MetadataBuffers.__init__)
    MetadataBuffers.get_buf_infos = _wrap_get_buf_infos(MetadataBuffers.get_buf_infos)
    MetadataBuffers.set_buf = _wrap_set_buf(MetadataBuffers.set_buf)
    MetadataBuffers.clear_slot = _wrap_clear_slot(MetadataBuffers.clear_slot)
    MetadataBuffers.get_tail_replay_label = read_label
    DecodeTransferQueue._commit_transfer_to_req = _wrap_commit(DecodeTransferQueue._commit_transfer_to_req)
