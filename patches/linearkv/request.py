"""LinearKV, on arrival: find a request's chunks, register the chunks, then send the request on.

Target (SGLang 0.5.23): `srt/managers/tokenizer_manager.py::TokenizerManager.generate_request`
(the async generator behind /generate, the OpenAI endpoints and the frontend language). Only on a
server running `--radix-cache-backend linearkv`; other requests pass untouched.

For a request whose `sampling_params.custom_params.linearkv` holds chunks (token spans, or a
separator) or whose text holds the server's separator (`--linearkv-config` `separator`):
1. separator mode: the prompt text (for chat requests: the rendered prompt) is split into
   `P, C_1 .. C_K, Q`; each segment is tokenized on its own (P with the tokenizer's special tokens,
   the others without), so a chunk has the same ids wherever it appears; the separators are
   dropped; the request continues as `input_ids` with the chunk spans in `custom_params.linearkv`;
2. the spans are validated (HTTP 400 naming `custom_params.linearkv...` on a bad one);
3. every chunk is registered, and P too (at offset 0 its KV and state are exact: the assembly
   takes P from there when the radix tree serves none of it, and `compose` folds its state): a prefill-only request (`max_new_tokens: 0`) of its ids in the
   model's chunk namespace (`extra_key`), all at once (the scheduler batches them). A chunk already
   cached costs a one-token prefill (see sglang_ext/linearkv/sglang_cache.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

TARGET = "srt/managers/tokenizer_manager.py: TokenizerManager.generate_request"

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _server(radix_cache_backend: str | None, model: str) -> tuple[Any, str] | None:
    from sglang_ext.linearkv import BACKEND_NAME, namespace, server_linearkv_config

    if radix_cache_backend != BACKEND_NAME:
        return None
    return server_linearkv_config(), namespace(model)


def _this_server() -> tuple[Any, str] | None:
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    model = str(getattr(args, "served_model_name", None) or args.model_path)
    return _server(getattr(args, "radix_cache_backend", None), model)


def _custom_params(obj: Any) -> dict | None:
    params = obj.sampling_params if isinstance(obj.sampling_params, dict) else None
    custom = None if params is None else params.get("custom_params")
    return custom if isinstance(custom, dict) else None


def _is_single(obj: Any) -> bool:
    if isinstance(obj.text, list) or isinstance(obj.sampling_params, list):
        return False
    ids = obj.input_ids
    return ids is None or not (isinstance(ids, list) and ids and isinstance(ids[0], list))


def _segments_ids(tokenizer: Any, parts: list[str]) -> list[list[int]]:
    first = tokenizer.encode(parts[0]) if parts[0] else []
    return [list(first)] + [list(tokenizer.encode(p, add_special_tokens=False)) for p in parts[1:]]


def _by_separator(manager: Any, obj: Any, separator: str) -> list[list[int]] | None:
    """Chunk spans from the separator, rewriting obj to input_ids; None if the prompt holds no chunk."""
    from sglang_ext.linearkv import spans_of_segments, split_by_separator

    if isinstance(obj.text, str):
        text = obj.text
    elif obj.input_ids is not None:
        text = manager.tokenizer.decode(obj.input_ids, skip_special_tokens=False)
    else:
        return None
    parts = split_by_separator(text, separator)
    if parts is None:
        return None
    ids = _segments_ids(manager.tokenizer, parts)
    obj.text, obj.input_ids = None, [t for seg in ids for t in seg]
    return spans_of_segments([len(seg) for seg in ids])


def _prompt_ids(manager: Any, obj: Any) -> list[int]:
    if obj.input_ids is None:
        if not isinstance(obj.text, str):
            raise ValueError("custom_params.linearkv needs a text or input_ids prompt")
        obj.input_ids, obj.text = list(manager.tokenizer.encode(obj.text)), None
    return list(obj.input_ids)


def _can_compose(manager: Any) -> bool:
    from sglang_ext.linearkv import composes

    hf = getattr(getattr(manager, "model_config", None), "hf_config", None)
    return composes(getattr(hf, "layer_types", None), getattr(hf, "model_type", None))


def served_length(manager: Any, n: int) -> int:
    """The prompt length the server will serve of an n-token prompt: SGLang's tokenizer cuts it
    to the context length and its scheduler to `max_req_input_len` under --allow-auto-truncate
    (without it both refuse the request)."""
    if not getattr(manager, "allow_auto_truncate", False):
        return n
    context = getattr(manager, "context_len", None)
    if context is not None and n + int(getattr(manager, "num_reserved_tokens", 0) or 0) >= context:
        n = min(n, context)
    limit = getattr(manager, "max_req_input_len", None)
    return min(n, limit) if limit is not None and n >= limit else n


#: `custom_params.linearkv` keys only the server's own chunk registrations carry (`_register`)
INTERNAL_FIELDS = ("register", "keep_state")


def _refuse_internal(value: Any, where: str = "") -> None:
    """ValueError naming the first server-internal key a client's `custom_params.linearkv` holds."""
    internal = [key for key in INTERNAL_FIELDS if value is not None and key in value]
    if internal:
        raise ValueError(f"custom_params.linearkv.{internal[0]} is internal to the server{where}")


