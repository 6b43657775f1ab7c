"""The extension's nested values across SGLang's msgpack IPC (`patches/shared/ipc_json.py`), checked with
SGLang's own encoder and typed decoder."""

from __future__ import annotations

import os
from array import array

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import (stand-in sgl_kernel)

import msgspec  # noqa: E402
import pytest  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_ext.patches.shared import ipc_json  # noqa: E402

NESTED = {"linearkv": {"chunks": [[0, 48], [48, 96]], "state": "replay-16"},
          "token_types": [[0, 12, "system"]], "tail_replay": {"budget": 0.5}, "plain": [1, 2, 3], "n": 4}


def _roundtrip(obj):
    return io_struct.msgpack_decode(io_struct.msgpack_encode(obj))


def _request(custom):
    return io_struct.TokenizedGenerateReqInput(
        input_text="", input_ids=array("l", [1, 2, 3]), input_embeds=None, mm_inputs=None, token_type_ids=None,
        sampling_params=SamplingParams(custom_params=custom), return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False)


def test_nested_custom_params_fail_sglangs_typed_ipc_and_survive_encoded():
    with pytest.raises(msgspec.ValidationError):   # what took the scheduler down
        _roundtrip(_request(dict(NESTED)))
    req = _request(dict(NESTED))
    ipc_json._encode_request(req)
    # SGLang's own shapes stay as they are; only the deeper values are encoded
    assert req.sampling_params.custom_params["plain"] == [1, 2, 3]
    assert req.sampling_params.custom_params["tail_replay"] == {"budget": 0.5}
    got = _roundtrip(req)
    assert ipc_json.decode_custom_params(got.sampling_params.custom_params) == NESTED


def test_summaries_decode_in_place_and_leave_sglangs_values():
    details = [{"device": 3, "host": 0, "tail_replay": ipc_json.encode({"kind": "approximate", "bound": 0.25,
                                                                         "per_layer": [0.0, 0.25]})}, None]
    ipc_json.decode_details(details)
    assert details == [{"device": 3, "host": 0, "tail_replay": {"kind": "approximate", "bound": 0.25,
                                                                 "per_layer": [0.0, 0.25]}}, None]
    assert ipc_json.encode_custom_params({"a": 1}) == {"a": 1}
    assert ipc_json.decoded("plain text") == "plain text"
