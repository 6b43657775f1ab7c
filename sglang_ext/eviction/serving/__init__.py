"""SAECache in a server, pure Python (no SGLang, no torch), one module per concern:

* ``request``: the request fields (``token_types``, ``session``), their one parser and the
  per-request record (``SAERequest``);
* ``chat``: a chat prompt's typed spans from its messages' roles;
* ``config``: ``--radix-eviction-policy-config`` of ``sae``, validated at start-up;
* ``nodes``: tree nodes as SAE sees them (content keys, ``PathNode``, the entry description);
* ``sessions``: the session table, bounded and keyed by tenant;
* ``server``: ``ServerSAE``, the event adapter between a radix tree and ``SAEPolicy``.

The SGLang side is ``sglang_adapter.py`` and ``patches/sae_*.py``.
"""

from __future__ import annotations

from ..base import TOKEN_TYPES
from .chat import ROLE_TYPES, chat_spans
from .config import DEFAULT_MAX_SESSIONS, DEFAULT_STATE_ORDER, STATE_ORDERS, ServerConfig, parse_server_config
from .nodes import ATTENTION_TOKENS, PathNode, content_keys, entry_info
from .request import (
    DEFAULT_TENANT,
    FIELD_PREFIX,
    OUTPUT_TYPE,
    SESSION_FIELD,
    TYPE_ALIASES,
    TYPES_FIELD,
    RequestFieldError,
    SAERequest,
    TypedSpan,
    parse_request,
    spans_to_field,
    tenant_of,
)
from .server import ServerSAE, ServeStats
from .sessions import SessionTable

__all__ = ["ATTENTION_TOKENS", "DEFAULT_MAX_SESSIONS", "DEFAULT_STATE_ORDER", "DEFAULT_TENANT", "FIELD_PREFIX",
           "OUTPUT_TYPE", "PathNode", "RequestFieldError", "ROLE_TYPES", "SAERequest", "SESSION_FIELD",
           "STATE_ORDERS", "ServeStats", "ServerConfig", "ServerSAE", "SessionTable", "TOKEN_TYPES", "TYPES_FIELD",
           "TYPE_ALIASES", "TypedSpan", "chat_spans", "content_keys", "entry_info", "parse_request",
           "parse_server_config", "spans_to_field", "tenant_of"]
