"""Validate the request fields Tail-Replay reads when the request arrives, so a bad one is that
request's HTTP 400 naming the field, never an HTTP 500 or a scheduler crash; then mark the
server's own background runs, out of band.

Targets (SGLang 0.5.23): `srt/sampling/sampling_params.py::SamplingParams.verify`, which the
tokenizer manager calls for every request (`_create_tokenized_object`) inside
`generate_request`; the HTTP server answers a ValueError raised there with 400 (a streamed
request gets an error event), anything else with 500. And
`srt/managers/tokenizer_manager.py::TokenizerManager._create_tokenized_object` itself: once its
check passed, a request the server sent itself (an audit's reference run, a repair run:
`patches/tail_replay/audit.py`) gets its mark (`BACKGROUND_PARAM_KEY`: `audit_of` / `repair_of`,
`repair_kind` and the values the run needs) written into the sampling params bound for the
scheduler. The mark is read from a Python attribute (`MARK_ATTR`) of the `GenerateReqInput`
object the server built, which no HTTP field can set; the same key sent by a client is refused by
the check above. So no client can hide its request from the counters as a background run, count
as a repair, or take another request's pending audit.

Fields read by the extension: `sampling_params.custom_params` (must be a JSON object) and its
`"tail_replay"` entry (an object of known config keys with valid values; see
`sglang_ext.tail_replay.check_request`), no server mark (`BACKGROUND_PARAM_KEY`), plus the server's refusals decided at start-up
(`sglang_ext.tail_replay.request_limits`: `keep_checkpoints: true` on a server without checkpoints,
`kv_mode: "exact"` on a quantized KV cache). Servers not running `--radix-cache-backend
tail_replay` are left to SGLang's own checks. (`input_ids` are checked by `shared/request_token_ids`.)

This is the check only: the config it resolves is dropped here, because SGLang sends the request to
the scheduler as msgspec data (`SamplingParams` is a `msgspec.Struct`), which carries no Python
object of ours. The scheduler resolves the request's config once more, at its first prefix match,
and keeps it on the request's record (`sglang_ext.tail_replay.TailReplayRequest.config`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_ext.tail_replay import RequestLimits, TailReplayConfig

TARGET = ("srt/sampling/sampling_params.py: SamplingParams.verify; "
          "srt/managers/tokenizer_manager.py: TokenizerManager._create_tokenized_object")
#: attribute of a `GenerateReqInput` the server built for its own background run: the run's mark
#: (`sglang_ext.tail_replay.background_mark`); a Python attribute, not a request field
MARK_ATTR = "_sglang_ext_tail_replay_background"


def _server_limits() -> tuple[TailReplayConfig, RequestLimits] | None:
    """(config, RequestLimits) of this server, or None when it does not run Tail-Replay, from
    the server args SGLang published in this process and the config (parsed once)."""
    from sglang.srt.runtime_context import get_server_args

    server_args = get_server_args()
    return _limits_for(getattr(server_args, "radix_cache_backend", None),
                       str(getattr(server_args, "kv_cache_dtype", None) or "auto"))


@functools.lru_cache(maxsize=4)
def _limits_for(radix_cache_backend: str | None,
                kv_cache_dtype: str) -> tuple[TailReplayConfig, RequestLimits] | None:
    from sglang_ext.hooks import request_backends
    from sglang_ext.tail_replay import BACKEND_NAME, ServerFacts, request_limits, server_config

    if radix_cache_backend != BACKEND_NAME and radix_cache_backend not in request_backends():
        return None   # (other wings' backends that serve with Tail-Replay register themselves)
    config = server_config()
    return config, request_limits(config, ServerFacts(kv_cache_dtype=kv_cache_dtype))


def _wrap_verify(original: Callable) -> Callable:
    @functools.wraps(original)
    def verify(self, *args, **kwargs):
        original(self, *args, **kwargs)
        server = _server_limits()
        if server is not None:
            from sglang_ext.tail_replay import check_request

            check_request(server[0], self.custom_params, server[1])

    return verify


def mark_background_run(obj: Any, mark: dict) -> Any:
    """Mark the `GenerateReqInput` `obj`, built by the server, as its own background run with
    `mark`; returns `obj`."""
    setattr(obj, MARK_ATTR, dict(mark))
    return obj


def _wrap_create(original: Callable) -> Callable:
    @functools.wraps(original)
    def _create_tokenized_object(self, obj, *args, **kwargs):
        tokenized = original(self, obj, *args, **kwargs)   # runs the check: a client's mark is refused there
        mark = getattr(obj, MARK_ATTR, None)
        if mark is not None:
            from sglang_ext.tail_replay import BACKGROUND_PARAM_KEY

            params = tokenized.sampling_params
            params.custom_params = {**(params.custom_params or {}), BACKGROUND_PARAM_KEY: dict(mark)}
        return tokenized

    return _create_tokenized_object


def apply() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams

    SamplingParams.verify = _wrap_verify(SamplingParams.verify)
    TokenizerManager._create_tokenized_object = _wrap_create(TokenizerManager._create_tokenized_object)
