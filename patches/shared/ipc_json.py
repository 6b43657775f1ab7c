"""The extension's nested values across SGLang's IPC, in both of its modes: request fields in
`sampling_params.custom_params` on the way to the scheduler, per-request summaries in
`meta_info.cached_tokens_details` on the way back.

SGLang's msgpack IPC (`SGLANG_USE_PICKLE_IPC=0`) decodes every message against its declared
types: a `custom_params` value may be a scalar, a list of scalars or an object of scalars
(`sampling_params.CustomParamValue`), and `cached_tokens_details` is `Dict[str, Union[int, str]]`
(`io_struct.CachedTokensDetails`). The extension's fields are deeper (`linearkv.chunks` is a list
of spans, SAE's `token_types` a list of spans; the `tail_replay` and `linearkv` summaries hold
floats, lists and objects), and a message that fails the check kills the receiving process. So
each such value crosses as `encode(value)`, a tagged JSON string, which both modes carry, and is
turned back into the object right after it arrives, before anything there reads it:

- tokenizer -> scheduler: `TokenizerManager._dispatch_to_scheduler` (and its async twin) encode the
  custom_params values that are not one of SGLang's shapes; `Scheduler.handle_generate_request`
  decodes them (the request's fields were validated in the tokenizer process already);
- scheduler -> tokenizer: `patches/tail_replay/meta.py` writes the summaries encoded;
  `TokenizerManager._handle_batch_output` decodes them (applied after `tail_replay/audit`, so it
  runs first), so a client gets the same JSON in either mode.

Targets (SGLang 0.5.23): `srt/managers/tokenizer_manager.py` (`_dispatch_to_scheduler`,
`_async_dispatch_to_scheduler`, `_handle_batch_output`) and `srt/managers/scheduler.py`
(`Scheduler.handle_generate_request`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

TARGET = ("srt/managers/tokenizer_manager.py: TokenizerManager._dispatch_to_scheduler, "
          "_async_dispatch_to_scheduler, _handle_batch_output; "
          "srt/managers/scheduler.py: Scheduler.handle_generate_request")

#: marks an encoded value (never the start of one of SGLang's own string values)
TAG = "sglang_ext:json:"
_SCALARS = (type(None), bool, int, float, str)


def encode(value: Any) -> str:
    """A value as one string."""
    return TAG + json.dumps(value, separators=(",", ":"))


def decoded(value: Any) -> Any:
    """The object an `encode`d string stands for; any other value unchanged."""
    if isinstance(value, str) and value.startswith(TAG):
        return json.loads(value[len(TAG):])
    return value


def fits_custom_params(value: Any) -> bool:
    """Whether SGLang's msgpack IPC carries this custom_params value as it is: a scalar, a list
    of scalars or an object of scalars."""
    if isinstance(value, list):
        return all(isinstance(x, _SCALARS) for x in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and isinstance(x, _SCALARS) for k, x in value.items())
    return isinstance(value, _SCALARS)


def encode_custom_params(custom: Any) -> Any:
    """A new custom_params dict with every value SGLang's IPC cannot carry encoded."""
    if not isinstance(custom, dict) or all(fits_custom_params(v) for v in custom.values()):
        return custom
    return {k: v if fits_custom_params(v) else encode(v) for k, v in custom.items()}


def decode_custom_params(custom: Any) -> Any:
    if not isinstance(custom, dict) or not any(isinstance(v, str) and v.startswith(TAG) for v in custom.values()):
        return custom
    return {k: decoded(v) for k, v in custom.items()}


def decode_details(details: Any) -> None:
    """Turn the encoded summaries in a batch output's `cached_tokens_details` (a list with one
    dict or None per request) back into objects, in place."""
    for entry in details or ():
        if isinstance(entry, dict):
            for key, value in entry.items():
                entry[key] = decoded(value)


def _sampling_params_of(obj: Any) -> list[Any]:
    """The SamplingParams objects of a tokenized generate request (or a batch of them)."""
    reqs = getattr(obj, "batch", None)
    reqs = reqs if isinstance(reqs, list) else [obj]
    return [sp for r in reqs if (sp := getattr(r, "sampling_params", None)) is not None
            and hasattr(sp, "custom_params")]


def _encode_request(obj: Any) -> None:
    for sp in _sampling_params_of(obj):
        sp.custom_params = encode_custom_params(sp.custom_params)   # a new dict: the caller's is kept


def _wrap_dispatch(original: Callable) -> Callable:
    @functools.wraps(original)
    def _dispatch_to_scheduler(self, obj):
        _encode_request(obj)
        return original(self, obj)

    return _dispatch_to_scheduler


def _wrap_async_dispatch(original: Callable) -> Callable:
    @functools.wraps(original)
    async def _async_dispatch_to_scheduler(self, obj):
        _encode_request(obj)
        return await original(self, obj)

    return _async_dispatch_to_scheduler


def _wrap_handle_generate_request(original: Callable) -> Callable:
    @functools.wraps(original)
    def handle_generate_request(self, recv_req, *args, **kwargs):
        sp = getattr(recv_req, "sampling_params", None)
        if sp is not None and hasattr(sp, "custom_params"):
            sp.custom_params = decode_custom_params(sp.custom_params)
        return original(self, recv_req, *args, **kwargs)

    return handle_generate_request


def _wrap_handle_batch_output(original: Callable) -> Callable:
    @functools.wraps(original)
    async def _handle_batch_output(self, recv_obj):
        decode_details(getattr(recv_obj, "cached_tokens_details", None))
        return await original(self, recv_obj)

    return _handle_batch_output


def apply() -> None:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    TokenizerManager._dispatch_to_scheduler = _wrap_dispatch(TokenizerManager._dispatch_to_scheduler)
    TokenizerManager._async_dispatch_to_scheduler = _wrap_async_dispatch(TokenizerManager._async_dispatch_to_scheduler)
    TokenizerManager._handle_batch_output = _wrap_handle_batch_output(TokenizerManager._handle_batch_output)
    Scheduler.handle_generate_request = _wrap_handle_generate_request(Scheduler.handle_generate_request)
