"""SAE's server config: ``--radix-eviction-policy-config`` of ``sae`` (SAEConfig keys plus the
server's own), validated once at start-up (``parse_server_config``, errors name the key).
Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from ..sae import SAEConfig, SAEConfigError

_SAE_KEYS = {f.name for f in fields(SAEConfig)}
SERVER_KEYS = ("block_tokens", "clock", "state_order", "max_sessions")
#: sessions SAE tracks at most (``max_sessions``): past it the least recently used session of the
#: tenant holding the most goes (``sessions.SessionTable``); each costs well under 1 KiB
DEFAULT_MAX_SESSIONS = 16384
#: ``state_order``: who orders the recurrent-state checkpoints a state-eviction walk frees
STATE_ORDERS = ("sae", "lru")
#: the ``state_order`` each backend gets when the config does not set it, from the live
#: kv-cache-tester replay (docs/saecache.md, "Live"): on the default backend a freed state takes
#: its whole leaf, and SAE's order cost reuse there; under Tail-Replay the state alone goes
DEFAULT_STATE_ORDER = {"default": "lru", "tail_replay": "sae"}


@dataclass(frozen=True)
class ServerConfig:
    """``--radix-eviction-policy-config`` of ``sae``: SAEConfig keys plus ``block_tokens``
    (tokens per SAE block: the unit of sizes and of the residence time) and ``clock``
    (``"wall"``: seconds; ``"requests"``: one tick per request, deterministic) and
    ``state_order`` (``"sae"``: SAE's rule orders the recurrent-state checkpoints a walk frees,
    ``ServerSAE.state_order``; ``"lru"``: SGLang's least-recently-used walk; ``None``, the
    default: per backend, ``DEFAULT_STATE_ORDER``) and ``max_sessions`` (the bound of the
    session table, keyed by tenant: ``DEFAULT_MAX_SESSIONS``)."""

    sae: SAEConfig = SAEConfig()
    block_tokens: int = 16
    clock: str = "wall"
    state_order: str | None = None
    max_sessions: int = DEFAULT_MAX_SESSIONS

    def state_order_for(self, backend: str) -> str:
        """``"sae"`` or ``"lru"``: the state order on ``backend`` (``"default"`` or
        ``"tail_replay"``)."""
        return self.state_order or DEFAULT_STATE_ORDER[backend]


def parse_server_config(raw: Mapping | None) -> ServerConfig:
    """Validate the JSON object; raise ``SAEConfigError`` naming the key."""
    raw = dict(raw or {})
    for key in raw:
        if key not in _SAE_KEYS and key not in SERVER_KEYS:
            raise SAEConfigError(f"--radix-eviction-policy-config key {key!r} is not a setting of "
                                 f"'sae'; known: {sorted(_SAE_KEYS | set(SERVER_KEYS))}")
    block = raw.pop("block_tokens", 16)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise SAEConfigError(f"--radix-eviction-policy-config key 'block_tokens' must be an integer >= 1, got {block!r}")
    clock = raw.pop("clock", "wall")
    if clock not in ("wall", "requests"):
        raise SAEConfigError(f"--radix-eviction-policy-config key 'clock' must be 'wall' or 'requests', got {clock!r}")
    max_sessions = raw.pop("max_sessions", DEFAULT_MAX_SESSIONS)
    if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
        raise SAEConfigError(f"--radix-eviction-policy-config key 'max_sessions' must be an integer >= 1, "
                             f"got {max_sessions!r}")
    state_order = raw.pop("state_order", None)
    if state_order is not None and state_order not in STATE_ORDERS:
        raise SAEConfigError(f"--radix-eviction-policy-config key 'state_order' must be one of "
                             f"{list(STATE_ORDERS)} (or absent: per backend), got {state_order!r}")
    for f in fields(SAEConfig):
        if f.name in raw:
            value, default = raw[f.name], f.default
            kind = type(default)
            ok = (isinstance(value, bool) if kind is bool else
                  (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind)))
            if not ok:
                raise SAEConfigError(f"--radix-eviction-policy-config key {f.name!r} must be "
                                     f"{kind.__name__}, got {value!r}")
    try:
        sae = SAEConfig(**raw)
    except SAEConfigError as exc:
        raise SAEConfigError(f"--radix-eviction-policy-config: {exc}") from None
    return ServerConfig(sae=sae, block_tokens=block, clock=clock, state_order=state_order,
                        max_sessions=max_sessions)
