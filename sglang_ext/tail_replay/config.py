"""User-facing Tail-Replay knobs: one frozen dataclass, parsed and validated in one place.

Given as JSON (`--tail-replay-config '{"budget": 0.05}'`, or the env var
`SGLANG_EXT_TAIL_REPLAY_CONFIG`, a JSON object or a path to a JSON file). Unknown keys and
bad values fail at start-up with a message naming the key.

Every reader of the server's config calls `server_config()` (the variable is read by
`sglang_ext.env`, parsed here once per process and value); a request's overrides are checked by
`check_request` in the tokenizer process and resolved once more by `request_overrides` in the
scheduler when the request is first matched, then kept on its record (`tail_replay.request`:
SGLang sends the request between the two processes as msgspec data, so no Python object can travel
with it).

Server bookkeeping never comes from a client. The fields that mark the server's own background
runs (`audit_of`, `repair_of`, `repair_kind`: an audit's reference run, a repair run) are no config
keys at all: the tokenizer process sets them out of band, under `BACKGROUND_PARAM_KEY` in the
run's `custom_params`, after the request's fields were validated
(`patches/tail_replay/request.py`); a client sending that key, or one of those fields, gets a 400
naming it. A request's own `audit` / `repair` (and `repair_shared: true`) are refused unless the
server's config sets `allow_request_audit_repair` (each buys an extra exact prefill).

`DEFAULTS` is the default config, for benchmarks and evaluations that name the defaults.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from sglang_ext.env import tail_replay_config_text
from sglang_ext.tail_replay.decay_profile import (
    PERCENTILES,
    DecayProfile,
    DecayProfileError,
    default_profile_path,
    load_profile,
)
from sglang_ext.tail_replay.pressure import PressurePolicy, parse_policy

#: `--radix-cache-backend` name of Tail-Replay
BACKEND_NAME = "tail_replay"
KV_MODES = ("exact", "recompute")
#: `exactness`: "approximate" (reuse approximately where that pays), "exact_first" (exact wherever an
#: exact state is on the matched path, approximate only where there is none), "exact" (only exact nodes) or
#: "exact_unless_pressed" ("exact"; under `pressure`, "approximate" within its tolerance)
EXACTNESS = ("approximate", "exact_first", "exact", "exact_unless_pressed")
#: `state_order`: which stored state goes first under state pressure: "lru" (SGLang's order),
#: "ends" (a state its conversation has moved past first, then least recently used) or
#: "approximate_first" (a state that does not count as exact first, then least recently used);
#: "stock_last" (first a state that does not count as exact, then an exact one stock SGLang would no
#: longer hold, then stock's own in stock's LRU order); "auto" (the default): "stock_last" under
#: `exactness` "exact_first" / "exact" / "exact_unless_pressed", "lru" under "approximate"
#: (tail_replay/state_order.py)
STATE_ORDERS = ("auto", "lru", "ends", "approximate_first", "stock_last")
#: `repair_kind` of a repair run: a finished answer's sequence ("answer", `repair: true`) or a shared
#: state's prefix ("shared_state", `repair_shared: true`)
REPAIR_KINDS = ("answer", "shared_state")
#: per-request overrides: `sampling_params.custom_params["tail_replay"] = {"budget": 0.1, ...}`
REQUEST_PARAM_KEY = "tail_replay"
#: `budget: "auto"`: the window certified by the model's decay profile (tail_replay/decay_profile.py)
AUTO = "auto"


class TailReplayConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TailReplayConfig:
    #: replay window W as a fraction of the matched length L (W = budget * L, clamped below), or
    #: "auto": the W the model's decay profile certifies for `tolerance` (clamped below)
    budget: float | str = 0.05
    #: W is at least this many tokens ...
    min_replay_tokens: int = 64
    #: ... and at most this many
    max_replay_tokens: int = 4096
    #: matches shorter than this are not reused approximately (full recompute, or an exact checkpoint)
    min_match_tokens: int = 128
    #: also keep SGLang's own exact state checkpoints in the tree (False: the tree holds no states)
    keep_checkpoints: bool = True
    #: "exact": the new tokens attend to the exact cached KV of the whole match;
    #: "recompute": the replayed tail's attention KV is recomputed (approximate) too, and the request
    #: attends to its recomputed tail KV in prefill and decode; the tree keeps its exact KV
    kv_mode: str = "exact"
    #: budget "auto": the replayed state's relative error bound to certify, in (0, 1)
    tolerance: float = 0.01
    #: budget "auto": which per-token decay percentile of the slowest head the bound uses
    decay_percentile: int = 90
    #: the decay profile file (default: decay.json in the model folder, found at start-up)
    decay_profile: str | None = None
    #: "approximate": reuse every cached token, replaying approximately where no exact state is
    #: near; "exact_first": where an exact state is on the matched path, resume from it and
    #: recompute the rest exactly (stock SGLang's hit, served as stock serves it), and replay
    #: approximately only where there is none (where stock misses); "exact": reuse only strictly
    #: exact nodes and states (bound 0), recompute the rest (SGLang's semantics: every output
    #: equals a server without cache)
    exactness: str = "exact_first"
    #: a node or state whose bound (tail_replay/provenance.py) is at most this counts as exact
    #: in the "approximate" mode (float noise of the linear state, relative); 0: only bound 0
    exact_threshold: float = 1e-5
    #: live quality audit (tail_replay/audit.py): the share of approximate answers (provenance not
    #: exact) re-run as an exact prefill in the background, whose next-token distribution is compared
    #: with the served one; 0: off (server setting only)
    audit_rate: float = 0.0
    #: audit this request whatever it was (exact or not); per request only, and only on a server
    #: with `allow_request_audit_repair`
    audit: bool = False
    #: set by the server on its own audit re-runs (out of band, `BACKGROUND_PARAM_KEY`): the rid of
    #: the request this one is the reference for (never audited itself); not a key
    audit_of: str | None = None
    #: exact repair (tail_replay/repair.py): when an answer that was not exact finishes, its
    #: sequence (prompt and output) is recomputed exactly in the background, so the tree's nodes
    #: along it and its end state become exact and the conversation's next turn resumes exactly
    #: (server default, and per request on a server with `allow_request_audit_repair`)
    repair: bool = False
    #: shared-state repair (tail_replay/repair.py): when a request's matched path ends its states
    #: at one that does not count as exact and that conversations branch from (the tree branches
    #: below it before any other state: e.g. the end of a shared system prompt that an
    #: approximate replay reached first), that state is recomputed exactly in the background, once, so later
    #: conversations branching there resume exactly, as on stock SGLang (server default; a request
    #: may turn it off, and on only on a server with `allow_request_audit_repair`)
    repair_shared: bool = True
    #: set by the server on its own repair runs (out of band, `BACKGROUND_PARAM_KEY`): the rid of
    #: the request being repaired (never repaired or audited itself); not a key
    repair_of: str | None = None
    #: set by the server on its own repair runs (out of band): what it repairs (one of
    #: `REPAIR_KINDS`); not a key
    repair_kind: str = "answer"
    #: whether a request may set `audit` / `repair` itself (each buys a full-vocabulary
    #: log-softmax or an extra exact prefill); false: such a request gets a 400 (server setting only)
    allow_request_audit_repair: bool = False
    #: which stored state is freed first when the state pool is full: "lru" (SGLang's order:
    #: least recently used) or "ends" (first a state its conversation has moved past, i.e. whose
    #: node continues in exactly one child with a state further down, least recently used first;
    #: then least recently used), keeping conversation ends and branch points, or
    #: "approximate_first" (first a state that does not count as exact, least recently used
    #: first; then least recently used), keeping the exact states stock SGLang would hold, or
    #: "stock_last" (approximate and untracked states first, then exact states stock SGLang would
    #: no longer hold, then stock's own in stock's order: none of Tail-Replay's own states displaces
    #: an exact one stock holds), or "auto": "stock_last" unless the server's `exactness` is
    #: "approximate" ("lru")
    #: (server setting only)
    state_order: str = "auto"
    #: "exact_unless_pressed": the load thresholds and tolerance (JSON object, server only; pressure.py)
    pressure: PressurePolicy | None = None
    #: the thresholds the request's pressure stamp says were met at its arrival (out of band); not a key
    pressed_by: tuple[str, ...] = ()
    #: the profile read from `decay_profile` (not a key: filled when the config is parsed)
    profile: DecayProfile | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.budget, str):
            _check(self.budget == AUTO, "budget", f"must be a number in [0, 1] or {AUTO!r}, got {self.budget!r}")
        else:
            _check(0.0 <= self.budget <= 1.0, "budget", f"must be in [0, 1] or {AUTO!r}, got {self.budget}")
        _check(0.0 < self.tolerance < 1.0, "tolerance", f"must be in (0, 1), got {self.tolerance}")
        _check(self.decay_percentile in PERCENTILES, "decay_percentile",
               f"must be one of {PERCENTILES}, got {self.decay_percentile!r}")
        _check(self.min_replay_tokens >= 0, "min_replay_tokens", f"must be >= 0, got {self.min_replay_tokens}")
        _check(self.max_replay_tokens >= self.min_replay_tokens, "max_replay_tokens",
               f"must be >= min_replay_tokens ({self.min_replay_tokens}), got {self.max_replay_tokens}")
        _check(self.min_match_tokens >= 0, "min_match_tokens", f"must be >= 0, got {self.min_match_tokens}")
        _check(self.kv_mode in KV_MODES, "kv_mode", f"must be one of {KV_MODES}, got {self.kv_mode!r}")
        _check(self.exactness in EXACTNESS, "exactness", f"must be one of {EXACTNESS}, got {self.exactness!r}")
        _check(0.0 <= self.exact_threshold < 1.0, "exact_threshold",
               f"must be in [0, 1), got {self.exact_threshold}")
        _check(0.0 <= self.audit_rate <= 1.0, "audit_rate", f"must be in [0, 1], got {self.audit_rate}")
        _check(self.repair_kind in REPAIR_KINDS, "repair_kind",
               f"must be one of {REPAIR_KINDS}, got {self.repair_kind!r}")
        _check(self.state_order in STATE_ORDERS, "state_order", f"must be one of {STATE_ORDERS}, got {self.state_order!r}")
        if self.pressure is not None and not isinstance(self.pressure, PressurePolicy):
            object.__setattr__(self, "pressure", parse_policy(self.pressure, TailReplayConfigError))
        _check(self.exactness != "exact_unless_pressed" or self.pressure is not None, "exactness",
               "needs the 'pressure' thresholds")

    @property
    def strict(self) -> bool:
        """`exactness: "exact"`: only strictly exact nodes and states are reused."""
        return self.exactness == "exact" or (self.exactness == "exact_unless_pressed" and not self.pressed_by)

    @property
    def exact_first(self) -> bool:
        """`exactness: "exact_first"`: an exact state on the matched path is always taken."""
        return self.exactness == "exact_first"

    @property
    def background(self) -> bool:
        """A run the server sent itself (an audit's reference, a repair): not traffic."""
        return self.audit_of is not None or self.repair_of is not None

    @property
    def threshold(self) -> float:
        """The bound up to which a node counts as exact for this config (0 in the exact mode)."""
        return 0.0 if self.strict else self.exact_threshold


_TYPES: dict[str, type | tuple[type, ...]] = {
    "budget": (int, float, str), "min_replay_tokens": int, "max_replay_tokens": int,
    "min_match_tokens": int, "keep_checkpoints": bool, "kv_mode": str,
    "tolerance": (int, float), "decay_percentile": int, "decay_profile": str,
    "exactness": str, "exact_threshold": (int, float), "audit_rate": (int, float), "audit": bool,
    "state_order": str, "repair": bool, "repair_shared": bool, "allow_request_audit_repair": bool, "pressure": dict}
#: keys a request may not set (a file path, what counts as exact, how much of its traffic is
#: audited, whether requests may ask for background runs and the state pool's eviction order are
#: the server's business)
_SERVER_ONLY = ("decay_profile", "exact_threshold", "audit_rate", "state_order", "allow_request_audit_repair", "pressure")
#: keys only a request sets (what happens to one request)
_REQUEST_ONLY = ("audit",)
#: keys a request sets only where the server allows it (`allow_request_audit_repair`)
_ALLOWED_BY_SERVER = ("audit", "repair")
#: keys a request may turn off (cheaper), but turn on only where the server allows it
#: (`allow_request_audit_repair`: each repair buys an extra exact prefill)
_OFF_BY_REQUEST = ("repair_shared",)
#: the server's marks on its own background runs: set out of band (`BACKGROUND_PARAM_KEY`), never
#: by a client or a server config
BACKGROUND_FIELDS = ("audit_of", "repair_of", "repair_kind")
#: `custom_params` key of the server's mark on its own background runs (`BACKGROUND_FIELDS` and the
#: config values the run needs); refused from a client, set in the tokenizer process after the
#: request's fields were validated (patches/tail_replay/request.py)
BACKGROUND_PARAM_KEY = "tail_replay_background"
#: the config knob that allows `_ALLOWED_BY_SERVER` (and `_OFF_BY_REQUEST` set to true)
ALLOW_KNOB = "allow_request_audit_repair"


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise TailReplayConfigError(f"tail-replay config key {key!r}: {message}")


#: the defaults (what a server without `--tail-replay-config` runs with)
DEFAULTS = TailReplayConfig()


def _check_fields(raw: dict, where: str) -> None:
    known = set(_TYPES)
    for key in BACKGROUND_FIELDS:
        _check(key not in raw, key, f"is set by the server on its own background runs; {where} cannot set it")
    for key, value in raw.items():
        _check(key in known, key, f"unknown key; known keys: {sorted(known)}")
        expected = _TYPES[key]
        wrong_bool = isinstance(value, bool) and expected is not bool
        _check(isinstance(value, expected) and not wrong_bool, key, f"has the wrong type ({value!r})")


def _with_profile(config: TailReplayConfig) -> TailReplayConfig:
    """Read the profile `decay_profile` names (once per process and path)."""
    if config.decay_profile is None:
        return config
    try:
        return replace(config, profile=load_profile(config.decay_profile))
    except DecayProfileError as exc:
        raise TailReplayConfigError(f"tail-replay config key 'decay_profile': {exc}") from None


def config_from_dict(raw: dict) -> TailReplayConfig:
    """The server's config from its JSON object."""
    _check_fields(raw, "a server config")
    for key in _REQUEST_ONLY:
        _check(key not in raw, key, "is a per-request key; a server config cannot set it")
    return _with_profile(TailReplayConfig(**raw))


def user_settings(config: TailReplayConfig) -> dict:
    """The config's server keys and values as a user writes them (no derived fields, no per-request
    keys)."""
    return {name: (v.as_dict() if isinstance(v := getattr(config, name), PressurePolicy) else v)
            for name in _TYPES if name not in _REQUEST_ONLY}


def with_overrides(base: TailReplayConfig, overrides: object) -> TailReplayConfig:
    """`base` with a request's overrides applied; raises TailReplayConfigError naming the key."""
    if overrides is None:
        return base
    if not isinstance(overrides, dict):
        raise TailReplayConfigError(f"custom_params[{REQUEST_PARAM_KEY!r}] must be a JSON object")
    _check_fields(overrides, "a request")
    for key in _SERVER_ONLY:
        _check(key not in overrides, key, "is a server setting; a request cannot set it")
    for key in _ALLOWED_BY_SERVER:
        _check(key not in overrides or base.allow_request_audit_repair, key,
               f"is refused on this server: per-request audit and repair are off (server config key "
               f"{ALLOW_KNOB!r} is false)")
    for key in _OFF_BY_REQUEST:
        _check(overrides.get(key) is not True or base.allow_request_audit_repair, key,
               f"true is refused on this server: per-request audit and repair are off (server config key "
               f"{ALLOW_KNOB!r} is false); a request may only set it to false")
    config = replace(base, **overrides)
    _check(config.budget != AUTO or config.profile is not None, "budget",
           f"{AUTO!r} needs the model's decay profile, and this server has none")
    return config


@functools.lru_cache(maxsize=4)
def _parsed(text: str | None) -> TailReplayConfig:
    return parse_config(text)


def server_config() -> TailReplayConfig:
    """The server's config (`SGLANG_EXT_TAIL_REPLAY_CONFIG`), parsed once per process and value of
    the variable (requests call this: no JSON or file read per request); TailReplayConfigError
    naming the key when it is bad."""
    return _parsed(tail_replay_config_text())


def parse_config(text: str | None) -> TailReplayConfig:
    """Parse a JSON object, or the path of a JSON file; None or '' gives the defaults."""
    if not text:
        return TailReplayConfig()
    source = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise TailReplayConfigError(f"tail-replay config {text!r} is neither a JSON object nor a file")
        source = path.read_text()
    try:
        raw = json.loads(source)
    except json.JSONDecodeError as exc:
        raise TailReplayConfigError(f"tail-replay config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TailReplayConfigError("tail-replay config must be a JSON object")
    return config_from_dict(raw)


def with_model_profile(text: str | None, model_path: str) -> str | None:
    """The config text, plus `decay_profile` = the model folder's decay.json when the config names
    none and the folder has one (so `budget: "auto"` works, also per request); else `text`."""
    config = parse_config(text)
    path = default_profile_path(model_path) if config.decay_profile is None else None
    if path is None:
        return text
    settings = {k: v for k, v in user_settings(config).items() if v is not None}
    return json.dumps({**settings, "decay_profile": path})

