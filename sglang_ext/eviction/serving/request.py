"""SAE's request fields: what a request tells SAE (typed prompt spans, its session), the one
parser of those fields (``parse_request``: the tokenizer's arrival check and the scheduler's
record both call it) and the record it yields (``SAERequest``), with the request's tenant
(``tenant_of``: the one place that decides it, for the session table and the content keys).
Pure Python."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: request fields, inside ``sampling_params.custom_params``
TYPES_FIELD = "token_types"
SESSION_FIELD = "session"
FIELD_PREFIX = "sampling_params.custom_params."

#: names a client may use for a span, and the core's token type they mean
TYPE_ALIASES: Mapping[str, str] = {
    "system": "system", "user": "user", "assistant": "response", "response": "response",
    "tool": "tool_output", "tool_output": "tool_output", "tool_call": "tool_call",
    "reasoning": "reasoning",
}
OUTPUT_TYPE = "response"  # type of cached output tokens (past the prompt)


def tenant_of(extra_key: str | None, cache_salt: str | None) -> str:
    """The tenant of a request or tree node: the namespace SGLang 0.5.23's radix tree keeps it
    in (``RadixKey.child_key``: ``extra_key``, which carries the LoRA id SGLang appends, and
    ``cache_salt``; ``extra_key`` ``""`` and None are distinct namespaces there, an empty
    ``cache_salt`` is None). Unambiguous: distinct pairs give distinct strings."""
    return json.dumps([extra_key, cache_salt or None])


#: the tenant of a request that sends neither ``extra_key`` nor ``cache_salt``
DEFAULT_TENANT = tenant_of(None, None)


class RequestFieldError(ValueError):
    """A request's SAE field is malformed; the message names the field (HTTP 400)."""


@dataclass(frozen=True)
class TypedSpan:
    """Tokens [start, end) of the prompt have ``token_type`` (a core type, TOKEN_TYPES)."""

    start: int
    end: int
    token_type: str


@dataclass(frozen=True)
class SAERequest:
    """What SAE knows about one request: typed prompt spans (sorted, disjoint), the
    session it belongs to (None: unknown) and its tenant (``tenant_of``; a session is
    keyed by tenant and name)."""

    spans: tuple[TypedSpan, ...] = ()
    session: str | None = None
    tenant: str = DEFAULT_TENANT

    def type_at(self, position: int, prompt_len: int) -> str:
        """Token type of token ``position``: its span's, ``response`` past the prompt,
        ``unknown`` in the prompt outside every span."""
        if position >= prompt_len:
            return OUTPUT_TYPE
        i = bisect.bisect_right([s.start for s in self.spans], position) - 1
        if i >= 0 and position < self.spans[i].end:
            return self.spans[i].token_type
        return "unknown"


def parse_request(custom_params: object, prompt_len: int | None, session_id: object = None,
                  tenant: str = DEFAULT_TENANT) -> SAERequest | None:
    """The record of a request of ``tenant`` from ``sampling_params.custom_params``
    (``token_types``: ``[[start, end, type], ...]``, ``session``: str or int) and SGLang's own
    session id.
    ``prompt_len`` None skips the range check (done when the prompt is tokenized). Raises
    ``RequestFieldError`` naming the field. None when the request carries neither."""
    custom = custom_params or {}
    if not isinstance(custom, Mapping):
        raise RequestFieldError("sampling_params.custom_params must be a JSON object")
    spans = _parse_spans(custom.get(TYPES_FIELD), prompt_len)
    session = custom.get(SESSION_FIELD)
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        raise RequestFieldError(f"{FIELD_PREFIX}{SESSION_FIELD} must be a string or an integer, "
                                f"got {type(session).__name__}")
    if session is None and session_id:
        session = session_id
    if not spans and session is None:
        return None
    return SAERequest(spans=spans, session=None if session is None else str(session), tenant=tenant)


def _parse_spans(raw: object, prompt_len: int | None) -> tuple[TypedSpan, ...]:
    if raw is None:
        return ()
    name = FIELD_PREFIX + TYPES_FIELD
    if not isinstance(raw, list):
        raise RequestFieldError(f"{name} must be a list of [start, end, type], got {type(raw).__name__}")
    spans, last_end = [], 0
    for i, item in enumerate(raw):
        where = f"{name}[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise RequestFieldError(f"{where} must be [start, end, type], got {item!r}")
        start, end, kind = item
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)):
            raise RequestFieldError(f"{where}: start and end must be integers, got {item!r}")
        if kind not in TYPE_ALIASES:
            raise RequestFieldError(f"{where}: unknown token type {kind!r}; "
                                    f"known: {sorted(TYPE_ALIASES)}")
        if not 0 <= start < end:
            raise RequestFieldError(f"{where}: needs 0 <= start < end, got {item!r}")
        if start < last_end:
            raise RequestFieldError(f"{where}: spans must be sorted and must not overlap "
                                    f"(starts at {start}, the previous one ends at {last_end})")
        if prompt_len is not None and end > prompt_len:
            raise RequestFieldError(f"{where}: end {end} is past the prompt ({prompt_len} tokens)")
        spans.append(TypedSpan(start, end, TYPE_ALIASES[kind]))
        last_end = end
    return tuple(spans)


def spans_to_field(spans: Iterable[TypedSpan]) -> list[list]:
    """The request-field form of ``spans`` (core type names, which the field accepts)."""
    return [[s.start, s.end, s.token_type] for s in spans]
