"""LinearKV's request seam on arrival (`patches/linearkv_request.py: prepare`), on SGLang's own
request object: the chunk namespace and the server-internal fields are refused for single and
batched requests alike."""

from __future__ import annotations

import pytest

from sglang_ext.linearkv import LinearKVConfig, namespace


def _prepare(**fields):
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_ext.patches.linearkv_request import prepare

    obj = GenerateReqInput(**fields)
    return prepare(object(), obj, (LinearKVConfig(), namespace("m")))


@pytest.mark.parametrize("extra_key", ["linearkv-chunk:m|", ["tenant-a", "linearkv-chunk:m|tenant-a"]])
def test_a_batch_cannot_write_into_the_chunk_namespace(extra_key):
    """A batch of plain prompts under a chunk namespace's key would be cached where chunk
    registrations live, and served to that tenant's chunked requests as its chunks."""
    with pytest.raises(ValueError, match="extra_key: keys starting with 'linearkv-chunk:' are reserved"):
        _prepare(input_ids=[[11, 12, 13], [14, 15, 16]], extra_key=extra_key, sampling_params={"max_new_tokens": 1})


def test_single_requests_are_checked_and_other_keys_pass():
    with pytest.raises(ValueError, match="extra_key"):
        _prepare(input_ids=[11, 12, 13], extra_key="linearkv-chunk:m|", sampling_params={"max_new_tokens": 1})
    assert _prepare(input_ids=[[11, 12], [13, 14]], extra_key=["a", None], sampling_params={"max_new_tokens": 1}) \
        == ([], False)
    assert _prepare(input_ids=[11, 12, 13], extra_key="tenant-a", sampling_params={"max_new_tokens": 1}) == ([], False)


@pytest.mark.parametrize("field", ["register", "keep_state"])
def test_internal_fields_are_refused_on_every_entry_of_a_batch(field):
    """`register` / `keep_state` mark the server's own chunk registrations: a client's request
    carrying one is refused by name, whether single, a batch entry, or a batch's shared params."""
    internal = {"max_new_tokens": 0, "custom_params": {"linearkv": {field: True}}}
    needle = f"custom_params.linearkv.{field} is internal to the server"
    with pytest.raises(ValueError, match=needle + "$"):
        _prepare(input_ids=[11, 12, 13], sampling_params=internal)
    with pytest.raises(ValueError, match=needle + " \\(batch entry 1\\)"):
        _prepare(input_ids=[[11, 12], [13, 14]], sampling_params=[{"max_new_tokens": 1}, internal])
    with pytest.raises(ValueError, match=needle + " \\(every entry of the batch\\)"):
        _prepare(text=["a b", "c d"], sampling_params=internal)
    plain = {"max_new_tokens": 1, "custom_params": {"tail_replay": {"budget": 0.5}}}
    assert _prepare(input_ids=[[11, 12], [13, 14]], sampling_params=[plain, plain]) == ([], False)
