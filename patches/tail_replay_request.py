"""Validate the request fields Tail-Replay reads when the request arrives, so a bad one is that
request's HTTP 400 naming the field, never an HTTP 500 or a scheduler crash.

Target (SGLang 0.5.23): `srt/sampling/sampling_params.py::SamplingParams.verify`, which the
tokenizer manager calls for every request (`_create_tokenized_object`) inside
`generate_request`; the HTTP server answers a ValueError raised there with 400 (a streamed
request gets an error event), anything else with 500.

Fields read by the extension: `sampling_params.custom_params` (must be a JSON object) and its
`"tail_replay"` entry (an object of known config keys with valid values; see
`sglang_ext.tail_replay.request_overrides`), plus the server's refusals decided at start-up
(`sglang_ext.tail_replay.request_limits`: `keep_checkpoints: true` on a server without checkpoints,
`kv_mode: "exact"` on a quantized KV cache). Servers not running `--radix-cache-backend
tail_replay` are left to SGLang's own checks. (`input_ids` are checked by `request_token_ids`.)

This is the check only: the config it resolves is dropped here, because SGLang sends the request to
the scheduler as msgspec data (`SamplingParams` is a `msgspec.Struct`), which carries no Python
object of ours. The scheduler resolves the request's config once more, at its first prefix match,
and keeps it on the request's record (`sglang_ext.tail_replay.TailReplayRequest.config`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_ext.tail_replay import RequestLimits, TailReplayConfig

TARGET = "srt/sampling/sampling_params.py: SamplingParams.verify"


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
            from sglang_ext.tail_replay import request_overrides

            request_overrides(server[0], self.custom_params, server[1])

    return verify


def apply() -> None:
    from sglang.srt.sampling.sampling_params import SamplingParams

    SamplingParams.verify = _wrap_verify(SamplingParams.verify)