def requested_exactness(custom_params: Any) -> str:
    """The `exactness` a request runs with: its `custom_params.tail_replay` over the server's
    `--tail-replay-config` (`sglang_ext.tail_replay.check_request`; a bad field is a ValueError
    naming it, HTTP 400). Whether "exact_unless_pressed" runs strict is decided in the scheduler."""
    from sglang_ext.tail_replay import check_request, server_config

    return check_request(server_config(), custom_params).knobs.exactness


def _set_linearkv_field(obj: Any, value: dict | None) -> None:
    """Write the request's `custom_params.linearkv` (None: drop it). May mutate: obj's sampling params."""
    params = dict(obj.sampling_params or {})
    custom = dict(params.get("custom_params") or {})
    custom.pop("linearkv", None)
    if value is not None:
        custom["linearkv"] = value
    params["custom_params"] = custom
    obj.sampling_params = params


def prepare(manager: Any, obj: Any, server: tuple[Any, str]) -> tuple[list[list[int]], bool]:
    """Rewrite obj (separator mode), validate its chunks; return the chunks' token ids to register
    ([] for a request without chunks) and whether their registrations keep the chunks' end states
    (the request's rule reads them). ValueError naming the field on bad input: also an `extra_key`
    in the chunk namespace and the server-internal keys (`INTERNAL_FIELDS`), on single requests
    and on every entry of a batch alike (a prompt cached there would pose as a tenant's registered
    chunk; a client's `register` would be served as one)."""
    from sglang_ext.linearkv import NAMESPACE_PREFIX, is_chunk_namespace, keeps_state, plan_chunks, request_field
    from sglang_ext.linearkv.serving import MAY_BE_STRICT

    config, _ = server
    keys = obj.extra_key if isinstance(obj.extra_key, list) else [obj.extra_key]   # a batch: one per prompt
    if any(isinstance(key, str) and is_chunk_namespace(key) for key in keys):
        raise ValueError(f"extra_key: keys starting with {NAMESPACE_PREFIX!r} are reserved for LinearKV's chunks")
    if not _is_single(obj):
        batched = isinstance(obj.sampling_params, list)
        custom = obj.sampling_params if batched else [obj.sampling_params]
        values = [request_field(p.get("custom_params")) if isinstance(p, dict) else None for p in custom]
        for i, value in enumerate(values):
            _refuse_internal(value, f" (batch entry {i})" if batched else " (every entry of the batch)")
        if any(values):
            raise ValueError("custom_params.linearkv: batched requests are not supported; send one request per prompt")
        return [], False
    value = request_field(_custom_params(obj))
    _refuse_internal(value)
    separator = value.get("separator") if value is not None else config.separator
    if value is None and separator is None:
        return [], False   # no chunks asked, no separator to find them by: a plain request
    exactness = requested_exactness(_custom_params(obj))
    if value is not None and "separator" in value and (not isinstance(separator, str) or not separator):
        raise ValueError(f"custom_params.linearkv.separator must be a non-empty string, got {separator!r}")
    if value is not None and exactness == "exact" and config.exact_requests == "refuse":
        raise ValueError("custom_params.linearkv: this request asks exactness 'exact' and chunks are assembled "
                         "from context-free KV, which is never exact; this server refuses such requests "
                         "(--linearkv-config exact_requests: refuse): send the prompt without custom_params.linearkv, "
                         "or ask custom_params.tail_replay.exactness 'exact_first' or 'approximate'")
    if separator is not None and (value is None or "chunks" not in value) and exactness in MAY_BE_STRICT:
        # a request that may run strict is never split at the separator: it is served as sent
        # (a server without cache reads the separators too), whether the separator is the server's
        # or its own
        if value is not None:
            _set_linearkv_field(obj, None)
        return [], False
    if separator is not None and (value is None or "chunks" not in value):
        spans = _by_separator(manager, obj, separator)
        if spans is None:
            if value is not None:
                raise ValueError(f"custom_params.linearkv.separator {separator!r}: the prompt needs "
                                 "P sep chunk sep ... sep question (at least two separators)")
            return [], False
        value = {**(value or {}), "chunks": spans}
        value.pop("separator", None)
    if value is None:
        return [], False
    ids = _prompt_ids(manager, obj)
    plan = plan_chunks(value, len(ids), config, can_compose=_can_compose(manager))
    served = served_length(manager, len(ids))
    if plan is not None and served < len(ids):
        # --allow-auto-truncate will cut the prompt: its chunks are planned against what is served
        # (the scheduler plans again on the cut prompt and, where no question token is left after
        # the chunks, serves a plain prefill and says so in meta_info: `fallback`)
        try:
            plan = plan_chunks(value, served, config, can_compose=_can_compose(manager))
        except ValueError:
            return [], False
    _set_linearkv_field(obj, None if plan is None else {k: v for k, v in value.items() if k != "separator"})
    if plan is None or exactness == "exact":
        return [], False   # (an exact request's chunks are never assembled: the scheduler prefills it)
    prefix = [ids[:plan.prefix_end]] if plan.prefix_end else []
    return prefix + [ids[s:e] for s, e in plan.chunks], keeps_state(plan)


