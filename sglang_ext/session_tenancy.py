"""Sessions belong to a tenant (pure: no SGLang import).

SGLang finds a session's history by the session id alone, and session ids are chosen by clients.
A turn sent under another cache namespace than its session's (`extra_key`, `cache_salt`, or LoRA
adapter, the fields SGLang's prefix cache keys a prompt by) would continue the session's context:
read another tenant's conversation, and, if aborted, give it back to the tree under the second
tenant's key. So a session is bound to the namespace of its first turn (SGLang's
`/open_session` carries none), and a later turn from another namespace is refused, naming the
field, before SGLang's session code sees it (`sglang_ext.patches.shared.session_tenancy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: attribute of SGLang's `Session` holding its `Tenant` (set at its first turn)
TENANT_ATTR = "_sglang_ext_tenant"


@dataclass(frozen=True)
class Tenant:
    """The cache namespace of a request: what SGLang's prefix cache keys its prompt by."""

    extra_key: str | None
    cache_salt: str | None
    lora_id: str | None

    @classmethod
    def of(cls, req: Any) -> Tenant:
        """The namespace of a tokenized request (`TokenizedGenerateReqInput`)."""
        return cls(getattr(req, "extra_key", None), getattr(req, "cache_salt", None), getattr(req, "lora_id", None))


#: how each field is named to the client (the request field that sets it)
_FIELD_NAMES = {"extra_key": "extra_key", "cache_salt": "cache_salt", "lora_id": "lora_path"}


def bind(session: Any, turn: Tenant) -> Tenant:
    """The session's tenant: bound to `turn` if it has none yet. May mutate: the session (its
    `TENANT_ATTR`)."""
    bound = getattr(session, TENANT_ATTR, None)
    if bound is None:
        setattr(session, TENANT_ATTR, turn)
        return turn
    return bound


def refusal(session_id: str, bound: Tenant, turn: Tenant) -> str | None:
    """Why a turn of namespace `turn` may not continue session `session_id` bound to `bound`
    (None: it may). Names every field that differs, never their values (the session's are
    another tenant's)."""
    differs = [_FIELD_NAMES[name] for name in ("extra_key", "cache_salt", "lora_id")
               if getattr(bound, name) != getattr(turn, name)]
    if not differs:
        return None
    return (f"session_params.id {session_id!r}: this turn's {' and '.join(differs)} {'differs' if len(differs) == 1 else 'differ'} from the session's "
            "(a session belongs to the extra_key, cache_salt and LoRA adapter of its first turn); "
            "open a new session for this namespace")
