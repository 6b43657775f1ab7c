"""LinearKV's request seam on arrival (`patches/linearkv/request.py: prepare`), on SGLang's own
request object: the chunk namespace and the server-internal fields are refused for single and
batched requests alike."""

from __future__ import annotations

import pytest

from sglang_ext.linearkv import LinearKVConfig, namespace


def _prepare(**fields):
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_ext.patches.linearkv.request import prepare

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


class _Chars:
    """A tokenizer of one id per character (the seam's separator split needs only `encode`)."""

    @staticmethod
    def encode(text, add_special_tokens=True):
        return [ord(c) for c in text]


class _Manager:
    tokenizer = _Chars()


SEP = " # "
TEXT = SEP.join(["system", "the first passage", "the second passage", "question?"])
SPANS = {"chunks": [[2, 20], [20, 40]]}


def _prepare_on(config, **fields):
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_ext.patches.linearkv.request import prepare

    obj = GenerateReqInput(**fields)
    return prepare(_Manager(), obj, (config, namespace("m"))), obj


def _params(exactness=None, linearkv=None):
    custom = {}
    if exactness is not None:
        custom["tail_replay"] = {"exactness": exactness}
    if linearkv is not None:
        custom["linearkv"] = linearkv
    return {"max_new_tokens": 1, "custom_params": custom}


@pytest.mark.parametrize("exactness", ["exact", "exact_unless_pressed"])
def test_the_separator_never_turns_a_request_that_may_run_exact_into_a_chunked_one(exactness, monkeypatch):
    """Separator mode splits a prompt's text into chunks (separators dropped, segments tokenized
    one by one): a request that may run strict keeps its text as sent, as a server without cache
    reads it; without exactness asked, the same text is split."""
    if exactness == "exact_unless_pressed":
        monkeypatch.setenv("SGLANG_EXT_TAIL_REPLAY_CONFIG", '{"pressure": {"num_queue_reqs": 4}}')
    config = LinearKVConfig(separator=SEP, min_chunk_tokens=1)
    (chunks, _), obj = _prepare_on(config, text=TEXT, sampling_params=_params(exactness))
    assert chunks == [] and obj.text == TEXT and obj.input_ids is None
    assert "linearkv" not in obj.sampling_params["custom_params"]
    (chunks, _), obj = _prepare_on(config, text=TEXT, sampling_params=_params())
    assert len(chunks) == 3 and obj.text is None and SEP not in "".join(map(chr, obj.input_ids))   # P and 2 chunks
    # a request's own separator, asked exact: not split either, and its field is dropped
    (chunks, _), obj = _prepare_on(LinearKVConfig(min_chunk_tokens=1), text=TEXT,
                                   sampling_params=_params(exactness, {"separator": SEP}))
    assert chunks == [] and obj.text == TEXT and "linearkv" not in obj.sampling_params["custom_params"]


def test_an_exact_request_with_chunk_spans_registers_nothing_and_keeps_its_spans():
    """Its spans stay (the scheduler serves it as a plain prefill and says so in meta_info:
    `fallback`), but no registration prefill is spent on chunks it will never read."""
    ids = list(range(100, 150))
    (chunks, _), obj = _prepare_on(LinearKVConfig(min_chunk_tokens=1), input_ids=ids,
                                   sampling_params=_params("exact", SPANS))
    assert chunks == [] and obj.sampling_params["custom_params"]["linearkv"] == SPANS and obj.input_ids == ids
    (chunks, _), _ = _prepare_on(LinearKVConfig(min_chunk_tokens=1), input_ids=ids, sampling_params=_params(None, SPANS))
    assert chunks == [ids[:2], ids[2:20], ids[20:40]]


def test_a_server_may_refuse_exact_requests_with_chunks():
    config = LinearKVConfig(min_chunk_tokens=1, exact_requests="refuse")
    with pytest.raises(ValueError, match="exact_requests: refuse"):
        _prepare_on(config, input_ids=list(range(100, 150)), sampling_params=_params("exact", SPANS))
    # the server's separator never refuses (the caller need not know its text holds it): served as sent
    (chunks, _), obj = _prepare_on(LinearKVConfig(separator=SEP, exact_requests="refuse"), text=TEXT,
                                   sampling_params=_params("exact"))
    assert chunks == [] and obj.text == TEXT
    with pytest.raises(ValueError, match="custom_params\\['tail_replay'\\]"):   # a bad field: 400 naming it
        _prepare_on(config, input_ids=list(range(100, 150)), sampling_params=_params("exactly", SPANS))