async def _register(manager: Any, original: Callable, obj: Any, chunks: list[list[int]], namespace: str,
                    keep_state: bool) -> None:
    """Prefill every new chunk (and P) in the request's tenant namespace, with its LoRA and cache
    salt, all at once. A registration that fails (aborted, refused) is logged and left: the
    request's chunks then miss and it is served as a plain prefill."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_ext.linearkv import tenant_namespace

    key = tenant_namespace(namespace, obj.extra_key if isinstance(obj.extra_key, str) else None)
    tenancy = {name: getattr(obj, name) for name in ("cache_salt", "lora_path", "routing_key", "routed_dp_rank")
               if getattr(obj, name, None) is not None}

    async def one(ids: list[int]) -> None:
        sub = GenerateReqInput(input_ids=ids, extra_key=key, stream=False, **tenancy,
                               sampling_params={"max_new_tokens": 0,
                                                "custom_params": {"linearkv": {"register": True,
                                                                               "keep_state": keep_state}}})
        try:
            async for _ in original(manager, sub, None):
                pass
        except Exception as exc:   # noqa: BLE001 - the request itself still runs, as a plain prefill
            logger.warning("linearkv: a chunk registration of %d tokens failed (%s: %s); the request's "
                           "chunks will miss", len(ids), type(exc).__name__, exc)

    unique = {tuple(c): c for c in chunks}
    await asyncio.gather(*(one(c) for c in unique.values()))


def _wrap_generate_request(original: Callable) -> Callable:
    @functools.wraps(original)
    async def generate_request(self, obj, request=None):
        from sglang.srt.managers.io_struct import GenerateReqInput

        server = _this_server() if isinstance(obj, GenerateReqInput) else None
        if server is not None:
            # obj is rewritten in place (separator mode: text -> input_ids; the chunk spans), as
            # SGLang normalizes it in place: the HTTP layer's disconnect abort reads the same
            # object's rid and is_single afterwards
            chunks, keep_state = prepare(self, obj, server)
            if chunks:
                obj.is_single = True   # (prepare plans single requests only) read by a disconnect abort
                await _register(self, original, obj, chunks, server[1], keep_state)
        async for out in original(self, obj, request):
            yield out

    return generate_request


def apply() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    TokenizerManager.generate_request = _wrap_generate_request(TokenizerManager.generate_request)
